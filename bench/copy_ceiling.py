"""The ceiling that copying from the conversation allows (issue 52, workloads c, d, f of bench/free_drafts_serve.py).

A drafter that copies text the context holds can at best propose, at each position, the answer's next tokens
wherever they already occur in the prompt or in the answer so far (LZ77's longest earlier match, overlap
allowed): an oracle that knows the answer and always picks the right occurrence. This bench takes edgerun's plain
greedy answer to each prompt and replays it on the cost curve measured in the same run (the target's time to
evaluate n positions with their logits rows, T(n), as edgerun's cost probe times it; the fastest of 5
repetitions, not the probe cache, whose figure may come from a busier moment): at each position the oracle drafts the longest match L (at
most `free_gamma_max`, 48) when one exists and L+1 tokens cost T(L+1); elsewhere one token costs T(1). The
ceiling is plain's time over the oracle's, T(1) x tokens / total; the share of tokens inside copied runs and
their mean length are reported too. Real suffix drafts are below it: they key on the context's last tokens,
cannot know which occurrence goes on, and pay for the positions they get wrong.

    nice python bench/copy_ceiling.py [--models smollm2,qwen] [--workloads cdf] [--threads 2]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from free_drafts_serve import MAX_TOKENS, workloads  # noqa: E402
from harness import arg_parser, print_table, write_result  # noqa: E402
from workloads import SMALL, TARGET  # noqa: E402


def longest_copies(seq: list[int], start: int) -> list[int]:
    """For each position i >= start of seq, the length of the longest run seq[i:i+L] that also begins at an
    earlier position j < i (the run may overlap position i, as LZ77's matches do)."""
    where: dict[int, list[int]] = {}
    for j, t in enumerate(seq[:start]):
        where.setdefault(t, []).append(j)
    out = []
    n = len(seq)
    for i in range(start, n):
        best = 0
        for j in where.get(seq[i], ()):
            k = 0
            while i + k < n and seq[j + k] == seq[i + k]:
                k += 1
            best = max(best, k)
        out.append(best)
        where.setdefault(seq[i], []).append(i)
    return out


def replay(copies: list[int], curve, cap: int) -> dict:
    """The oracle's cycles over one answer: (ceiling, copied share, mean copied run)."""
    i, cost, copied, runs = 0, 0.0, 0, 0
    n = len(copies)
    while i < n:
        draft = min(copies[i], cap, n - i - 1)       # the token after the draft is the target's own
        if draft > 0:
            cost += curve.verify(draft + 1)
            copied += draft
            runs += 1
            i += draft + 1
        else:
            cost += curve.verify(1)
            i += 1
    return {"tokens": n, "ceiling": n * curve.verify(1) / cost, "copied_share": copied / max(n, 1),
            "mean_run": copied / runs if runs else 0.0}


def main() -> None:
    ap = arg_parser(__doc__, models="smollm2,qwen", threads=2, out="copy_ceiling")
    ap.add_argument("--workloads", default="cdf")
    a = ap.parse_args()
    from edgerun.config import SpeculativeArgs
    from edgerun.device.cost import CostCurve
    from edgerun.device.costprobe import measure_verify_times
    from edgerun.request import Request
    from edgerun.runtime import load

    cap = SpeculativeArgs().free_gamma_max
    names = {"smollm2": SMALL, "qwen": TARGET}
    rows, result = [], {"free_gamma_max": cap, "rows": []}
    for key in a.models.split(","):
        with load(names.get(key, key), draft=None, n_threads=a.threads, pull=False) as rt:
            times = measure_verify_times(rt.target, n_max=cap + 1, reps=5)
            curve = CostCurve(t_verify=tuple(float(t) for t in times.min(axis=0)), t_draft=0.0)
            for item in workloads(a.workloads):
                request = Request.build(messages=item["messages"], max_tokens=MAX_TOKENS[item["w"]], temperature=0)
                prompt = rt.prepare(request).prompt_tokens
                answer = rt.complete(request).tokens
                r = {"model": key, "workload": item["w"], "prompt": item["name"],
                     **replay(longest_copies(prompt + answer, len(prompt)), curve, cap)}
                result["rows"].append(r)
                rows.append([key, r["workload"], r["prompt"], r["tokens"], r["copied_share"], r["mean_run"],
                             r["ceiling"]])
                print(f"{key} {item['name']}: {r['tokens']} tokens, {r['copied_share']:.0%} copied, "
                      f"ceiling {r['ceiling']:.2f}x", flush=True)
            result.setdefault("t_verify", {})[key] = list(curve.t_verify)
    print_table(["model", "workload", "prompt", "tokens", "copied share", "mean run", "ceiling x plain"], rows,
                title=f"copy ceiling: an oracle drafting the longest earlier match (<= {cap}) on the measured curve")
    print("wrote", write_result(a.out, result))


if __name__ == "__main__":
    main()
