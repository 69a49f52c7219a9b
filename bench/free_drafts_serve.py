"""Drafts that cost nothing, end to end (docs/free_drafts.md): the same requests to `edgerun serve` plain
(--draft none), `edgerun serve` as a user gets it (no flag), `tokenwise` (plain with grammar-forced runs off:
every forced token a decode step, as edgerun decoded structured output before them), llama.cpp's `llama-server` on the same file, and
`llama-server` with its n-gram speculation modes, one server at a time, side by side in one run
(`draft-X`: `edgerun serve --draft X`).

Workloads (3 prompts each): (a) JSON extraction to a nested schema, (b) OpenAI tool calls with tool_choice
"required", (c) code editing: return a 60-80-line Python file with one name changed, (d) answering from a given
document with quotes, (e) free chat (nothing to copy), (f) a multi-turn chat whose last turn repeats earlier
content. Greedy and temperature 0.7 (unseeded: a seeded sampled request is decoded plainly by edgerun, for the
same text from the same seed). Streaming requests; per answer: completion tokens, time to the
complete answer (prefill included) and decode tok/s (first token to last). Structured answers are validated
(jsonschema). Greedy answers of edgerun's default are compared with edgerun plain's ('same').

Ratios are per (workload, prompt, temperature) pair, geometric means with ~95% intervals (bench/harness.py).
Servers run one at a time, in reversed order on alternate rounds.

    nice python bench/free_drafts_serve.py [--models smollm2,qwen] [--temps 0,0.7] [--rounds 1] [--threads 2]
        [--workloads a,b,c,d,e,f] [--systems plain,default,llama,ngram-simple,ngram-mod,draft-suffix,tokenwise]
        [--llama-bin /path/to/llama.cpp/build/bin] [--out bench/results/free_drafts_serve.json]
"""

from __future__ import annotations

import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import jsonschema  # noqa: E402

from free_drafts import ASKS, EXTRACT, PEOPLE, TOOLS  # noqa: E402
from harness import Proc, arg_parser, edgerun_cmd, free_port, geomean_interval, llama_server, print_table, \
    write_result  # noqa: E402
from workloads import SMALL, TARGET  # noqa: E402

MAX_TOKENS = {"a": 400, "b": 120, "c": 900, "d": 220, "e": 200, "f": 300}


def _code_files() -> list[tuple[str, str, str, str]]:
    """(name, source, old name, new name): 60-80-line slices of standard-library modules (fixed for a
    Python version, so every run edits the same text)."""
    import bisect
    import colorsys
    import fnmatch

    out = []
    for mod, old, new, lines in ((bisect, "insort_right", "insert_sorted_right", 70),
                                 (colorsys, "rgb_to_hls", "rgb_to_hue_lightness", 80),
                                 (fnmatch, "filter", "filter_names", 75)):
        src = "\n".join(inspect.getsource(mod).splitlines()[:lines])
        out.append((mod.__name__, src, old, new))
    return out


def _document() -> str:
    from pydoc_data.topics import topics

    return topics["while"] + "\n" + topics["if"] + "\n" + topics["break"]


QUESTIONS = [
    "What happens when the expression of a while loop is false? Answer with the exact sentence from the "
    "document in quotes, then explain it in one sentence.",
    "What does a break statement do? Quote the document's sentences about it word for word, then explain.",
    "How does the if statement choose which suite to run? Quote the relevant sentence exactly, then explain.",
]
CHATS = [
    "Write a short story about a lighthouse keeper who finds a small robot on the shore.",
    "What are three good habits for someone learning to play the piano? Explain each briefly.",
    "Describe a walk through a forest in autumn, as vividly as you can.",
]
# (f): an earlier answer the last turn asks to repeat with a change
TURNS = [
    ("List the steps to make a cup of tea.",
     "1. Boil fresh water in a kettle.\n2. Warm the teapot with a little hot water, then pour it out.\n"
     "3. Put one teabag or one teaspoon of loose tea per cup into the pot.\n4. Pour the boiling water over "
     "the tea.\n5. Let it steep for three to five minutes.\n6. Remove the teabag or strain the leaves.\n"
     "7. Pour into a cup and add milk, sugar or lemon to taste.",
     "Repeat the list exactly as you wrote it, but add a step 8: wash the teapot."),
    ("Give me a packing list for a weekend hike.",
     "- A backpack of 30 to 40 litres\n- Two litres of water and a filter\n- Trail food: nuts, dried fruit, "
     "sandwiches\n- A rain jacket and a warm fleece\n- A map, a compass and a charged phone\n- A first aid kit "
     "with plasters and pain relief\n- A head torch with spare batteries\n- Sun cream, sunglasses and a hat",
     "Write the same packing list again, word for word, and add a sleeping bag at the end."),
    ("Summarise the rules of chess castling.",
     "Castling moves the king two squares towards a rook, and the rook jumps to the square the king crossed. "
     "It is allowed only if neither the king nor that rook has moved before, no pieces stand between them, "
     "the king is not in check, and the king does not pass through or land on a square attacked by the "
     "opponent.",
     "Repeat your summary exactly, then add one sentence about castling on the queen's side."),
]


