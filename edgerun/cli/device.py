"""`edgerun profile show|detect|list|probe`: device profiles and hardware probes."""

from __future__ import annotations

import dataclasses
import json

import click

from ..device.detect import detect, gather_facts, resolve
from ..device.gpu import status_for, status_lines
from ..resolve import resolve_model
from ..device.profiles import all_profiles


@click.group("profile")
def profile_group() -> None:
    """Device profiles (board detection, engine settings) and hardware probes."""


def _profile_lines(prof, why: str | None) -> list[str]:
    a = prof.backend_args()
    lines = [f"profile     {prof.name}  ({prof.path})", f"device      {prof.description}"]
    if why:
        lines.append(f"why         {why}")
    budget = (f"{prof.memory.budget_gib:g} GiB" if prof.memory.budget_gib is not None
              else f"{prof.memory.budget_fraction:.0%} of RAM")
    lines += [
        f"llama.cpp   n_gpu_layers={a.n_gpu_layers} n_threads={a.n_threads or 'physical cores'} n_ctx={a.n_ctx} "
        f"n_batch={a.n_batch} flash_attn={a.flash_attn} mmap={a.use_mmap} mlock={a.use_mlock}",
        f"onnxruntime {', '.join(a.providers)}",
        f"memory      budget {budget}{' (unified CPU/GPU)' if prof.memory.unified else ''}",
        f"priors      {prof.priors.bandwidth_gbs} GB/s, {prof.priors.peak_gflops} GFLOP/s ({prof.priors.compute}); "
        f"gamma_max {prof.gamma_max}",
        f"build       CMAKE_ARGS=\"{prof.build.cmake_args}\"" + "".join(f" {k}={v}" for k, v in prof.build.env.items()),
    ]
    return lines


_model_option = click.option("--model", "-m", default=None,
                             help="Also load this model's weights (cached name or .gguf; no download) and show "
                                  "where its layers land.")


@profile_group.command("show")
@click.argument("name", default="auto")
@click.option("--json", "as_json", is_flag=True, help="Print the whole profile as JSON.")
@_model_option
def profile_show(name, as_json, model):
    """Show a profile (NAME, a YAML path, or 'auto' for the detected one)."""
    prof, why = resolve(name)
    st = status_for(prof, resolve_model(model, pull=False) if model else None)
    if as_json:
        click.echo(json.dumps({**prof.to_dict(), "reason": why, "gpu": st.to_dict()}, indent=1))
    else:
        click.echo("\n".join(_profile_lines(prof, why) + status_lines(st)))


@profile_group.command("detect")
@click.option("--root", default=None, help="Read the board's identity files under this directory "
              "(default: $EDGERUN_DEVICE_ROOT, else /).")
@click.option("--json", "as_json", is_flag=True, help="Print the chosen profile, the reason and the facts as JSON.")
@_model_option
def profile_detect(root, as_json, model):
    """Detect the device and say which profile fits and why, and where llama.cpp's layers run."""
    prof, why = detect(root)
    facts = dataclasses.asdict(gather_facts(root))
    st = status_for(prof, resolve_model(model, pull=False) if model else None)
    if as_json:
        click.echo(json.dumps({"profile": prof.name, "reason": why, "facts": facts, "gpu": st.to_dict()}, indent=1))
    else:
        click.echo(f"{prof.name}\n  because: {why}")
        for k, v in facts.items():
            click.echo(f"  {k}: {v}")
        for line in status_lines(st):
            click.echo(f"  {line}")


@profile_group.command("list")
def profile_list():
    """List the known profiles (shipped and user)."""
    for p in all_profiles():
        click.echo(f"{p.name:22s} {p.description}")


@profile_group.command("probe")
@click.option("--profile", "profile_name", default="auto", show_default=True, help="Device profile (for the priors).")
@click.option("--model", "-m", default=None, help="Also measure this target's verify cost curve T(n), n = 1..16.")
@click.option("--draft", "-d", default=None, help="... and this drafter's step time ('lookup' or a model).")
@click.option("--size-mib", type=click.IntRange(1, None), default=None, help="Bytes per bandwidth array (default: >> LLC).")
@click.option("--threads", type=click.IntRange(1, None), default=None, help="Bandwidth threads (default: physical cores).")
@click.option("--remeasure", is_flag=True, help="Ignore the cached cost curve and measure again.")
@click.option("--no-pull", is_flag=True, help="Fail instead of downloading a missing model.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def profile_probe(profile_name, model, draft, size_mib, threads, remeasure, no_pull, as_json):
    """Measure memory bandwidth (and a model pair's cost curve); results are cached for the gamma tuner."""
    # lazily: the probe loads models (backends, resolve, drafters: ~0.6 s of imports measured here) that
    # show, detect and list never need
    from ..profile_probe import bandwidth_report, cost_report

    prof, _ = resolve(profile_name)
    bw = bandwidth_report(prof, array_bytes=size_mib * 1024 * 1024 if size_mib else None, threads=threads)
    cost = cost_report(prof, model, draft, remeasure=remeasure, pull=not no_pull) if model else None
    if as_json:
        click.echo(json.dumps({"bandwidth": bw, "cost": cost}, indent=1))
        return
    click.echo(f"memory bandwidth on {prof.name} (datasheet {bw['datasheet_gbs']} GB/s):")
    click.echo(f"  {'where':6s} {'method':6s} {'threads':>7s} {'MiB':>6s} {'copy GB/s':>10s} {'triad GB/s':>11s} "
               f"{'of datasheet':>13s} {'numpy copy':>11s} {'ratio':>6s}")
    for r in bw["results"]:
        frac = f"{r['fraction_of_datasheet']:.0%}" if r["fraction_of_datasheet"] else "-"
        chk = f"{r['check_copy_gbs']:.1f}" if r.get("check_copy_gbs") else "-"
        ratio = f"{r['check_ratio']:.2f}" if r.get("check_ratio") else "-"
        click.echo(f"  {r['where']:6s} {r['method']:6s} {r['threads']:7d} {r['array_bytes'] // 2**20:6d} "
                   f"{r['copy_gbs']:10.1f} {r['triad_gbs']:11.1f} {frac:>13s} {chk:>11s} {ratio:>6s}")
    if cost:
        click.echo(f"cost curve of {cost['model']}: T(1) = {cost['t_verify_s'][0] * 1e3:.2f} ms")
        click.echo("  n         " + "".join(f"{n:6d}" for n in range(1, len(cost["ratios"]) + 1)))
        click.echo("  T(n)/T(1) " + "".join(f"{r:6.2f}" for r in cost["ratios"]))
        if cost["draft"]:
            click.echo(f"drafter {cost['draft']}: {cost['t_draft_s'] * 1e3:.3f} ms per token "
                       f"({cost['draft_vs_target']:.2f} x a target step)")
