"""Per-position cost of turning logits into a sampled token, sparse (edgerun.speculative.sampling.dist) vs dense.

Records real logit rows of a model (default: the Qwen2.5-Coder-0.5B drafter, 151,936-entry vocabulary)
while it decodes the code and prose prompts of bench/cpu_speed.py, then times on those rows, interleaved
row by row (CPU time of this process, so other jobs on a shared machine change little):

  sparse   dist() + Dist.sample: what the decode loop and the model drafter do per position now
  dense    the same transforms building a float64 vector over the whole vocabulary, a full partition
           for top-k, and sampling by scanning that vector: what they did before (a baseline kept here)

for the default sampling (temperature 0.7, top-k 40, top-p 0.95, min-p 0.05) and greedy (the drafter's
one-hot q then; a point mass now), and checks that both draw the same tokens from the same uniforms.

    python bench/sampling_cost.py [--model qwen2.5-coder-0.5b-instruct] [--rows 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cpu_speed import PROSE  # noqa: E402
from workloads import CODE_PROMPTS, DRAFT  # noqa: E402


def dense_probs(logits: np.ndarray, s) -> np.ndarray:
    """The transforms over a dense [V] float64 vector with a full top-k partition (the baseline)."""
    V = logits.shape[-1]
    out = np.zeros(V)
    if s.greedy:
        out[int(np.argmax(logits))] = 1.0
        return out
    idx = np.argpartition(logits, V - s.top_k)[V - s.top_k:] if 0 < s.top_k < V else np.arange(V)
    z = logits[idx].astype(np.float64) / s.temperature
    w = np.exp(z - z.max())
    w /= w.sum()
    keep = np.ones(len(idx), dtype=bool)
    if s.top_p < 1.0:
        order = np.argsort(-w, kind="stable")
        n_keep = int(np.searchsorted(np.cumsum(w[order]), s.top_p, side="left")) + 1
        keep[:] = False
        keep[order[:n_keep]] = True
    if s.min_p > 0:
        keep &= w >= s.min_p * w.max()
    w = np.where(keep, w, 0.0)
    out[idx] = w / w.sum()
    return out


def dense_sample(p: np.ndarray, rng) -> int:
    idx = np.flatnonzero(p)
    cum = np.cumsum(p[idx])
    return int(idx[min(np.searchsorted(cum, rng.random() * cum[-1], side="right"), len(idx) - 1)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DRAFT)
    ap.add_argument("--rows", type=int, default=128, help="logit rows recorded per prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "sampling_cost.json"))
    a = ap.parse_args()

    import edgerun
    from edgerun.config import SamplingArgs
    from edgerun.speculative.sampling import dist

    rt = edgerun.load(a.model, draft="none", n_threads=a.threads)
    tok, be = rt.tokenizer, rt.target
    rows = []
    for text in (CODE_PROMPTS[0], tok.apply_chat_template(PROSE, add_generation_prompt=True)):
        ids = tok.tokenize(text)
        be.truncate(0)
        logits = be.eval(ids, n_logits=1)[-1]
        for _ in range(a.rows):
            rows.append(logits.copy())
            logits = be.eval([int(np.argmax(logits))])[-1]
    rt.close()

    result = {"model": a.model, "vocab": int(rows[0].shape[-1]), "rows": len(rows)}
    for name, s in (("t=0.7 default", SamplingArgs(temperature=0.7)), ("greedy", SamplingArgs(temperature=0.0))):
        t_sparse, t_dense, same = [], [], True
        for rep in range(a.reps):
            for i, row in enumerate(rows):
                seed = rep * len(rows) + i
                t0 = time.process_time()
                if s.greedy:
                    x_new = int(np.argmax(row))                          # a point mass: nothing to build
                else:
                    x_new = dist(row, s).sample(np.random.default_rng(seed))
                t1 = time.process_time()
                x_old = dense_sample(dense_probs(row, s), np.random.default_rng(seed))
                t2 = time.process_time()
                t_sparse.append(t1 - t0)
                t_dense.append(t2 - t1)
                same &= x_new == x_old
        res = {"sparse_ms": 1e3 * sum(t_sparse) / len(t_sparse), "dense_ms": 1e3 * sum(t_dense) / len(t_dense),
               "same_tokens": bool(same)}
        res["ratio"] = res["sparse_ms"] / res["dense_ms"]
        result[name] = res
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"\n{result['rows']} logit rows of {a.model} (vocabulary {result['vocab']}), {a.reps} repetitions, CPU ms per position")
    print("| sampling | sparse (now) | dense (before) | ratio | same tokens |\n|---|---|---|---|---|")
    for name in ("t=0.7 default", "greedy"):
        r = result[name]
        print(f"| {name} | {r['sparse_ms']:.3f} | {r['dense_ms']:.3f} | {r['ratio']:.3f} | {r['same_tokens']} |")
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