def workloads(selected: str) -> list[dict]:
    """Each: workload letter, name, messages, extra body fields, and how to check the answer."""
    out = []
    if "a" in selected:
        for i, text in enumerate(EXTRACT):
            out.append(dict(w="a", name=f"json{i + 1}", messages=[{"role": "user", "content":
                        "Extract the team and its people as JSON.\n\n" + text}],
                            extra={"response_format": {"type": "json_schema", "json_schema": {
                                "name": "people", "schema": PEOPLE, "strict": True}}}, check="json"))
    if "b" in selected:
        for i, ask in enumerate(ASKS):
            out.append(dict(w="b", name=f"tool{i + 1}", messages=[{"role": "user", "content": ask}],
                            extra={"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
                            check="tool"))
    if "c" in selected:
        for name, src, old, new in _code_files():
            out.append(dict(w="c", name=f"code-{name}", messages=[{"role": "user", "content":
                        f"Return this file with `{old}` renamed to `{new}` everywhere. Reply with the whole "
                        f"file in one ```python block and nothing else.\n\n```python\n{src}\n```"}],
                            extra={}, check=None))
    if "d" in selected:
        doc = _document()
        for i, q in enumerate(QUESTIONS):
            out.append(dict(w="d", name=f"doc{i + 1}", messages=[{"role": "user", "content":
                        f"Document:\n\n{doc}\n\nQuestion: {q}"}], extra={}, check=None))
    if "e" in selected:
        for i, q in enumerate(CHATS):
            out.append(dict(w="e", name=f"chat{i + 1}", messages=[{"role": "user", "content": q}], extra={},
                            check=None))
    if "f" in selected:
        for i, (ask, answer, again) in enumerate(TURNS):
            out.append(dict(w="f", name=f"turns{i + 1}", messages=[
                {"role": "user", "content": ask}, {"role": "assistant", "content": answer},
                {"role": "user", "content": again}], extra={}, check=None))
    return out


def valid(check: str | None, text: str, calls: list) -> bool | None:
    if check is None:
        return None
    try:
        if check == "json":
            jsonschema.validate(json.loads(text), PEOPLE)
            return True
        if not calls:
            return False
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for c in calls:
            jsonschema.validate(json.loads(c["arguments"]), schemas[c["name"]])
        return True
    except (ValueError, KeyError, jsonschema.ValidationError):
        return False


def ask(url: str, model: str, item: dict, temp: float, seed: int) -> dict:
    """One streamed chat request: tokens, time to the answer, decode rate, text, tool calls."""
    body = {"model": model, "messages": item["messages"], "max_tokens": MAX_TOKENS[item["w"]],
            "temperature": temp, **({"seed": seed} if temp == 0 else {}), "stream": True,
            "stream_options": {"include_usage": True},
            **item["extra"]}
    t0 = time.perf_counter()
    first = last = None
    text, calls, usage, n_chunks = [], {}, None, 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=1800) as r:
        if r.status_code != 200:
            raise SystemExit(f"{url}: {r.status_code} {r.read()[:400]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for ch in chunk.get("choices", []):
                d = ch.get("delta") or {}
                if d.get("content") or d.get("tool_calls"):
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                    n_chunks += 1
                text.append(d.get("content") or "")
                for tc in d.get("tool_calls") or []:
                    c = calls.setdefault(tc.get("index", 0), {"name": "", "arguments": ""})
                    fn = tc.get("function") or {}
                    c["name"] += fn.get("name") or ""
                    c["arguments"] += fn.get("arguments") or ""
    t_end = time.perf_counter()
    n = (usage or {}).get("completion_tokens") or n_chunks
    decode_s = (last - first) if first is not None and last is not None else 0.0
    joined = "".join(text)
    return {"tokens": n, "answer_s": t_end - t0, "ttft_s": (first - t0) if first else None,
            "decode_tps": (n - 1) / decode_s if decode_s > 0 and n > 1 else None,
            "tps": n / (t_end - t0), "text": joined, "calls": list(calls.values()),
            "valid": valid(item["check"], joined, list(calls.values()))}


def start(system: str, model: str, path: Path, args) -> Proc:
    if system in ("plain", "default", "tokenwise") or system.startswith("draft-"):
        port = free_port()
        draft = {"plain": ["--draft", "none"], "tokenwise": ["--draft", "none"], "default": []}.get(
            system, ["--draft", system[6:]])
        cmd = edgerun_cmd("serve", "--model", model, "--port", str(port), "--threads", str(args.threads),
                          "--parallel", "1", "--timeout", "1800", *draft)
        # tokenwise: plain with forced runs off (EDGERUN_FORCED_RUNS=0), every grammar-forced token a decode step
        # of its own: edgerun's structured decoding before this page's forced runs, the baseline of (a) and (b)
        env = {**os.environ, "EDGERUN_FORCED_RUNS": "0"} if system == "tokenwise" else None
        p = Proc(f"edgerun {system}", cmd, f"http://127.0.0.1:{port}", env=env)
    else:
        extra = ["-fa", "on", "-np", "1", "-c", "4096", "--jinja", "-ngl", "0"]
        if system.startswith("ngram"):
            extra += ["--spec-type", system]
        p = llama_server(Path(args.llama_bin) / "llama-server", path, threads=args.threads, extra=extra,
                         name=f"llama-server {system}")
    p.wait_ready()
    return p


def model_path(name: str) -> Path:
    from edgerun.resolve import resolve_model

    return Path(resolve_model(name, pull=True))


def run(args) -> dict:
    items = workloads(args.workloads)
    temps = [float(t) for t in args.temps.split(",")]
    systems = args.systems.split(",")
    models = {"smollm2": SMALL, "qwen": TARGET}
    rows: list[dict] = []
    for key in args.models.split(","):
        name = models.get(key, key)
        path = model_path(name)
        for rnd in range(args.rounds):
            order = systems if rnd % 2 == 0 else systems[::-1]
            for system in order:
                proc = start(system, name, path, args)
                try:
                    for item in items:
                        for temp in temps:
                            for rep in range(args.repeats):
                                res = ask(proc.url, name, item, temp, seed=1234 + rep)
                                rows.append({"model": key, "system": system, "round": rnd, "rep": rep,
                                             "workload": item["w"], "prompt": item["name"], "temp": temp, **res})
                                print(f"{key} {system:13s} {item['name']:14s} t={temp} {res['tokens']:4d} tok "
                                      f"{res['decode_tps'] or 0:6.1f} tok/s answer {res['answer_s']:6.2f} s"
                                      + ("" if res["valid"] is None else f" valid={res['valid']}"), flush=True)
                finally:
                    proc.stop()
    return {"rows": rows, "summary": summarise(rows, systems)}


def _pairs(rows, model, w, temp, a, b, field):
    key = lambda r: (r["prompt"], r["round"], r["rep"])      # noqa: E731
    left = {key(r): r for r in rows if (r["model"], r["workload"], r["temp"], r["system"]) == (model, w, temp, a)}
    right = {key(r): r for r in rows if (r["model"], r["workload"], r["temp"], r["system"]) == (model, w, temp, b)}
    return [left[k][field] / right[k][field] for k in left if k in right and left[k][field] and right[k][field]]


def summarise(rows: list[dict], systems: list[str]) -> list[dict]:
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for w in dict.fromkeys(r["workload"] for r in rows if r["model"] == model):
            for temp in dict.fromkeys(r["temp"] for r in rows):
                sel = [r for r in rows if (r["model"], r["workload"], r["temp"]) == (model, w, temp)]
                s = {"model": model, "workload": w, "temp": temp}
                for system in systems:
                    mine = [r for r in sel if r["system"] == system]
                    if mine:
                        s[f"{system}_tps"] = statistics.median(r["decode_tps"] or 0 for r in mine)
                        s[f"{system}_answer_s"] = statistics.median(r["answer_s"] for r in mine)
                        checked = [r["valid"] for r in mine if r["valid"] is not None]
                        s[f"{system}_valid"] = f"{sum(checked)}/{len(checked)}" if checked else ""
                ngrams = [x for x in systems if x.startswith("ngram") and f"{x}_tps" in s]
                best = max(ngrams, key=lambda x: s[f"{x}_tps"], default=None)
                s["best_ngram"] = best
                for base in ("plain", "tokenwise", "llama", best):
                    if base and "default" in systems and base in systems:
                        for field, tag in (("decode_tps", "tps"), ("answer_s", "answer")):
                            ratios = _pairs(rows, model, w, temp, "default", base, field)
                            if field == "answer_s":
                                ratios = [1 / x for x in ratios]       # > 1: the default finishes sooner
                            if ratios:
                                s[f"default_vs_{'ngram' if base == best else base}_{tag}"] = \
                                    geomean_interval(ratios) if len(ratios) > 1 else (ratios[0],) * 3
                for x in (x for x in systems if x.startswith("draft-")):     # an explicit --draft vs plain
                    ratios = _pairs(rows, model, w, temp, x, "plain", "decode_tps")
                    if ratios:
                        s[f"{x}_vs_plain_tps"] = geomean_interval(ratios) if len(ratios) > 1 else (ratios[0],) * 3
                if temp == 0 and {"plain", "default"} <= set(systems):
                    texts = {}
                    for r in sel:
                        texts.setdefault((r["prompt"], r["round"], r["rep"]), {})[r["system"]] = \
                            (r["text"], json.dumps(r["calls"]))
                    same = [v["plain"] == v["default"] for v in texts.values() if {"plain", "default"} <= set(v)]
                    s["greedy_same"] = f"{sum(same)}/{len(same)}"
                out.append(s)
    return out


def main() -> None:
    p = arg_parser(__doc__, out="bench/results/free_drafts_serve.json")
    p.add_argument("--models", default="smollm2,qwen")
    p.add_argument("--temps", default="0,0.7")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1, help="requests per prompt and temperature (seeds differ)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workloads", default="abcdef")
    p.add_argument("--systems", default="plain,default,llama,ngram-simple,ngram-mod")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown (for docs/)")
    p.add_argument("--llama-bin", default=os.environ.get("LLAMA_BIN", "/tmp/lcpp/src/build/bin"))
    args = p.parse_args()
    data = run(args)
    data["args"] = vars(args)
    fmt = lambda v: "" if v is None else (f"{v[0]:.2f}x [{v[1]:.2f}, {v[2]:.2f}]" if isinstance(v, (tuple, list))  # noqa: E731
                                          else (f"{v:.1f}" if isinstance(v, float) else str(v)))
    heads = ["model", "workload", "temp", "plain_tps", "default_tps", "llama_tps", "best_ngram",
             "default_vs_plain_tps", "default_vs_llama_tps", "default_vs_ngram_tps", "default_vs_plain_answer",
             "default_vs_llama_answer", "greedy_same", "default_valid", "llama_valid"]
    heads += [f"{x}{k}" for x in args.systems.split(",") if x.startswith("draft-") for k in ("_tps", "_vs_plain_tps")]
    if "tokenwise" in args.systems.split(","):
        heads += ["tokenwise_tps", "default_vs_tokenwise_tps", "default_vs_tokenwise_answer"]
    for s in data["summary"]:
        best = s.get("best_ngram")
        if best:
            s["best_ngram"] = f"{best} {s[f'{best}_tps']:.1f}"
    print_table(heads, [[fmt(s.get(h)) for h in heads] for s in data["summary"]], fmt="", markdown=args.markdown,
                title="decode tok/s (median) and paired ratios of edgerun's default")
    print("wrote", write_result(args.out, data))


if __name__ == "__main__":
    main()
