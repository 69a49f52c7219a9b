"""The progress line of pulls and of variants made on pull."""

from __future__ import annotations

import sys

import click


def progress_printer():
    """A registry progress callback: one updating line on a terminal, one line per finished stage otherwise."""
    tty = sys.stderr.isatty()
    last = {}

    def cb(stage: str, done: int, total: int) -> None:
        if stage == "quantize":                  # counted in layers, not bytes
            if tty or done >= total:
                click.echo(f"\rquantize: layer {done} / {total}", err=True, nl=done >= total)
            return
        pct = int(100 * done / total) if total else None
        finished = total and done >= total
        if tty and last.get(stage) != (pct if total else done >> 24):
            last[stage] = pct if total else done >> 24
            shown = f"{done / 1e6:8.1f} / {total / 1e6:.1f} MB ({pct:3d}%)" if total else f"{done / 1e6:8.1f} MB"
            click.echo(f"\r{stage}: {shown}", err=True, nl=bool(finished))
        elif not tty and finished:
            click.echo(f"{stage}: {total / 1e6:.1f} MB done", err=True)

    return cb
