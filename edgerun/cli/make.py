"""Making and checking model files: `edgerun quantize`, `edgerun eval ppl`, `edgerun export onnx`,
`edgerun convert`."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import click

from ..config import QuantArgs
from ..convert import convert
from ..eval.perplexity import compare, perplexity
from ..eval.texts import load_text
from ..onnx.export import export_onnx
from ..onnx.layout import read_config
from ..resolve import quantize as quantize_model, resolve_model
from ..util.atomic import stop_on_signal


@click.command()
@click.argument("source")
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--method", default="awq", show_default=True, help="awq (activation-aware search) or rtn (round-to-nearest).")
@click.option("--format", "fmt", default="q4_0", show_default=True, help="Storage format of the linear weights: q4_0, q4_1, iq4_nl (Q4_0's size and CPU speed, a non-uniform grid) or q4_k (super-blocks of 256, round-to-nearest only; a source's Q4_K tensors are kept as stored).")
@click.option("--calib", default="builtin", show_default=True,
              help="Calibration text: 'builtin' (CPython's reference prose), 'stdlib-code', or a text file.")
@click.option("--calib-tokens", type=int, default=4096, show_default=True, help="Calibration tokens (cut into 512-token sequences).")
@click.option("--embed-type", default="q8_0", show_default=True, help="Token embeddings / output head: q8_0, q4_0, iq4_nl or q4_k (4-bit head: fastest speculation on a CPU) or f16.")
@click.option("--grid", type=int, default=20, show_default=True, help="AWQ scale exponents tried per group.")
@click.option("--no-pull", is_flag=True, help="Fail instead of downloading a registry model that is not cached.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def quantize(source, out, method, fmt, calib, calib_tokens, embed_type, grid, no_pull, as_json):
    """Quantize SOURCE (registry name, .gguf, Hugging Face checkpoint dir, or hub name hf:ORG/REPO of a float
    checkpoint, downloaded first) to an INT4 GGUF at OUT."""
    stop_on_signal()
    args = QuantArgs(method=method, format=fmt, calib=calib, calib_tokens=calib_tokens, embed_type=embed_type,
                     grid=grid)

    shown = []

    def cb(msg: str, done: int, total: int) -> None:
        click.echo(f"\r[{done}/{total}] {msg}".ljust(100), err=True, nl=done >= total)
        shown[:] = [done < total]

    try:
        rep = quantize_model(source, out, args, progress=None if as_json else cb, pull=not no_pull)
    finally:
        if shown and shown[0]:
            click.echo("", err=True)            # end the progress line before an error message
    if as_json:
        click.echo(json.dumps(rep.to_dict(), indent=1))
        return
    click.echo(f"wrote {rep.out}: {rep.method} {rep.format}, {rep.n_layer} layers, {rep.seconds:.1f} s, "
               f"peak RSS {rep.peak_rss_mb:.0f} MB")
    if rep.method == "awq":
        n = {c: sum(g.choice == c for g in rep.groups) for c in ("awq", "clip", "rtn")}
        click.echo(f"calibration: {rep.calib_tokens} tokens of {rep.calib_name}; output error "
                   f"-{100 * rep.error_reduction:.1f}% vs round-to-nearest; groups: {n['awq']} awq, "
                   f"{n['clip']} clip only, {n['rtn']} fallback to rtn")


@click.group("eval")
def eval_group() -> None:
    """Evaluate models (perplexity)."""


@eval_group.command("ppl")
@click.argument("model")
@click.option("--text", "text_spec", required=True,
              help="Text file, or 'builtin' (CPython reference prose) / 'stdlib-code' (CPython stdlib source).")
@click.option("--ctx", type=int, default=512, show_default=True, help="Window length in tokens.")
@click.option("--threads", "n_threads", type=int, default=None, help="CPU threads.")
@click.option("--max-windows", type=int, default=None, help="Score only the first N windows.")
@click.option("--no-pull", is_flag=True, help="Fail instead of downloading a registry model that is not cached.")
@click.option("--vs", "other", default=None, metavar="MODEL2",
              help="Also score MODEL2 on the same windows and print PPL(MODEL) / PPL(MODEL2) with a paired "
                   "95% interval (e.g. an AWQ file against the RTN one).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def eval_ppl(model, text_spec, ctx, n_threads, max_windows, no_pull, other, as_json):
    """Perplexity of MODEL on a text, scored like llama.cpp's llama-perplexity (second half of each window)."""
    name, text = load_text(text_spec)
    paths = [resolve_model(m, pull=not no_pull) for m in ([model] if other is None else [model, other])]
    res = [perplexity(p, text, ctx=ctx, n_threads=n_threads, max_windows=max_windows, text_name=name)
           for p in paths]
    pair = compare(res[0], res[1]) if len(res) == 2 and res[0].n_windows > 1 else None
    if as_json:
        if other is None:
            click.echo(json.dumps(res[0].to_dict(), indent=1))
        else:
            click.echo(json.dumps({"model": res[0].to_dict(), "vs": res[1].to_dict(),
                                   "ratio": None if pair is None else dict(zip(("ppl_ratio", "lo95", "hi95"), pair))},
                                  indent=1))
        return
    for r in res:
        click.echo(f"{r.model} on {r.text}: PPL {r.ppl:.4f} (nll {r.nll:.4f} +/- {r.nll_stderr:.4f}; "
                   f"{r.n_windows} windows x ctx {r.ctx}, {r.n_scored} tokens scored; {r.seconds:.1f} s)")
    if other is not None:
        if pair is None:
            click.echo("paired ratio: needs at least 2 windows")
        else:
            click.echo(f"PPL {res[0].model} / {res[1].model} = {pair[0]:.4f} (95% {pair[1]:.4f} .. {pair[2]:.4f}, "
                       f"paired over {res[0].n_windows} windows)")


