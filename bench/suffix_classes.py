"""How often suffix drafts are accepted, per hint class, on the workloads of issue 52 (bench/free_drafts_serve.py).

For each prompt this bench takes edgerun's plain greedy answer and replays the suffix drafter
(speculative/suffix.py) over prompt + answer: at every position of the answer it asks for the hint class and a
draft of up to `free_gamma_max` tokens, and counts how many of the draft's tokens the greedy answer goes on with.
Per class: the positions where it is offered, the share whose first drafted token is right, the mean run of right
tokens, and a_i, the probability that drafted position i is right given that positions < i were (i = 1, 4, 16:
what the gamma tuner learns per class, speculative/acceptance.py). Greedy answers with drafts are the plain
answer (exact speculation), so the counts are what a run sees, except that a real run asks only at the start of
each cycle. These figures are the source of the suffix classes' prior acceptance (copying.MATCH_PRIOR) and of the
resumed-copy classes' value.

    nice python bench/suffix_classes.py [--models smollm2,qwen] [--workloads abcdef] [--threads 2]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from free_drafts_serve import MAX_TOKENS, workloads  # noqa: E402
from harness import arg_parser, print_table, write_result  # noqa: E402
from workloads import SMALL, TARGET  # noqa: E402

NAMES = ("1", "2", "3-4", "5-8", "9-16", "17+", "resumed 1", "resumed 2+")


def replay(prompt: list[int], answer: list[int], cap: int) -> dict[int, list[int]]:
    """class -> the right-run length of each draft offered over the answer."""
    from edgerun.config import SamplingArgs
    from edgerun.speculative.suffix import SuffixDrafter

    d, rng, sampling = SuffixDrafter(), np.random.default_rng(0), SamplingArgs(temperature=0.0)
    ctx, runs = list(prompt), {}
    for i, tok in enumerate(answer):
        c = d.hint(ctx)
        if c is not None:
            draft, _ = d.propose(ctx, min(cap, len(answer) - i), sampling, rng)
            k = 0
            while k < len(draft) and draft[k] == answer[i + k]:
                k += 1
            runs.setdefault(c, []).append(k)
        ctx.append(tok)
    return runs


def stats(runs: list[int], cap: int) -> dict:
    r = np.asarray(runs)
    a = {f"a{i}": float((r >= i).sum() / max((r >= i - 1).sum(), 1)) for i in (1, 4, 16)}
    return {"offered": len(r), "first_right": float((r >= 1).mean()) if len(r) else 0.0,
            "mean_run": float(r.mean()) if len(r) else 0.0, **a}


def main() -> None:
    ap = arg_parser(__doc__, models="smollm2,qwen", threads=2, out="suffix_classes")
    ap.add_argument("--workloads", default="abcdef")
    a = ap.parse_args()
    from edgerun.config import SpeculativeArgs
    from edgerun.request import Request
    from edgerun.runtime import load

    cap = SpeculativeArgs().free_gamma_max
    names = {"smollm2": SMALL, "qwen": TARGET}
    result, rows = {"free_gamma_max": cap, "rows": []}, []
    for key in a.models.split(","):
        with load(names.get(key, key), draft=None, n_threads=a.threads, pull=False) as rt:
            per = {}
            for item in workloads(a.workloads):
                extra = {k: v for k, v in item["extra"].items() if k in ("response_format", "tools", "tool_choice")}
                request = Request.build(messages=item["messages"], max_tokens=MAX_TOKENS[item["w"]], temperature=0,
                                        **extra)
                prompt = rt.prepare(request).prompt_tokens
                answer = rt.complete(request).tokens
                for c, rs in replay(prompt, answer, cap).items():
                    per.setdefault((item["w"], c), []).extend(rs)
                    per.setdefault(("all", c), []).extend(rs)
                print(f"{key} {item['name']}: {len(answer)} tokens", flush=True)
            for (w, c), rs in sorted(per.items(), key=lambda x: (x[0][0] != "all", x[0])):
                s = {"model": key, "workload": w, "class": NAMES[c], **stats(rs, cap)}
                result["rows"].append(s)
                rows.append([key, w, s["class"], s["offered"], s["first_right"], s["mean_run"], s["a1"], s["a4"],
                             s["a16"]])
    print_table(["model", "workload", "class", "offered", "first right", "mean run", "a1", "a4", "a16"], rows,
                title="suffix drafts replayed on plain greedy answers: how much of each class's draft is right")
    print("wrote", write_result(a.out, result))


if __name__ == "__main__":
    main()
