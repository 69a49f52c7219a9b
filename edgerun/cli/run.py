"""`edgerun generate` and `edgerun chat`: load a model (and drafter) and answer."""

from __future__ import annotations

import json
import sys

import click

from ..constrain.tools import ToolCallStream, parse_tools
from ..errors import ContextOverflow, EdgerunError, InvalidArgument
from ..request import Structure
from ..util import jsontext
from ..speculative.lazy import describe as describe_drafter
from .options import (build_request, load_runtime, model_options, read_arg_file, require_gpu_option, sampling_kw,
                      sampling_options, structure_kw, with_structure_options)


@click.command()
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
    if prompt == "-":
        prompt = sys.stdin.read()
    # every option checked before a model loads (the grammar compiles against the vocabulary later)
    request = build_request(prompt=prompt, max_tokens=max_tokens, stop=stop,
                            **sampling_kw(temperature, top_k, top_p, min_p, repeat_penalty, seed),
                            **structure_kw(json_schema, grammar))
    with load_runtime(model, draft, gamma, profile_name, n_ctx, n_threads, n_gpu_layers, no_pull, rpc,
                      tensor_split, require_gpu) as rt:
        if as_json:
            c = rt.complete(request)
            out = {"model": rt.model_name, "draft": rt.draft_name, "drafter": describe_drafter(rt.drafter),
                   **c.to_dict()}
            click.echo(json.dumps(out))
        else:
            for step in rt.start(request):
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
    while True:
        try:
            return rt.chat_stream(messages, **kw)
        except ContextOverflow:
            if len(messages) <= len(base) + 1:
                raise
            del messages[len(base):len(base) + 2]        # oldest user + assistant turn
            click.echo("(context full: dropped the oldest turn)", err=True)


def _load_tools(value: str | None) -> list:
    if value is None:
        return []
    text = read_arg_file(value, "--tools", json_or_file=True)
    try:
        tools = jsontext.loads(text, "--tools")
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"--tools: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    Structure.parse(tools=tools)
    return tools


def _answer(rt, messages, base, tools, tool_choice=None, **kw) -> tuple[str, list]:
    """Stream one answer to the terminal; return (its text outside tool calls, its tool calls)."""
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


@click.command()
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
    kw = sampling_kw(temperature, top_k, top_p, min_p, repeat_penalty, seed)
    tools = _load_tools(tools_spec)
    if tool_choice not in ("auto", "required", "none"):
        tool_choice = {"type": "function", "function": {"name": tool_choice}}
    if tools:
        Structure.parse(tools=tools, tool_choice=tool_choice)     # checked before a model loads
    with load_runtime(model, draft, gamma, profile_name, n_ctx, n_threads, n_gpu_layers, no_pull, rpc,
                      tensor_split, require_gpu) as rt:
        base = [{"role": "system", "content": system}] if system else []
        messages = list(base)
        click.echo(f"edgerun chat - {rt.model_name}" + (f" (draft: {rt.draft_name})" if rt.draft_name else "")
                   + ". /reset /stats /exit; Ctrl-C stops an answer, Ctrl-D quits.", err=True)
        while True:
            if sys.stdin.isatty():
                rt.idle()              # a person types: work for long runs only (huge pages) may run meanwhile
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
