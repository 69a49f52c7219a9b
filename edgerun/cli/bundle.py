"""`edgerun bundle`: an offline install bundle for one board (edgerun/bundle/ does the work)."""

from __future__ import annotations

import sys
from pathlib import Path

import click


@click.command("bundle")
@click.option("--profile", "profile_name", required=True,
              help="The board's device profile (`edgerun profile list`) or a profile YAML path.")
@click.option("--model", "-m", "models", multiple=True,
              help="A registry model, NAME@VARIANT or hub name (hf:ORG/REPO[@REV][:QUANT|/FILE.gguf], pulled if "
                   "not cached) to ship; repeatable; the first is the served one. Default: smollm2-135m-instruct.")
@click.option("--draft", default="auto", show_default=True,
              help="Drafter to ship and serve with: auto (the first model's pair, as `--draft auto` finds it; else "
                   "suffix lookup), none, suffix, lookup, or a model name (a hub name too).")
@click.option("--python", "python_version", default="3.11", show_default=True,
              help="The board's CPython MAJOR.MINOR (Raspberry Pi OS / Debian bookworm: 3.11).")
@click.option("--glibc", default=None,
              help="The board's glibc (`ldd --version`): newest manylinux wheels allowed. Default: 2.36 for a Pi, "
                   "2.35 for a Jetson, 2.31 otherwise.")
@click.option("--llama-wheel", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="A llama-cpp-python wheel built for the board with its profile's CMAKE_ARGS (+ -DGGML_RPC=on); "
                   "default: built here when this machine is of the board's kind.")
@click.option("-o", "--out", required=True, type=click.Path(path_type=Path),
              help="The bundle: a folder, or FILE.tar.")
def bundle_command(profile_name, models, draft, python_version, glibc, llama_wheel, out):
    """Everything a board with no network needs: wheels, models, unit, install.sh (docs/deploy.md)."""
    from ..bundle import BundleSpec, make_bundle
    from .progress import progress_printer
    from ..util.atomic import stop_on_signal

    stop_on_signal()
    spec = BundleSpec(profile=profile_name, out=out, models=tuple(models), draft=draft, python=python_version,
                      glibc=glibc, llama_wheel=llama_wheel)
    res = make_bundle(spec, progress=progress_printer(), say=lambda line: click.echo(line, err=True))
    t = res.manifest["target"]
    click.echo(f"bundle {res.path}: {res.n_files} files, {res.size / 1e6:.1f} MB, for {res.manifest['profile']} "
               f"(CPython {t['python']}, {t['machine']}, glibc >= {t['glibc']}) in {res.seconds:.0f} s")
    inner = f"tar xf {res.path.name} && cd {res.path.name[:-4]}" if res.path.name.endswith(".tar") else f"cd {res.path.name}"
    click.echo(f"on the board: {inner} && sudo ./install.sh   (--dry-run prints the plan)")
    sys.stdout.flush()
