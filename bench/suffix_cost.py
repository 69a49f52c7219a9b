"""What suffix lookup (spec/suffix.py) costs the decode loop per token, against prompt lookup.

A real token stream (SmolLM2's tokenizer over a CPython stdlib file, --tokens long, the first --prompt of it
taken as the prompt) is fed to each drafter as a decode loop would: one token appended to the context per
cycle, then hint() and propose(gamma 4). Reported: microseconds per token (median of --repeats), the share
of positions with a match, the mean match length the draft was taken from, and how many drafted tokens
equal the tokens that really followed (what greedy verification would accept).

    nice python bench/suffix_cost.py [--tokens 3000] [--prompt 1500] [--repeats 3]
        [--out bench/results/suffix_cost.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edgerun.config import SamplingArgs  # noqa: E402
from edgerun.speculative.drafters import PromptLookupDrafter  # noqa: E402
from edgerun.speculative.suffix import SuffixDrafter  # noqa: E402


def stream(n: int) -> list[int]:
    from edgerun.resolve import resolve_model
    from edgerun.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(resolve_model("smollm2-135m-instruct", pull=True))
    text = Path(sysconfig.get_paths()["stdlib"], "argparse.py").read_text()
    return tok.tokenize(text, add_bos=False)[:n]


def measure(make, toks: list[int], n_prompt: int) -> dict:
    d = make()
    rng = np.random.default_rng(0)
    greedy = SamplingArgs(temperature=0.0)
    ctx = list(toks[:n_prompt])
    matched = drafted = hit = 0
    t0 = time.perf_counter()
    for i in range(n_prompt, len(toks) - 4):
        ctx.append(toks[i])
        if d.hint(ctx) is not None:
            matched += 1
            draft, _ = d.propose(ctx, 4, greedy, rng)
            drafted += len(draft)
            for a, b in zip(draft, toks[i + 1:i + 5]):
                if a != b:
                    break
                hit += 1
    dt = time.perf_counter() - t0
    n = len(toks) - 4 - n_prompt
    return {"us_per_token": 1e6 * dt / n, "matched": matched / n, "drafted": drafted, "accepted": hit,
            "acceptance": hit / drafted if drafted else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--prompt", type=int, default=1500)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "suffix_cost.json"))
    a = ap.parse_args()
    from edgerun.util.atomic import write_json

    toks = stream(a.tokens)
    rows = {}
    for name, make in (("lookup", PromptLookupDrafter), ("suffix", SuffixDrafter)):
        runs = [measure(make, toks, a.prompt) for _ in range(a.repeats)]
        rows[name] = {**runs[-1], "us_per_token": statistics.median(r["us_per_token"] for r in runs)}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, {"tokens": len(toks), "prompt": a.prompt, "rows": rows})
    print("| drafter | us per token (sync + hint + propose 4) | positions with a match | drafted | "
          "equal to what followed |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['us_per_token']:.1f} | {100 * r['matched']:.0f}% | {r['drafted']} | "
              f"{r['accepted']} ({100 * r['acceptance']:.0f}%) |")


if __name__ == "__main__":
    main()
