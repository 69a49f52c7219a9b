"""How well a model drafter's drafts are accepted, per hint class (the target's margin at the last
verified position: edgerun.speculative.drafters.margin_class).

Runs the Qwen pair (registry files unless --target/--draft say otherwise) at a fixed gamma on the code
and prose prompts of bench/cpu_speed.py, greedy and at temperature 0.7, and records every cycle's class
and how many of its drafts were accepted. Prints, per workload and class, the number of cycles and the
mean number of drafts accepted.

    python bench/margin_classes.py [--gamma 3] [--tokens 128] [--threads 1] [--out bench/results/margin_classes.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cpu_speed import PROSE  # noqa: E402
from workloads import CODE_PROMPTS, DRAFT, TARGET  # noqa: E402

STORY = [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in a bottle."}]


class Recorder:
    """A fixed-gamma policy that keeps each cycle's (class, accepted)."""

    def __init__(self, gamma: int) -> None:
        self.gamma, self.rows, self._hint = gamma, [], None

    def choose(self, hint=0):
        self._hint = hint
        return self.gamma

    def observe(self, gamma, n_accepted, t_draft, t_verify):
        if gamma:
            self.rows.append((self._hint, n_accepted))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--draft", default=DRAFT)
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "margin_classes.json"))
    a = ap.parse_args()

    import edgerun
    from edgerun.config import SamplingArgs
    from edgerun.generate import generate
    from edgerun.speculative.drafters import MARGINS

    rt = edgerun.load(a.target, draft=a.draft, n_threads=a.threads, gamma=a.gamma)
    tok = rt.tokenizer
    prompts = {"code": list(CODE_PROMPTS),
               "prose": [tok.apply_chat_template(m, add_generation_prompt=True) for m in (PROSE, STORY)]}
    names = [f"< {MARGINS[0]:g}"] + [f"{lo:g}-{hi:g}" for lo, hi in zip(MARGINS, MARGINS[1:])] + [f"> {MARGINS[-1]:g}"]
    out = {}
    for kind, texts in prompts.items():
        for temp in (0.0, 0.7):
            rec = Recorder(a.gamma)
            for text in texts:
                for _ in generate(rt.target, tok.tokenize(text), SamplingArgs(temperature=temp, seed=1),
                                  max_tokens=a.tokens, drafter=rt.drafter, policy=rec, is_eog=lambda t: False):
                    pass
            per = {}
            for c, name in enumerate(names):
                acc = [n for h, n in rec.rows if h == c]
                per[name] = {"cycles": len(acc), "mean_accepted": sum(acc) / len(acc) if acc else None}
            out[f"{kind} t={temp}"] = per
            print(kind, temp, per, flush=True)
    rt.close()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"gamma": a.gamma, "tokens": a.tokens, "target": a.target,
                                       "draft": a.draft, "classes": out}, indent=1))
    print("\n| margin class | " + " | ".join(out) + " |")
    print("|---" * (len(out) + 1) + "|")
    for name in names:
        cells = [f"{v[name]['mean_accepted']:.2f} ({v[name]['cycles']})" if v[name]["cycles"] else "-"
                 for v in out.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
