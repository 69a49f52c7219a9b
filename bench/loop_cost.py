"""The decode loop's own cost per token: generate() over an instant fake backend, plain and at a fixed gamma.

    python bench/loop_cost.py [--tokens 4000] [--rounds 7] [--vocab 64] [--gamma 4] [--trees DIR [DIR ...]]

The fake target returns precomputed logits (the next token is the last one plus one, never end-of-generation)
and the fake drafter proposes exactly those tokens at no cost, so every draft is accepted and what is timed
is generate() itself: drafting calls, verification, commits, the text releaser, statistics. Greedy sampling.
Prints microseconds per generated token (median over rounds) for gamma 0 (plain) and --gamma, as the
generating thread's CPU time (what the loop itself costs, whatever else runs on the machine) and as wall time.

--trees runs the same measurement on several source trees (e.g. main's worktree and a branch's) in child
processes, interleaved round by round, so the trees share the machine's state; each child imports edgerun
from its tree. Writes bench/results/loop_cost.json.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from pathlib import Path

from harness import arg_parser, child_json, print_table, ROOT, run_json_child, write_result   # bench/harness.py (script dir)


class _Tokenizer:
    def __init__(self, n_vocab: int) -> None:
        self.n_vocab = n_vocab

    def token_bytes(self, token: int) -> bytes:
        return b"a"

    def is_eog(self, token: int) -> bool:
        return False


class InstantBackend:
    """A Backend whose evaluation costs one fancy index: logits row t is one-hot at (t + 1) % n_vocab."""

    def __init__(self, n_vocab: int, n_ctx: int) -> None:
        import numpy as np

        self.name, self.n_vocab, self.n_ctx = "instant", n_vocab, n_ctx
        self.tokens: list[int] = []
        self.vocab_fingerprint, self.weight_bytes = "instant", 0
        self.tokenizer = _Tokenizer(n_vocab)
        self.table = np.full((n_vocab, n_vocab), -10.0, dtype=np.float32)   # [token, next-token logits]
        self.table[np.arange(n_vocab), (np.arange(n_vocab) + 1) % n_vocab] = 10.0

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def eval(self, tokens, n_logits=None):
        self.tokens.extend(tokens)
        k = len(tokens) if n_logits is None else min(n_logits, len(tokens))
        return self.table[tokens[len(tokens) - k:]] if k else self.table[:0]

    def truncate(self, n: int) -> None:
        del self.tokens[n:]

    def close(self) -> None:
        pass


class InstantDrafter:
    """Proposes the target's own next tokens (all accepted) without evaluating anything."""

    name, vocab_fingerprint, weight_bytes, n_classes = "instant", None, 0, 1

    def __init__(self, n_vocab: int) -> None:
        self.n_vocab = n_vocab

    def hint(self, context, logits=None):
        return None

    def lag(self, context) -> int:
        return 0

    def propose(self, context, gamma, sampling, rng, constraint=None):
        last = context[-1]
        return [(last + i) % self.n_vocab for i in range(1, gamma + 1)], None

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass


def _fixed_gamma():
    for name in ("edgerun.speculative.gamma", "edgerun.spec.gamma"):     # its name after and before the rename
        try:
            return importlib.import_module(name).FixedGamma
        except ImportError:
            continue
    raise ImportError("no FixedGamma in edgerun.speculative.gamma or edgerun.spec.gamma")


def measure(tokens: int, vocab: int, gamma: int) -> dict:
    """Microseconds per generated token of one generation of `tokens` tokens, plain and at `gamma`: wall time
    and this thread's CPU time (which another process on the machine does not add to)."""
    from edgerun.config import SamplingArgs
    from edgerun.generate import generate

    FixedGamma = _fixed_gamma()
    sampling = SamplingArgs(temperature=0.0)
    out = {}
    for g in (0, gamma):
        target = InstantBackend(vocab, tokens + 16)
        drafter = InstantDrafter(vocab) if g else None
        policy = FixedGamma(g) if g else None
        t0, c0 = time.perf_counter(), time.thread_time()
        n = sum(1 for _ in generate(target, [1], sampling, max_tokens=tokens, drafter=drafter, policy=policy,
                                    is_eog=lambda t: False))
        out[f"gamma={g}"] = (time.thread_time() - c0) / n * 1e6
        out[f"gamma={g} wall"] = (time.perf_counter() - t0) / n * 1e6
    return out


def main() -> None:
    ap = arg_parser(__doc__, tokens=4000, rounds=7, gamma=4)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--trees", nargs="*", default=None, help="Source trees to compare (default: this one).")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        run_json_child(lambda: measure(a.tokens, a.vocab, a.gamma))
        return
    trees = [str(Path(t).resolve()) for t in (a.trees or [ROOT])]
    runs: dict[str, list[dict]] = {t: [] for t in trees}
    cmd = [sys.executable, __file__, "--child", "--tokens", str(a.tokens), "--vocab", str(a.vocab),
           "--gamma", str(a.gamma)]
    for _ in range(a.rounds):
        for t in trees:                                    # interleaved: the trees see the same machine
            runs[t].append(child_json(cmd, env=dict(os.environ, PYTHONPATH=t), cwd=t))
    keys = ["gamma=0", f"gamma={a.gamma}", "gamma=0 wall", f"gamma={a.gamma} wall"]
    summary = {t: {k: statistics.median(r[k] for r in rs) for k in keys} for t, rs in runs.items()}
    print_table(["tree", "plain us/token (CPU)", f"gamma {a.gamma} (CPU)", "plain (wall)", f"gamma {a.gamma} (wall)"],
                [[t, *(summary[t][k] for k in keys)] for t in trees])
    write_result("loop_cost", {"args": vars(a), "median_us_per_token": summary, "rounds": runs})


if __name__ == "__main__":
    main()
