"""Grammar-forced runs (docs/free_drafts.md): what share of a structured answer the grammar forces, and
what appending forced runs unsampled (one batched call, logits at the last position) buys, in one run.

Workloads (greedy, --threads): (a) JSON extraction to a nested schema (records of 7 keys with enums,
integers, booleans and string arrays; 3 prompts), (b) OpenAI tool calls with tool_choice "required"
(3 prompts over 3 tools with enum and array parameters).

Per answer token, the class it falls in (replaying the grammar over the greedy answer):
  forced   the mask allowed exactly this one token: appended without logits or sampling
  ff       not forced, but llguidance's ff_tokens proposed a token here: a point-mass draft the target
           would verify (ff_hit: it was the token chosen)
  free     neither
Timing: each prompt runs with forced runs on (the default) and off (EDGERUN_FORCED_RUNS=0's switch,
generate.FORCED_RUNS), alternating on/off within each round, --rounds rounds; medians of decode tok/s
(after prefill), of the time to the complete answer (prefill included) and of the process's CPU seconds
for the answer (prefill included) and for its decoding (after the prefill call): robust to other jobs' load
at 1 thread, where llama.cpp computes on the calling thread. Greedy answers must be equal
on and off (checked: 'same').

    nice python bench/free_drafts.py [--models smollm2,qwen] [--rounds 3] [--threads 2] [--tokens 400]
        [--out bench/results/free_drafts.json]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from workloads import SMALL, TARGET  # noqa: E402

import edgerun.generate as gen  # noqa: E402
from edgerun.generate import GenStats  # noqa: E402

RECORD = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 32},
    "role": {"type": "string", "enum": ["engineer", "manager", "designer", "analyst", "other"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24},
    "remote": {"type": "boolean"},
    "skills": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    "level": {"type": "string", "enum": ["junior", "mid", "senior", "lead"]}},
    "required": ["name", "role", "age", "city", "remote", "skills", "level"], "additionalProperties": False}
PEOPLE = {"type": "object", "properties": {
    "team": {"type": "string", "maxLength": 32},
    "people": {"type": "array", "items": RECORD, "minItems": 3, "maxItems": 3}},
    "required": ["team", "people"], "additionalProperties": False}
EXTRACT = [
    "The platform team in Berlin: Anna Keller (34) is a senior engineer working remotely, skilled in Go and "
    "Kubernetes. Tom Berg, 41, leads the team as manager from the office; he knows budgeting. Mia Chen, 27, a "
    "junior designer in Lisbon, works remotely with Figma and CSS.",
    "Data group, Toronto office. Raj Patel, 29, mid-level analyst, on site, knows SQL, Python and Tableau. "
    "Elena Rossi, 38, senior engineer, remote from Milan, Rust and C++. Sam Okafor, 45, lead manager in "
    "Toronto, on site; skills: hiring, planning.",
    "Mobile squad: Lea Novak (31, Zagreb, remote) senior engineer for Swift and Kotlin; Ben Adler (26, "
    "Vienna, office) junior designer using Sketch; Ines Duarte (50, Porto, remote) lead analyst with R and "
    "statistics.",
]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string", "maxLength": 32},
         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
         "include": {"type": "array", "items": {"type": "string", "enum": ["wind", "humidity", "rain", "uv"]},
                     "maxItems": 4}},
         "required": ["city", "unit", "include"]}}},
    {"type": "function", "function": {"name": "book_meeting", "description": "Book a meeting room",
     "parameters": {"type": "object", "properties": {
         "room": {"type": "string", "enum": ["atlas", "borealis", "cosmos"]},
         "day": {"type": "string", "enum": ["monday", "tuesday", "wednesday", "thursday", "friday"]},
         "hour": {"type": "integer", "minimum": 8, "maximum": 18},
         "attendees": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 6}},
         "required": ["room", "day", "hour", "attendees"]}}},
    {"type": "function", "function": {"name": "send_email", "description": "Send an email",
     "parameters": {"type": "object", "properties": {
         "to": {"type": "string", "maxLength": 40}, "subject": {"type": "string", "maxLength": 60},
         "priority": {"type": "string", "enum": ["low", "normal", "high"]}},
         "required": ["to", "subject", "priority"]}}},
]
ASKS = [
    "What's the weather in Oslo in celsius? I want wind and rain too.",
    "Book the cosmos room on thursday at 14 for Ana, Bo and Chen.",
    "Email jo@example.com with subject 'Quarterly numbers' at high priority.",
]


def workloads() -> list[tuple[str, list[dict], dict]]:
    """(name, messages, structure kwargs for plan_chat)."""
    out = []
    for i, text in enumerate(EXTRACT):
        out.append((f"json{i + 1}", [{"role": "user", "content": "Extract the team and its people as JSON.\n\n"
                                                                 + text}], {"json_schema": PEOPLE}))
    for i, ask in enumerate(ASKS):
        out.append((f"tool{i + 1}", [{"role": "user", "content": ask}],
                    {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}))
    return out


def classify(rt, plan, tokens: list[int]) -> dict:
    """Replay the grammar over the answer: per token, forced / ff (proposed, hit) / free; forced runs."""
    c = plan.constraint
    c.reset()
    n = dict(forced=0, ff=0, ff_hit=0, free=0)
    runs, cur = [], 0
    for t in tokens:
        if rt.tokenizer.is_eog(t):
            break
        if c.forced_token() == t:
            n["forced"] += 1
            cur += 1
        else:
            if cur:
                runs.append(cur)
                cur = 0
            ff = c.ff_tokens()
            if ff:
                n["ff"] += 1
                n["ff_hit"] += ff[0] == t
            else:
                n["free"] += 1
        c.consume(t)
    if cur:
        runs.append(cur)
    c.reset()
    total = sum(n[k] for k in ("forced", "ff", "free"))
    return {**n, "tokens": total, "runs": len(runs), "mean_run": statistics.mean(runs) if runs else 0.0,
            "max_run": max(runs, default=0)}


def one(rt, msgs, structure, tokens: int, forced: bool) -> tuple[list[int], GenStats]:
    plan = rt.plan_chat(msgs, **structure)
    gen.FORCED_RUNS = forced
    stats = GenStats()
    marks = []
    real = rt.target.eval

    def eval_marked(tokens, n_logits=None):        # the prefill is the one call without logits: mark its end
        out = real(tokens, n_logits)
        if n_logits == 0:
            marks.append(time.process_time())
        return out

    rt.target.eval = eval_marked
    c0 = time.process_time()
    try:
        out = [s.token for s in rt.stream_tokens(plan.prompt_tokens, max_tokens=tokens, temperature=0, gamma=0,
                                                 stats=stats, constraint=plan.constraint)]
    finally:
        gen.FORCED_RUNS = True
        del rt.target.eval
    c1 = time.process_time()
    stats.cpu_s = c1 - c0                          # the process's CPU seconds: robust to other jobs' load
    stats.decode_cpu_s = c1 - (marks[0] if marks else c0)
    return out, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--shares-only", action="store_true", help="one greedy answer per prompt (forced runs on) "
                    "and its token classes; no timing, no 'off' run (a large model on a busy machine)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "free_drafts.json"))
    a = ap.parse_args()
    if a.shares_only:
        a.rounds = 1

    import edgerun
    from edgerun.util.atomic import write_json

    names = {"smollm2": SMALL, "qwen": TARGET}
    results = {"machine": {"platform": platform.platform(), "processor": platform.processor()},
               "threads": a.threads, "rounds": a.rounds, "tokens": a.tokens, "models": {}}
    for key in a.models.split(","):
        rt = edgerun.load(names[key], draft="none", n_threads=a.threads, n_ctx=2048)
        res = results["models"][key] = {"model": names[key], "rows": {}}
        try:
            for name, msgs, structure in workloads():      # warm: the llguidance vocabulary, page faults
                one(rt, msgs, structure, 8, True)
                break
            timing: dict = {name: {"on": [], "off": []} for name, _, _ in workloads()}
            answers: dict = {}
            for r in range(a.rounds):
                for name, msgs, structure in workloads():
                    order = ("on",) if a.shares_only else ("on", "off") if r % 2 == 0 else ("off", "on")
                    for mode in order:
                        rt.reset()                          # no cached prefix: each run prefills the same
                        out, st = one(rt, msgs, structure, a.tokens, mode == "on")
                        timing[name][mode].append({"tok_s": st.tokens_per_s, "answer_s": st.t_total_s,
                                                   "prefill_s": st.t_prefill_s, "cpu_s": st.cpu_s,
                                                   "decode_cpu_s": st.decode_cpu_s,
                                                   "tokens": st.n_tokens, "n_forced": st.n_forced,
                                                   "finish": st.finish_reason})
                        answers.setdefault(name, {})[mode] = out
                        print(f"round {r + 1} {key} {name} {mode}: {st.n_tokens} tokens ({st.n_forced} forced), "
                              f"{st.tokens_per_s:.1f} tok/s, {st.t_total_s:.2f} s ({st.t_prefill_s:.2f} s prefill), "
                              f"{st.cpu_s:.2f} CPU s ({st.decode_cpu_s:.2f} decoding)",
                              file=sys.stderr, flush=True)
            for name, msgs, structure in workloads():
                plan = rt.plan_chat(msgs, **structure)
                cls = classify(rt, plan, answers[name]["on"])
                on, off = timing[name]["on"], timing[name]["off"] or timing[name]["on"]
                answers[name].setdefault("off", answers[name]["on"])
                med = lambda rows, k: statistics.median(x[k] for x in rows)       # noqa: E731
                res["rows"][name] = {
                    **cls, "same": None if a.shares_only else answers[name]["on"] == answers[name]["off"],
                    "finish": on[-1]["finish"], "n_forced_loop": on[-1]["n_forced"],
                    "tok_s_on": med(on, "tok_s"), "tok_s_off": med(off, "tok_s"),
                    "answer_s_on": med(on, "answer_s"), "answer_s_off": med(off, "answer_s"),
                    "prefill_s_on": med(on, "prefill_s"), "prefill_s_off": med(off, "prefill_s"),
                    "cpu_s_on": med(on, "cpu_s"), "cpu_s_off": med(off, "cpu_s"),
                    "decode_cpu_s_on": med(on, "decode_cpu_s"), "decode_cpu_s_off": med(off, "decode_cpu_s"),
                    "text": rt.tokenizer.detokenize(answers[name]["on"]).decode("utf-8", "replace")}
        finally:
            rt.close()

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, results)
    if a.shares_only:
        print("| model | workload | tokens | forced | ff (hit) | free | runs (mean, max) | finish |")
        print("|---|---|---|---|---|---|---|---|")
        for key, res in results["models"].items():
            for name, r in res["rows"].items():
                t = max(1, r["tokens"])
                print(f"| {key} | {name} | {r['tokens']} | {100 * r['forced'] / t:.0f}% | {100 * r['ff'] / t:.0f}% "
                      f"({r['ff_hit']}) | {100 * r['free'] / t:.0f}% | {r['runs']} ({r['mean_run']:.1f}, "
                      f"{r['max_run']}) | {r['finish']} |")
        print(f"wrote {out}", file=sys.stderr)
        return
    print(f"| model | workload | tokens | forced | ff (hit) | free | runs (mean) | tok/s on | tok/s off | "
          f"speed-up | answer s on / off | answer CPU s on / off | decode CPU s on / off | decode CPU ratio | "
          f"same |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for key, res in results["models"].items():
        for name, r in res["rows"].items():
            t = max(1, r["tokens"])
            print(f"| {key} | {name} | {r['tokens']} | {100 * r['forced'] / t:.0f}% | {100 * r['ff'] / t:.0f}% "
                  f"({r['ff_hit']}) | {100 * r['free'] / t:.0f}% | {r['runs']} ({r['mean_run']:.1f}) | "
                  f"{r['tok_s_on']:.1f} | {r['tok_s_off']:.1f} | {r['tok_s_on'] / r['tok_s_off']:.2f}x | "
                  f"{r['answer_s_on']:.2f} / {r['answer_s_off']:.2f} | {r['cpu_s_on']:.2f} / {r['cpu_s_off']:.2f} | "
                  f"{r['decode_cpu_s_on']:.2f} / {r['decode_cpu_s_off']:.2f} | "
                  f"{r['decode_cpu_s_off'] / r['decode_cpu_s_on']:.2f}x | {'yes' if r['same'] else 'NO'} |")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
