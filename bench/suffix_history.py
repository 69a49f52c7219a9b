"""What cross-request suffix history (speculative/history.py, `serve --suffix-history`) costs and what it gives.

Cost (no model needed beyond SmolLM2's tokenizer): answers are cut from real text (CPython stdlib files,
tokenized, --answer tokens each) and added to one bucket until it holds --held tokens. Reported: the RAM the
bucket holds per 100k tokens (tracemalloc: every Python object it allocated), the time to add an answer (per
answer and per token), and the time a request's cursor spends per generated token against a full bucket
(feed one token + match + a 4-token continuation where it matched), next to the suffix drafter's own
per-token work without history (sync + hint + propose 4, as bench/suffix_cost.py). Times are the thread's
CPU time (robust to other processes on the machine).

Benefit (--serve): two real `edgerun serve` processes of SmolLM2-135M at --threads threads, the default
drafter (suffix lookup; gamma tuned, or --gamma N for both), one with --suffix-history and one without, each with its own copy of
the probe/tuner cache; a repeated-question workload (each of the questions asked --rounds times, the two
servers asked in turn, one request at a time). Reported per server: decode tokens/s of the first asks and of
the repeats (median), accepted drafts per answer, and whether the answers were the same.

    nice python bench/suffix_history.py [--held 100000] [--answer 200] [--serve] [--threads 2] [--rounds 3]
        [--temperature 0] [--gamma auto|N] [--max-tokens 160] [--out bench/results/suffix_history.json]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edgerun.config import SamplingArgs  # noqa: E402
from edgerun.speculative.history import SuffixHistory  # noqa: E402
from edgerun.speculative.suffix import SuffixDrafter  # noqa: E402

MODEL = "smollm2-135m-instruct"
QUESTIONS = [
    "Explain in a few sentences how a bicycle works.",
    "Write a short story about a robot who learns to paint.",
    "List five tips for staying healthy, one line each.",
    "Describe the water cycle for a ten-year-old.",
]


def corpus(n: int) -> list[int]:
    from edgerun.resolve import resolve_model
    from edgerun.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(resolve_model(MODEL, pull=True))
    out: list[int] = []
    lib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("argparse.py", "typing.py", "subprocess.py", "inspect.py", "pathlib.py", "logging/__init__.py",
                 "collections/__init__.py", "dataclasses.py", "enum.py", "functools.py", "json/decoder.py"):
        if len(out) >= n:
            break
        out += tok.tokenize((lib / name).read_text(), add_bos=False)
    return out[:n]


def clock() -> float:
    """This thread's CPU seconds: the machine these ran on was shared, and wall time measured the others too."""
    return time.thread_time()


