"""Does the AWQ search's layer-local objective rank its variants the way perplexity does?

    python bench/awq_block_error.py --model smollm2-135m-instruct --wiki /path/enwiki_sample.txt \
        [--format q4_0] [--work /tmp/edgerun-bench-awq-smol] [--layers N]

For each block of the float reference (the F32 GGUF that bench/awq.py writes into --work), the
block is quantized as `awq_block` would (calibration: the default 4096 tokens of Python reference
prose) under each variant, and the block's output with the fake-quantized weights is compared with
the float block's output, both from the float model's input: on the calibration tokens and on
2048 held-out Wikipedia tokens. Reported per block: the median over tokens of
||y_q - y||^2 / ||y||^2 (y: the block output, i.e. the residual stream after the block).
Variants: awq (the default: scales only after the norms), awq_all (also o and down, the AWQ
paper's groups), search (no scales: the per-block d search only). Compare with the perplexities of
bench/awq_ablation.py. Writes JSON, prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from awq import float_reference  # noqa: E402

from edgerun.eval.texts import token_sequences# noqa: E402
from edgerun.config import QuantArgs# noqa: E402
from edgerun.formats.source import open_source# noqa: E402
from edgerun.quant import blocks as F# noqa: E402
from edgerun.quant import pipeline# noqa: E402
from edgerun.reference.llama import block_forward# noqa: E402
from edgerun.resolve import resolve_model# noqa: E402
from edgerun.tokenizer import Tokenizer# noqa: E402

VARIANTS = {"awq": {}, "awq_all": {"scale_after_linear": True}, "search": {"scales": False}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--format", default="q4_0", choices=sorted(pipeline.FILE_TYPE))
    ap.add_argument("--wiki", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--layers", type=int, default=None, help="only the first N blocks")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    ref = float_reference(resolve_model(a.model), work / f"{a.model}.f32.gguf")
    src = open_source(str(ref))
    cfg, fmt = src.cfg, a.format
    _, calib = pipeline._calibration(src, src.path, QuantArgs(format=fmt), cfg)
    tok = Tokenizer.from_gguf(src.path)
    bos = tok.bos_id if tok.add_bos and tok.bos_id >= 0 else None
    wiki = token_sequences(Path(a.wiki).read_text(), lambda t: tok.tokenize(t, special=False, add_bos=False),
                           2048, 512, bos)
    emb = src.tensor("token_embd.weight")
    xs = {"calib": emb[calib].astype(np.float32), "wiki": emb[wiki].astype(np.float32)}
    n = cfg.n_layer if a.layers is None else min(a.layers, cfg.n_layer)
    rows = []
    print(f"{a.model} {fmt}: median over tokens of ||y_q - y||^2 / ||y||^2 per block")
    print(f"{'block':>5s} " + " ".join(f"{v + ':' + t:>15s}" for v in VARIANTS for t in xs))
    for i in range(n):
        pre = f"blk.{i}."
        w = {m[len(pre):]: src.tensor(m) for m in src.tensor_names() if m.startswith(pre)}
        ys = {t: block_forward(cfg, w, x)[0] for t, x in xs.items()}
        row = {"block": i}
        for v, opts in VARIANTS.items():
            folded, params, _, _ = pipeline.awq_block(cfg, fmt, w, xs["calib"], 20, 512, np.random.default_rng(0),
                                                      i, **opts)
            wq = {k: F.fake_quant(fmt, t, params[k]) if k in params else t for k, t in folded.items()}
            for t, x in xs.items():
                e = block_forward(cfg, wq, x)[0] - ys[t]
                row[f"{v}_{t}"] = float(np.median(np.square(e).sum(-1) / np.square(ys[t]).sum(-1)))
        rows.append(row)
        print(f"{i:5d} " + " ".join(f"{row[f'{v}_{t}']:15.3e}" for v in VARIANTS for t in xs), flush=True)
        xs = ys
    summary = {}
    for v in VARIANTS:
        for t in ("calib", "wiki"):
            r = np.array([row[f"{v}_{t}"] / row[f"awq_{t}"] for row in rows])
            summary[f"{v}_{t}"] = {"geomean_vs_awq": float(np.exp(np.log(r).mean())),
                                   "blocks_below_awq": int((r < 1).sum())}
    print("\nagainst the default (awq): geometric mean ratio of the block errors, blocks with a lower error")
    for k, s in summary.items():
        print(f"  {k:14s} x{s['geomean_vs_awq']:.3f}  {s['blocks_below_awq']}/{len(rows)}")
    out = Path(a.out or ROOT / "bench" / "results" / f"awq-block-error-{a.model}-{fmt}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    json.dump({"model": a.model, "format": fmt, "blocks": rows, "summary": summary}, open(out, "w"), indent=1)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