# ---- ONNX export: `edgerun export onnx` (edgerun/onnx/) ---------------------------------

@click.group("export")
def export_group() -> None:
    """Export a model for another runtime (ONNX for onnxruntime / onnxruntime-genai)."""


@export_group.command("onnx")
@click.argument("source")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--ctx", "n_ctx", type=click.IntRange(16, None), default=None,
              help="Positions the graph supports (default: the model's training context, at most 32768).")
@click.option("--accuracy-level", type=click.IntRange(0, 4), default=4, show_default=True,
              help="MatMulNBits activation precision: 4 = int8 (onnxruntime's fast CPU path), 1 = fp32.")
@click.option("--force", is_flag=True, help="Replace an earlier export at OUT_DIR.")
@click.option("--no-pull", is_flag=True, help="Fail instead of downloading a registry model that is not cached.")
@click.option("--json", "as_json", is_flag=True, help="Print the export's edgerun.json.")
def export_onnx_cmd(source, out_dir, n_ctx, accuracy_level, force, no_pull, as_json):
    """Export SOURCE (registry name, .gguf, or Hugging Face checkpoint dir) to an ONNX decoder in OUT_DIR.

    Q4_0/Q8_0 weights (edgerun quantize's output) become MatMulNBits without loss; other types are
    re-quantized to Q4_0. OUT_DIR then works wherever a model is accepted (--model, --draft).
    """
    stop_on_signal()
    src = Path(source) if Path(source).exists() else resolve_model(source, pull=not no_pull)
    out = export_onnx(src, out_dir, n_ctx=n_ctx, accuracy_level=accuracy_level, force=force,
                      progress=None if as_json else (lambda msg: click.echo(msg, err=True)))
    cfg = read_config(out)
    if as_json:
        click.echo(json.dumps(asdict(cfg), indent=1))
        return
    lossy = [k for k, v in cfg.conversions.items() if not v.endswith("(lossless)")]
    click.echo(f"wrote {out}: {cfg.model.arch}, {cfg.model.n_layer} layers, vocab {cfg.model.n_vocab}, n_ctx {cfg.n_ctx}, "
               f"{cfg.weight_bytes / 1e6:.1f} MB of weights per token; "
               + ("all weights converted without loss" if not lossy
                  else f"{len(lossy)} of {len(cfg.conversions)} weight tensors re-quantized"))


# ---- INT4 checkpoint import: `edgerun convert` (edgerun/convert/) ---------------------------

@click.command("convert")
@click.argument("source", type=click.Path(file_okay=False))
@click.argument("out", type=click.Path())
@click.option("--exact", is_flag=True, help="Store asymmetric weights as Q5_0 (bit-exact for every zero point) "
              "instead of Q4_1.")
@click.option("--ctx", "n_ctx", type=click.IntRange(16, None), default=None, help="ONNX output: positions the graph supports.")
@click.option("--accuracy-level", type=click.IntRange(0, 4), default=4, show_default=True,
              help="ONNX output: MatMulNBits activation precision (4 = int8, 1 = fp32).")
@click.option("--force", is_flag=True, help="ONNX output: replace an earlier export at OUT.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def convert_cmd(source, out, exact, n_ctx, accuracy_level, force, as_json):
    """Import a published INT4 checkpoint SOURCE (AutoAWQ, GPTQ, compressed-tensors) into OUT.

    OUT ending in .gguf is a GGUF for llama.cpp (symmetric weights Q4_0, asymmetric Q4_1 or, with
    --exact, Q5_0, keeping the checkpoint's codes and scales); any other OUT is an ONNX directory
    (MatMulNBits with the checkpoint's groups and zero points).
    """
    stop_on_signal()
    rep = convert(source, out, exact=exact, n_ctx=n_ctx, accuracy_level=accuracy_level, force=force)
    if as_json:
        click.echo(json.dumps(rep.to_dict(), indent=1))
        return
    stored = ", ".join(f"{n} {t}" for t, n in sorted(rep.storage.items()))
    line = f"wrote {rep.out}: {rep.scheme} g{rep.group_size} {rep.zero_point}; {stored}"
    if rep.kind == "gguf" and rep.n_blocks:
        line += (f"; {100 * rep.exact_share:.2f}% of {rep.n_blocks} blocks bit-exact, max |dw|/s "
                 f"{rep.max_rel_err:.4g}")
    click.echo(line + f"; {rep.seconds:.1f} s, peak RSS {rep.peak_rss_mb:.0f} MB")
