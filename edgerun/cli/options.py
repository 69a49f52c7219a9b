"""The options of the commands that load a model (generate, chat), their checks before anything loads,
and loading the runtime. The model options are the records of edgerun/settings_table.py."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import click

from ..request import Request, check_sampling
from ..errors import InvalidArgument
from ..runtime import load
from ..settings_table import MODEL_SETTINGS, click_option
from .progress import progress_printer


# the settings of the one table (edgerun/settings_table.py) that generate and chat offer, in --help's order;
# `edgerun serve` makes the same options from the same records
MODEL_OPTIONS = ("model", "draft", "gamma", "profile_name", "n_ctx", "n_threads", "n_gpu_layers", "no_pull", "rpc",
                 "tensor_split")


def model_options(f):
    """Options shared by every command that loads a model."""
    for name in reversed(MODEL_OPTIONS):
        f = click_option(MODEL_SETTINGS[name], envvar=False)(f)
    return f


def sampling_options(f):
    opts = [
        click.option("--max-tokens", "-n", type=int, default=256, show_default=True, help="Tokens to generate at most."),
        click.option("--temperature", "-t", type=float, default=None, help="0 = greedy. Default 0.8."),
        click.option("--top-k", type=int, default=None, help="Keep the k most likely tokens (0 = off). Default 40."),
        click.option("--top-p", type=float, default=None, help="Nucleus sampling mass in (0, 1]. Default 0.95."),
        click.option("--min-p", type=float, default=None, help="Drop tokens below min_p x the top probability. Default 0.05."),
        click.option("--repeat-penalty", type=float, default=None, help="Penalty on recent tokens (1 = off)."),
        click.option("--seed", type=int, default=None,
                     help="Random seed (same seed, same text: sampled with a seed, edgerun does not speculate "
                          "unless --gamma N fixes the draft length)."),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def load_runtime(model, draft, gamma, profile_name, n_ctx, n_threads, n_gpu_layers, no_pull, rpc=None,
                 tensor_split=None, require_gpu=False):
    return load(model, draft=draft, profile=profile_name, n_ctx=n_ctx, n_threads=n_threads,
                n_gpu_layers=n_gpu_layers, gamma=gamma, pull=not no_pull, progress=progress_printer(),
                rpc=rpc, tensor_split=tensor_split, require_gpu=require_gpu)


# --require-gpu of generate and chat, with its EDGERUN_REQUIRE_GPU (listed after the command's own options);
# --rpc / --tensor-split are checked by edgerun.load before anything loads
require_gpu_option = click_option(MODEL_SETTINGS["require_gpu"], envvar=False)


def sampling_kw(temperature, top_k, top_p, min_p, repeat_penalty, seed) -> dict:
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty, seed=seed)
    with flag_names():
        return dict(check_sampling({k: v for k, v in kw.items() if v is not None}))   # before any model loads


def build_request(**kw) -> Request:
    """Request.build, its errors naming the command-line flag."""
    with flag_names():
        return Request.build(**kw)


@contextmanager
def flag_names():
    """An InvalidArgument that names its option says the flag (--max-tokens) instead."""
    try:
        yield
    except InvalidArgument as e:
        if e.param is None or str(e).startswith("--"):
            raise
        raise InvalidArgument(f"--{e.param.replace('_', '-')}: {e}", param=e.param) from None


def read_arg_file(value: str, option: str, *, json_or_file: bool) -> str:
    """An option's text: the file it names, or (json_or_file) the value itself when it is inline JSON."""
    if json_or_file and value.lstrip().startswith(("{", "[")):
        return value
    path = Path(value)
    if not path.is_file():
        what = "a JSON file or inline JSON" if json_or_file else "a file"
        raise InvalidArgument(f"{option}: {value!r:.80} is not {what}")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"{option}: cannot read {path}: {e}") from None


def structure_kw(json_schema: str | None, grammar: str | None) -> dict:
    """--json-schema / --grammar -> Request.build's keyword arguments (which checks them)."""
    if json_schema is not None and grammar is not None:
        raise InvalidArgument("give at most one of --json-schema and --grammar")
    kw = {}
    if json_schema is not None:
        kw["json_schema"] = read_arg_file(json_schema, "--json-schema", json_or_file=True)
    if grammar is not None:
        kw["grammar"] = read_arg_file(grammar, "--grammar", json_or_file=False)
    return kw


structure_options = [
    click.option("--json-schema", default=None,
                 help="Constrain the output to this JSON Schema (a file, or inline JSON)."),
    click.option("--grammar", default=None,
                 help="Constrain the output to the grammar in this file: Lark (with a `start:` rule) or a regex."),
]


def with_structure_options(f):
    for o in reversed(structure_options):
        f = o(f)
    return f
