"""Plain decode speed: edgerun's decode loop vs llama.cpp's own generate loop, same model, same run.

Both decode greedily from the same prompt with the same threads and flash attention; the rate is
(n - 1) / (time of last token - time of first token), so prefill is excluded on both sides.
Runs alternate (edgerun, llama.cpp, edgerun, ...) so that machine noise hits both alike.

    python bench/decode.py [--model smollm2-135m-instruct] [--tokens 128] [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from harness import arg_parser, print_table, timed_tokens, write_result  # noqa: E402

PROMPT = ("Write a long, detailed essay about the history of the steam engine, from its earliest "
          "designs to the industrial revolution and beyond.\n\n")


def run_edgerun(rt, n: int) -> tuple[float, list[int]]:
    t = timed_tokens(rt.stream(PROMPT, max_tokens=n, temperature=0, gamma=0))
    return t.rate, t.tokens


def run_llamacpp(llm, prompt_tokens: list[int], n: int) -> tuple[float, list[int]]:
    llm.reset()
    t = timed_tokens(llm.generate(prompt_tokens, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0),
                     limit=n)
    return t.rate, t.tokens


def main() -> None:
    ap = arg_parser(__doc__, model="smollm2-135m-instruct", tokens=128, repeats=5, threads=2, ctx=2048, out="decode")
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
    out = write_result(Path(a.out), result)
    rows = [[str(i), o, t, r] for i, (o, t, r) in enumerate(zip(ours, theirs, ratios))]
    rows.append(["med", result["edgerun_median"], result["llamacpp_median"], result["ratio_median"]])
    print_table(["run", "edgerun tok/s", "llama.cpp tok/s", "ratio"], rows, fmt=".3f")
    print(f"same greedy tokens: {same}; overhead {(1 - result['ratio_median']) * 100:.1f}%")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
