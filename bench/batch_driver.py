"""Who steps a batch: a thread per sequence (BatchGroup.drive) against one thread for all of them.

Driven from a thread each, every member of a batch is woken between two decodes (a thread switch and a
turn on the GIL each) and the engine thread is handed the next batch: docs/batching.md traced ~750 us per
step with 4 SmolLM2 sequences, of which the members' own Python is ~40 us each. This bench measured what
stepping every member from one thread would save, before the server was rebuilt on it: the same decode
loop (edgerun.generate.generate on a sequence view of the same shared context), its `eval` switching
into a minimal greenlet hub on the engine thread instead of waiting on a condition, each Step handed to a
uvloop event loop as the server does. Both ways run in one process, alternating round by round,
`--clients` sequences x `--tokens` greedy tokens each.

    python bench/batch_driver.py [--model smollm2-135m-instruct] [--clients 4] [--tokens 128]
        [--rounds 6] [--threads 2] [--out bench/results/batch_driver.json]

Prints per way the median gap between two llama_decode calls, the median decode and the round's tok/s,
and the geometric mean of the paired ratio one thread / threads. The prototype measured before the server
was rebuilt on it (BatchGroup.run_inline, docs/batching.md "One thread steps the batch"): no admission,
moves, drafter or cancellation here.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from harness import arg_parser  # noqa: E402

PROMPT = "Write a long story about a robot who learns to paint."


def main() -> None:
    ap = arg_parser(__doc__.split("\n")[0], model="smollm2-135m-instruct", clients=4, tokens=128, rounds=6,
                    threads=2, out="batch_driver")
    a = ap.parse_args()
    try:
        import greenlet
        import uvloop
    except ImportError as e:
        print(f"error: this bench needs greenlet and uvloop ({e}); pip install -e '.[serve]'", file=sys.stderr)
        raise SystemExit(2)

    import edgerun
    from edgerun import llama_lib
    from edgerun.engine import SeqBackend, on_engine
    from edgerun.generate import generate
    from edgerun.engine.handoff import defer, flush

    L = llama_lib.lib()
    raw = L.llama_decode
    rec = {"gaps": [], "decodes": [], "last": None}

    def timed(ctx, batch):
        t = time.perf_counter()
        if rec["last"] is not None:
            rec["gaps"].append(t - rec["last"])
        try:
            return raw(ctx, batch)
        finally:
            rec["last"] = time.perf_counter()
            rec["decodes"].append(rec["last"] - t)

    L.llama_decode = timed
    rt = edgerun.load(a.model, draft=None, n_ctx=1024, n_threads=a.threads, pull=False, parallel=a.clients)
    slots = rt.slots()
    shared = slots[0].target.shared
    prompt = rt.tokenize(PROMPT)
    sampling = slots[0].sampling_args(temperature=0)
    loop = uvloop.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    got: list = []

    def hand(step) -> None:
        defer(lambda: loop.call_soon_threadsafe(got.append, step))

    def threads_way() -> None:
        def run(slot) -> None:
            slot.reset()
            for step in slot.stream_tokens(prompt, max_tokens=a.tokens, temperature=0):
                hand(step)
            flush()
        ths = [threading.Thread(target=run, args=(s,)) for s in slots]
        for t in ths:
            t.start()
        for t in ths:
            t.join()

    class Hub:
        """What a SeqBackend needs of its group, for decode loops running as greenlets of one thread."""
        main = None

        def eval(self, view, tokens, k):
            return self.main.switch((view, tokens, k))     # back with this view's logits

        def begin(self, view, tokens, k):
            return None

        def truncate(self, view, n):
            view.shared.truncate_seq(view.seq, n)

    def one_thread_way() -> None:
        for s in slots:
            s.reset()
        hub = Hub()
        views = [SeqBackend(hub, shared, s.target.seq) for s in slots]

        def member(view) -> None:
            for step in generate(view, prompt, sampling, max_tokens=a.tokens):
                hand(step)

        def step_all() -> None:                   # on the engine thread, which evaluates the context
            hub.main = greenlet.getcurrent()
            members = [greenlet.greenlet(member) for _ in views]
            ready = [(g, (v,)) for g, v in zip(members, views)]
            while ready:
                posted = []
                for g, args in ready:
                    rows = g.switch(*args)
                    if not g.dead:
                        posted.append((g, rows))
                if not posted:
                    break
                outs = shared._eval_rows([(v.seq, toks, k) for _, (v, toks, k) in posted])
                ready = [(g, (out,)) for (g, _), out in zip(posted, outs)]
            flush()

        on_engine(step_all)

    ways = {"threads": threads_way, "one thread": one_thread_way}
    res: dict[str, list] = {k: [] for k in ways}
    for r in range(a.rounds):
        order = list(ways) if r % 2 == 0 else list(ways)[::-1]
        for name in order:
            rec["gaps"].clear()
            rec["decodes"].clear()
            rec["last"] = None
            t0 = time.perf_counter()
            ways[name]()
            wall = time.perf_counter() - t0
            res[name].append({"tok_s": a.clients * a.tokens / wall,
                              "gap_us": 1e6 * statistics.median(rec["gaps"]),
                              "decode_ms": 1e3 * statistics.median(rec["decodes"])})
        print(f"round {r + 1}/{a.rounds}: " + ", ".join(
            f"{k} {v[-1]['tok_s']:.1f} tok/s gap {v[-1]['gap_us']:.0f} us" for k, v in res.items()), flush=True)
    rt.close()
    ratios = [o["tok_s"] / t["tok_s"] for o, t in zip(res["one thread"], res["threads"])]
    g = float(np.exp(np.mean(np.log(ratios))))
    se = float(np.std(np.log(ratios), ddof=1) / np.sqrt(len(ratios))) if len(ratios) > 1 else 0.0
    summary = {k: {m: statistics.median(x[m] for x in v) for m in ("tok_s", "gap_us", "decode_ms")}
               for k, v in res.items()}
    print(f"\n{a.model}, {a.threads} threads, {a.clients} sequences x {a.tokens} tokens, {a.rounds} rounds\n")
    print("| who steps the batch | median gap between decodes (us) | median decode (ms) | tok/s (median) |")
    print("|---|---|---|---|")
    for k, v in summary.items():
        print(f"| {k} | {v['gap_us']:.0f} | {v['decode_ms']:.2f} | {v['tok_s']:.1f} |")
    print(f"one thread / threads: {g:.3f} [{g * np.exp(-1.96 * se):.3f}, {g * np.exp(1.96 * se):.3f}], "
          f"{sum(x >= 1 for x in ratios)}/{len(ratios)} rounds >= 1")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "summary": summary, "rounds": res,
                                       "ratio": {"geomean": g, "se_log": se, "ratios": ratios}}, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