def cost(held: int, answer: int, feed: int) -> dict:
    toks = corpus(held + feed + 2 * answer)
    answers = [toks[i:i + answer] for i in range(0, held, answer)]
    tracemalloc.start()                  # RAM: every object the bucket allocated (a first fill, traced)
    before = tracemalloc.get_traced_memory()[0]
    b = SuffixHistory(held + answer).bucket("k")
    for a in answers:
        b.add(a[1:], a[:1])
    mem = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del b
    h = SuffixHistory(held + answer)     # time: a second fill, untraced
    b = h.bucket("k")
    t0 = clock()
    for a in answers:
        b.add(a[1:], a[:1])
    t_add = clock() - t0
    # a request reading the full bucket: its context is text the bucket holds in part (a second copy of the
    # last answers, then new text), one token at a time as a decode loop would feed it
    stream = toks[held - feed // 2: held + feed // 2]
    greedy, rng = SamplingArgs(temperature=0.0), np.random.default_rng(0)

    def drafter_pass(history) -> tuple[float, int]:
        d = SuffixDrafter()
        d.history = history
        ctx = list(stream[:64])
        hits0 = b.hits
        t = clock()
        for x in stream[64:]:
            ctx.append(x)
            if d.hint(ctx) is not None:
                d.propose(ctx, 4, greedy, rng)
        return 1e6 * (clock() - t) / (len(stream) - 64), b.hits - hits0

    us_plain = statistics.median(drafter_pass(None)[0] for _ in range(3))
    passes = [drafter_pass(b) for _ in range(3)]
    us_hist = statistics.median(p[0] for p in passes)
    cur = b.cursor()
    t = clock()
    matched = 0
    for x in stream:
        cur.feed([x])
        k, where = cur.match()
        if k:
            matched += 1
            cur.continuation(where, 4)
    us_cursor = 1e6 * (clock() - t) / len(stream)
    return {"held_tokens": b.tokens, "answers": len(answers), "answer_tokens": answer, "blocks": len(b.blocks),
            "bytes": mem, "bytes_per_100k_tokens": mem * 100_000 / b.tokens,
            "add_us_per_answer": 1e6 * t_add / len(answers), "add_us_per_token": 1e6 * t_add / sum(map(len, answers)),
            "cursor_us_per_token": us_cursor, "cursor_matched": matched / len(stream),
            "drafter_us_per_token_without_history": us_plain, "drafter_us_per_token_with_history": us_hist,
            "history_hits_per_pass": passes[-1][1], "feed_tokens": len(stream)}


# ---------------------------------------------------------------- benefit: two real servers

def _home(src: Path, dst: Path, fresh_tuner: bool = False) -> Path:
    """An EDGERUN_HOME sharing the models and starting from a copy of the probe and tuner cache (without the
    tuner's files where fresh_tuner: the tuner then starts from its prior, not from what it learned here)."""
    dst.mkdir(parents=True)
    (dst / "models").symlink_to(src / "models")
    if (src / "probes").is_dir():
        shutil.copytree(src / "probes", dst / "probes",
                        ignore=shutil.ignore_patterns("tuner-*") if fresh_tuner else None)
    return dst


def _start(home: Path, threads: int, extra: list[str]) -> "tuple[subprocess.Popen, str]":
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGERUN_")}
    env["EDGERUN_HOME"] = str(home)
    env["PYTHONPATH"] = str(ROOT)
    p = subprocess.Popen([sys.executable, "-m", "edgerun", "serve", "--model", MODEL, "--no-pull", "--threads",
                          str(threads), "--ctx", "2048", "--parallel", "1", "--port", "0", *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    for line in p.stdout:
        if "listening on " in line:
            url = line.split("listening on ", 1)[1].split()[0]
            break
    else:
        raise SystemExit(f"the server did not start: {p.poll()}")
    import threading

    threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
    import httpx

    deadline = time.monotonic() + 600
    while httpx.get(url + "/health").status_code != 200:
        if time.monotonic() > deadline:
            raise SystemExit("the server did not get ready")
        time.sleep(0.5)
    return p, url


def serve(threads: int, rounds: int, temperature: float, budget: int, max_tokens: int, gamma: str,
          fresh_tuner: bool = False) -> dict:
    import httpx

    from edgerun.registry.cache import cache_dir

    src = cache_dir()
    tmp = Path(tempfile.mkdtemp(prefix="suffix-history-"))
    servers = {}
    try:
        servers["without"] = _start(_home(src, tmp / "without", fresh_tuner), threads, ["--gamma", gamma])
        servers["with"] = _start(_home(src, tmp / "with", fresh_tuner), threads,
                                 ["--gamma", gamma, "--suffix-history", str(budget)])
        rows: dict[str, list[dict]] = {"without": [], "with": []}
        for r in range(rounds):
            for qi, q in enumerate(QUESTIONS):
                order = ["without", "with"] if (r + qi) % 2 == 0 else ["with", "without"]
                for name in order:
                    url = servers[name][1]
                    t0 = time.perf_counter()
                    resp = httpx.post(url + "/v1/chat/completions", timeout=600, json={
                        "model": MODEL, "messages": [{"role": "user", "content": q}], "max_tokens": max_tokens,
                        "temperature": temperature, "seed": 1000 * r + qi})
                    wall = time.perf_counter() - t0
                    body = resp.json()
                    ext = body["edgerun"]
                    rows[name].append({"round": r, "question": qi, "tokens": body["usage"]["completion_tokens"],
                                       "tokens_per_s": ext["tokens_per_s"], "wall_s": wall,
                                       "n_drafted": ext["n_drafted"], "n_accepted": ext["n_accepted"],
                                       "gamma_mean": ext["gamma_mean"],
                                       "text": body["choices"][0]["message"]["content"]})
        metrics = httpx.get(servers["with"][1] + "/metrics").text
        held = [line for line in metrics.splitlines() if line.startswith("edgerun_suffix_history")]
    finally:
        for p, _ in servers.values():
            p.terminate()
            p.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
    out = {"threads": threads, "rounds": rounds, "temperature": temperature, "budget": budget, "gamma": gamma,
           "fresh_tuner": fresh_tuner,
           "max_tokens": max_tokens, "load_avg": os.getloadavg(), "metrics": held, "rows": rows}
    summary = {}
    for name, rs in rows.items():
        first = [x for x in rs if x["round"] == 0]
        rep = [x for x in rs if x["round"] > 0]
        summary[name] = {
            "first_tok_s": statistics.median(x["tokens_per_s"] for x in first),
            "repeat_tok_s": statistics.median(x["tokens_per_s"] for x in rep) if rep else None,
            "first_accepted": statistics.mean(x["n_accepted"] for x in first),
            "repeat_accepted": statistics.mean(x["n_accepted"] for x in rep) if rep else None,
            "repeat_tokens": statistics.mean(x["tokens"] for x in rep) if rep else None,
            "repeat_wall_s": statistics.median(x["wall_s"] for x in rep) if rep else None}
    same = [a["text"] == b["text"] for a, b in zip(sorted(rows["without"], key=lambda x: (x["round"], x["question"])),
                                                    sorted(rows["with"], key=lambda x: (x["round"], x["question"])))]
    out["summary"], out["same_answers"] = summary, f"{sum(same)}/{len(same)}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--held", type=int, default=100_000)
    ap.add_argument("--answer", type=int, default=200)
    ap.add_argument("--feed", type=int, default=4000)
    ap.add_argument("--serve", action="store_true", help="also measure the benefit on two real servers")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--budget", type=int, default=100_000)
    ap.add_argument("--gamma", default="auto", help="both servers' --gamma (auto: the tuner decides)")
    ap.add_argument("--skip-cost", action="store_true")
    ap.add_argument("--fresh-tuner", action="store_true", help="the servers start without the tuner's learned state")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "suffix_history.json"))
    a = ap.parse_args()
    from edgerun.util.atomic import write_json

    result: dict = {}
    if not a.skip_cost:
        c = result["cost"] = cost(a.held, a.answer, a.feed)
        print("| tokens held | answers | RAM | per 100k tokens | add: µs per answer (per token) | "
              "cursor µs per token (matched) | drafter µs per token without / with history |")
        print("|---|---|---|---|---|---|---|")
        print(f"| {c['held_tokens']} | {c['answers']} | {c['bytes'] / 2**20:.1f} MiB | "
              f"{c['bytes_per_100k_tokens'] / 2**20:.1f} MiB | {c['add_us_per_answer']:.0f} "
              f"({c['add_us_per_token']:.2f}) | {c['cursor_us_per_token']:.1f} ({100 * c['cursor_matched']:.0f}%) | "
              f"{c['drafter_us_per_token_without_history']:.1f} / {c['drafter_us_per_token_with_history']:.1f} |")
    if a.serve:
        s = result["serve"] = serve(a.threads, a.rounds, a.temperature, a.budget, a.max_tokens, a.gamma,
                                    a.fresh_tuner)
        print(f"\n{MODEL}, {a.threads} threads, gamma {a.gamma}, temperature {a.temperature}, "
              f"{len(QUESTIONS)} questions x {a.rounds} rounds, load average {s['load_avg'][0]:.1f}; "
              f"same answers {s['same_answers']}")
        print("| server | tok/s first asks | tok/s repeats | accepted per answer first / repeats | "
              "repeat answer s |")
        print("|---|---|---|---|---|")
        for name, x in s["summary"].items():
            print(f"| {name} history | {x['first_tok_s']:.1f} | {x['repeat_tok_s']:.1f} | "
                  f"{x['first_accepted']:.1f} / {x['repeat_accepted']:.1f} of {x['repeat_tokens']:.0f} | "
                  f"{x['repeat_wall_s']:.2f} |")
        w, wo = s["summary"]["with"], s["summary"]["without"]
        print(f"repeats: {w['repeat_tok_s'] / wo['repeat_tok_s']:.2f}x tok/s with history")
        for line in s["metrics"]:
            print("  " + line)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, result)


if __name__ == "__main__":
    main()
