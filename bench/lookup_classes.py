"""How well prompt lookup's drafts are accepted, per hint class (the length of its verbatim match).

Records greedy SmolLM2 answers to the tuner benchmark's lookup prompts (summarise, chat, repeat),
then replays them: at every position where the lookup drafter has a match, its 8-token draft is
compared with what greedy decoding actually produced next (greedy speculative decoding commits
exactly the plain greedy tokens, so the replay gives the acceptance any gamma would see). Prints,
per workload and class, how many positions fell in it, P(first draft token accepted) and the mean
number of draft tokens accepted.

    python bench/lookup_classes.py [--tokens 128] [--threads 2] [--out bench/results/lookup_classes.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tuner import CHAT, repeat_prompt  # noqa: E402
from workloads import SMALL, summarise_prompt  # noqa: E402

BUCKETS = ["1", "2", "3-4", "5-8", "9-16", "17+"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "lookup_classes.json"))
    a = ap.parse_args()

    import edgerun
    from edgerun.speculative.drafters import PromptLookupDrafter

    rt = edgerun.load(SMALL, n_threads=a.threads, n_ctx=4096, flash_attn=True)
    result = {"model": SMALL, "tokens": a.tokens, "classes": BUCKETS, "workloads": {}}
    try:
        for name, prompts in (("summarise", [summarise_prompt()]), ("chat", CHAT), ("repeat", [repeat_prompt()])):
            per = [{"positions": 0, "first_accepted": 0, "accepted": 0} for _ in BUCKETS]
            no_match = 0
            for text in prompts:
                prompt = rt.tokenizer.chat_prompt_tokens([{"role": "user", "content": text}])
                gen = [s.token for s in rt.stream_tokens(prompt, max_tokens=a.tokens, temperature=0.0)]
                d = PromptLookupDrafter()
                ctx = list(prompt)
                for p in range(len(gen)):
                    c = d.hint(ctx)
                    if c is None:
                        no_match += 1
                    else:
                        draft, _ = d.propose(ctx, 8, None, None)
                        n = 0
                        while n < len(draft) and p + n < len(gen) and draft[n] == gen[p + n]:
                            n += 1
                        per[c]["positions"] += 1
                        per[c]["first_accepted"] += n > 0
                        per[c]["accepted"] += n
                    ctx.append(gen[p])
            result["workloads"][name] = {"no_match": no_match, "classes": per}
    finally:
        rt.close()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, out)
    print(f"{'workload':<10}{'match':>7}{'positions':>10}{'P(1st ok)':>10}{'mean ok/8':>10}")
    for name, w in result["workloads"].items():
        print(f"{name:<10}{'none':>7}{w['no_match']:>10}")
        for b, c in zip(BUCKETS, w["classes"]):
            if c["positions"]:
                print(f"{'':<10}{b:>7}{c['positions']:>10}{c['first_accepted'] / c['positions']:>10.2f}"
                      f"{c['accepted'] / c['positions']:>10.2f}")


if __name__ == "__main__":
    main()
