"""`edgerun service print|build-flags`: the systemd unit of this installation and its build flags."""

from __future__ import annotations

import json

import click

from ..device.detect import resolve
from ..serve.systemd import build_flags, render_unit


@click.group()
def service() -> None:
    """Run edgerun as a systemd service (see deploy/install.sh)."""


@service.command("print")
@click.option("--env-file", default="/etc/edgerun/edgerun.env", show_default=True,
              help="EnvironmentFile= of the unit (absolute path).")
@click.option("--watchdog-sec", type=int, default=60, show_default=True, help="WatchdogSec= of the unit.")
@click.option("--exec-start", default=None,
              help="ExecStart= command (default: this installation's `edgerun serve`).")
@click.option("--profile", "profile_name", default="auto", show_default=True,
              help="Device profile: a Jetson's adds the GPU's groups and device nodes ('auto' detects the board).")
def service_print(env_file, watchdog_sec, exec_start, profile_name):
    """Print the systemd unit for this installation (paths filled in)."""
    click.echo(render_unit(exec_start, env_file=env_file, watchdog_sec=watchdog_sec,
                           profile=resolve(profile_name)[0]), nl=False)


@service.command("build-flags")
@click.option("--profile", "profile_name", default="auto", show_default=True,
              help="Device profile name or YAML path ('auto' detects the board).")
def service_build_flags(profile_name):
    """Print (JSON) the device profile and the llama-cpp-python build flags install.sh uses."""
    click.echo(json.dumps(build_flags(profile_name)))
