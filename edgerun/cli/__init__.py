"""`edgerun` command line: a thin click layer over the Python API, one module per command group.

The group loads a command's module only when that command runs (or when --help lists them all), so a
one-shot command imports what it uses and nothing else. Every EdgerunError becomes one line on stderr
(`error: ...`) and exit code 2, never a traceback.
"""

from __future__ import annotations

import importlib
import logging
import sys

import click

from ..errors import EdgerunError
from ..version import __version__

# command name -> (module of this package, attribute): where each command lives
COMMANDS = {
    "generate": ("run", "generate"), "chat": ("run", "chat"),
    "list": ("models", "list_cmd"), "pull": ("models", "pull"),
    "serve": ("serving", "serve"), "service": ("service", "service"),
    "profile": ("device", "profile_group"),
    "quantize": ("make", "quantize"), "eval": ("make", "eval_group"), "export": ("make", "export_group"),
    "convert": ("make", "convert_cmd"),
    "worker": ("cluster", "worker"), "cluster": ("cluster", "cluster_group"),
    "bundle": ("bundle", "bundle_command"),
}


def _command(module: str, attr: str) -> click.Command:
    return getattr(importlib.import_module(f"{__name__}.{module}"), attr)


class _Commands(dict):
    """The group's commands by name, each imported from its module the first time it is asked for."""

    def __missing__(self, name: str) -> click.Command:
        if name not in COMMANDS:
            raise KeyError(name)
        self[name] = command = _command(*COMMANDS[name])
        return command


class _Group(click.Group):
    """Finds a command in its module when asked for it; turns library errors into a one-line message and
    exit code 2."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.commands = _Commands()

    def list_commands(self, ctx) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx, name: str) -> click.Command | None:
        return self.commands[name] if name in COMMANDS else None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except EdgerunError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(e.exit_code)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="edgerun")
@click.option("-v", "--verbose", count=True, help="More logging on stderr (-vv: llama.cpp's own log too).")
def main(verbose: int) -> None:
    """edgerun: offline LLM runtime for edge boards (llama.cpp / onnxruntime, AWQ INT4, exact speculative decoding)."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def __getattr__(name: str):
    """`from edgerun.cli import serve` (any command's function name) still works."""
    for module, attr in COMMANDS.values():
        if attr == name:
            return _command(module, attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
