"""Plain decode speed: edgerun's decode loop vs llama.cpp's own generate loop, same model, same run.

Both decode greedily from the same prompt with the same threads and flash attention; the rate is
(n - 1) / (time of last token - time of first token), so prefill is excluded on both sides.
Runs alternate (edgerun, llama.cpp, edgerun, ...) so that machine noise hits both alike.

    python bench/decode.py [--model smollm2-135m-instruct] [--tokens 128] [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

PROMPT = ("Write a long, detailed essay about the history of the steam engine, from its earliest "
          "designs to the industrial revolution and beyond.\n\n")


def run_edgerun(rt, n: int) -> tuple[float, list[int]]:
    stamps, toks = [], []
    for step in rt.stream(PROMPT, max_tokens=n, temperature=0, gamma=0):
        stamps.append(time.perf_counter())
        toks.append(step.token)
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]), toks


def run_llamacpp(llm, prompt_tokens: list[int], n: int) -> tuple[float, list[int]]:
    llm.reset()
    stamps, toks = [], []
    for tok in llm.generate(prompt_tokens, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        stamps.append(time.perf_counter())
        toks.append(tok)
        if len(toks) >= n:
            break
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]), toks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "decode.json"))
    a = ap.parse_args()

    import llama_cpp

    import edgerun
    from edgerun.resolve import resolve_model

    path = resolve_model(a.model)
    rt = edgerun.load(a.model, draft="none", n_threads=a.threads, n_ctx=a.ctx, flash_attn=True)
    llm = llama_cpp.Llama(str(path), n_ctx=a.ctx, n_threads=a.threads, n_threads_batch=a.threads,
                          flash_attn=True, verbose=False)
    prompt_tokens = rt.tokenize(PROMPT)
    run_edgerun(rt, 8), run_llamacpp(llm, prompt_tokens, 8)     # warm-up (page in weights)

    ours, theirs, same = [], [], True
    for _ in range(a.repeats):
        r1, t1 = run_edgerun(rt, a.tokens)
        r2, t2 = run_llamacpp(llm, prompt_tokens, a.tokens)
        ours.append(r1)
        theirs.append(r2)
        same &= t1 == t2[:len(t1)]
    ratios = [o / t for o, t in zip(ours, theirs)]
    result = {
        "model": a.model, "threads": a.threads, "tokens": a.tokens, "repeats": a.repeats,
        "edgerun_tok_s": ours, "llamacpp_tok_s": theirs, "ratio_per_run": ratios,
        "edgerun_median": statistics.median(ours), "llamacpp_median": statistics.median(theirs),
        "ratio_median": statistics.median(ratios), "same_tokens": same,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))
    print(f"{'run':>4} {'edgerun tok/s':>14} {'llama.cpp tok/s':>16} {'ratio':>7}")
    for i, (o, t, r) in enumerate(zip(ours, theirs, ratios)):
        print(f"{i:>4} {o:>14.1f} {t:>16.1f} {r:>7.3f}")
    print(f"{'med':>4} {result['edgerun_median']:>14.1f} {result['llamacpp_median']:>16.1f} "
          f"{result['ratio_median']:>7.3f}   (same greedy tokens: {same}; overhead "
          f"{(1 - result['ratio_median']) * 100:.1f}%)")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
