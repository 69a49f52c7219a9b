"""The settings of loading a model, written once: `edgerun generate` and `edgerun chat` make their model
options from this table, and `edgerun serve` makes the same settings from it (serve/settings.py adds the
serve-only ones, such as --host and --parallel, as records of the same type).

A `Setting` names the click parameter, its flags, its EDGERUN_* variable, type, default and help; the
serve side adds what only the service needs (its line in deploy/edgerun.env, the ServerConfig field it
sets). The checks of the values live where the values are used (edgerun.load, ServerConfig), once.

This module imports click and edgerun.config only, so a one-shot command reads it without the server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import click

from .config import DEFAULT_MODEL


def _same(v: Any) -> Any:
    return v


@dataclass(frozen=True)
class Setting:
    """One setting, as a command-line flag, an environment variable and (for `edgerun serve`) an env-file entry."""

    name: str                            # the click parameter name (the CLI function's argument)
    flags: tuple[str, ...]               # e.g. ("--model", "-m")
    env: str                             # EDGERUN_* variable
    help: str
    type: Any = None                     # click type (None: a string)
    default: Any = None                  # the flag's default as the user writes it
    is_flag: bool = False
    metavar: str | None = None           # how --help writes the value (None: click's name for the type)
    env_everywhere: bool = False         # generate and chat read the variable too (else only `edgerun serve`)
    env_value: str | None = None         # the env file's line: a value, or None to show it commented out
    env_example: str = ""                # the commented-out example value
    env_doc: tuple[str, ...] = ()        # comment lines before this variable in the env file
    field: str | None = None             # the ServerConfig field it sets (None: same as name)
    to_config: Callable[[Any], Any] = _same


def click_option(s: Setting, *, envvar: bool = True) -> Callable:
    """The click option of one setting; envvar=False leaves its variable out (unless env_everywhere)."""
    kw: dict[str, Any] = dict(help=s.help or None)
    if envvar or s.env_everywhere:
        kw.update(envvar=s.env, show_envvar=True)
    if s.metavar is not None:
        kw["metavar"] = s.metavar
    if s.is_flag:
        kw["is_flag"] = True
    else:
        kw.update(default=s.default, show_default=s.default is not None)
        if s.type is not None:
            kw["type"] = s.type
    return click.option(*s.flags, s.name, **kw)


# The settings of edgerun.load() that the one-shot commands and `edgerun serve` share (serve has no
# --gpu-layers: the device profile places the layers there).
MODEL_SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("model", ("--model", "-m"), "EDGERUN_MODEL",
            "Registry name (see `edgerun list`), hub name hf:ORG/REPO[@REV][:QUANT|/FILE.gguf] (docs/models.md), "
            ".gguf path, INT4 checkpoint or exported ONNX directory.", default=DEFAULT_MODEL),
    Setting("draft", ("--draft",), "EDGERUN_DRAFT",
            "Drafter: 'auto' (the registry's pair or, for a hub model, one of its vocabulary; else 'suffix'), "
            "'none', 'suffix', 'lookup', or a model.",
            default="auto"),
    Setting("gamma", ("--gamma",), "EDGERUN_GAMMA",
            "Draft length per cycle: an integer (0 = plain decoding) or 'auto' (tuned).", default="auto"),
    Setting("profile_name", ("--profile",), "EDGERUN_PROFILE",
            "Device profile name or YAML path ('auto' detects the board).", default="auto"),
    Setting("n_ctx", ("--ctx",), "EDGERUN_CTX", "Context size in tokens (profile default).", type=int),
    Setting("n_threads", ("--threads",), "EDGERUN_THREADS", "CPU threads (profile default).", type=int),
    Setting("n_gpu_layers", ("--gpu-layers",), "EDGERUN_GPU_LAYERS", "Layers offloaded to the GPU.", type=int),
    Setting("no_pull", ("--no-pull",), "EDGERUN_NO_PULL", "Fail instead of downloading a model that is not cached.",
            is_flag=True),
    Setting("rpc", ("--rpc",), "EDGERUN_RPC",
            "Split the target over these RPC workers (`edgerun worker`; reach them through SSH tunnels). The "
            "drafter stays here; a lost worker ends the process (the service's unit restarts it). docs/cluster.md",
            metavar="HOST:PORT,..."),
    Setting("tensor_split", ("--tensor-split",), "EDGERUN_TENSOR_SPLIT",
            "With --rpc: the share of each worker device (e.g. 3,1), optionally one more (last) for this "
            "machine. Default: by the workers' free memory.", metavar="SHARES"),
    Setting("require_gpu", ("--require-gpu",), "EDGERUN_REQUIRE_GPU",
            "Fail (exit 2) unless every layer of the model runs on a GPU; without it a GPU profile (Jetson, "
            "Apple) whose GPU is not used only warns (the server's /health shows where the layers are). "
            "docs/devices.md", is_flag=True, env_everywhere=True),
)}
