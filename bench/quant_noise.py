"""How much perplexity moves when only the rounding of exact ties changes (a noise floor for quantizers).

    python bench/quant_noise.py --model qwen2.5-coder-0.5b-instruct --wiki /path/enwiki_sample.txt \
        [--format q4_0] [--seeds 0 1 2 3] [--windows 16] [--work DIR] [--out JSON]

The float reference is bench/awq.py's (the registry model dequantized, F32 GGUF in --work). Round-
to-nearest is written as it is (llama.cpp's rounding: a code coordinate exactly halfway between two
codes goes up), and once per seed with every such tie sent up or down at random, with the same d
(and m) per block. A tie's two codes are equally far from the weight, so every variant has exactly
the weight error of round-to-nearest, and the same activation-weighted error under any per-channel
or per-element importance: a layer-local objective cannot tell them apart. Their perplexities,
paired against round-to-nearest on the same windows, show how far perplexity moves for reasons no
such objective sees. The paired interval of `eval ppl --vs` covers which windows were scored, not
this; a difference between two quantizers well inside this spread says little about the methods.

Ties are plentiful where the reference itself lies on a finer lattice: Qwen2.5-Coder-0.5B's
dequantized Q5_0 linears, where Q4_0's d = 2 d5 puts every odd 5-bit level exactly between two
4-bit codes. Writes JSON, prints a table.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from awq import eval_texts, float_reference, score_texts  # noqa: E402
from harness import arg_parser, print_table, write_result  # noqa: E402

from edgerun.config import QuantArgs# noqa: E402
from edgerun.formats.source import open_source
from edgerun.formats.gguf import source_kv, write_gguf# noqa: E402
from edgerun.eval.perplexity import compare# noqa: E402
from edgerun.quant import blocks as F# noqa: E402
from edgerun.quant import pipeline as P# noqa: E402
from edgerun.resolve import resolve_model# noqa: E402

TIE_TOL = 1e-3      # |fractional code coordinate - 0.5| below this is a tie (float32 noise is ~1e-6)


def random_ties(fmt: str, w: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, int, float]:
    """Pack w with round-to-nearest's d (and m), every exact tie rounded up or down at random.

    Returns (the raw blocks, the number of ties, max |weight error change| against round-to-nearest
    relative to the block's d). A tie is sent to a code by moving the weight a quarter step towards
    it before the codes are chosen for the fixed d / m (`formats.pack` with params).
    """
    p = F.rtn_params(fmt, w)
    x = w.astype(np.float64).reshape(w.shape[0], -1, F.QK)                   # [rows, nb, 32]
    d = p.d.astype(np.float64)[..., None]                                    # [rows, nb, 1]
    safe = np.where(d == 0, 1.0, d)
    t = x / safe + 8.0 if fmt == "q4_0" else (x - p.m.astype(np.float64)[..., None]) / safe
    frac = t - np.floor(t)
    tie = (np.abs(frac - 0.5) < TIE_TOL) & (d != 0) & (t > 0.5) & (t < 14.5)
    step = np.where(rng.random(x.shape) < 0.5, 0.25, -0.25) * d               # towards the upper / lower code
    moved = (x + np.where(tie, step, 0.0)).astype(np.float32).reshape(w.shape)
    raw = F.pack(fmt, moved, p)
    err_new = np.abs(F.unpack(fmt, raw) - w).reshape(x.shape)
    err_rtn = np.abs(F.fake_quant(fmt, w) - w).reshape(x.shape)
    change = float((np.abs(err_new - err_rtn) / safe).max())
    return raw, int(tie.sum()), change


def write_variant(ref: Path, out: Path, fmt: str, seed: int | None) -> dict:
    """Round-to-nearest `fmt` of the reference (seed None), or with its ties broken by `seed`."""
    src = open_source(str(ref))
    cfg = src.cfg
    args = QuantArgs(method="rtn", format=fmt)
    rng = np.random.default_rng(seed)
    info = {"ties": 0, "linear_elements": 0, "max_error_change_over_d": 0.0}

    def data():
        for n in src.tensor_names():
            kind = P._kind(cfg, n)
            a = src.tensor(n)
            if kind != "linear" or seed is None:
                yield P._store(kind, a, args)
                continue
            raw, n_tie, change = random_ties(fmt, a, rng)
            info["ties"] += n_tie
            info["linear_elements"] += a.size
            info["max_error_change_over_d"] = max(info["max_error_change_over_d"], change)
            yield raw

    write_gguf(out, cfg.arch, list(source_kv(src)), P.tensor_plan(src, args), data(), P.FILE_TYPE[fmt])
    return info


def main() -> None:
    ap = arg_parser(__doc__.split("\n")[0], windows=16, threads=2, work="/tmp/edgerun-bench-noise", out=None)
    ap.add_argument("--model", required=True)
    ap.add_argument("--format", default="q4_0", choices=sorted(P.FILE_TYPE))
    ap.add_argument("--wiki", required=True)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3])
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    ref = float_reference(resolve_model(a.model), work / f"{a.model}.f32.gguf")
    texts = eval_texts(a.wiki)

    def score(path: Path) -> dict:
        return score_texts(path, texts, a.windows, a.threads)

    t0 = time.perf_counter()
    rtn_path = work / f"{a.model}.rtn_{a.format}.noise_base.gguf"
    write_variant(ref, rtn_path, a.format, None)
    rtn = score(rtn_path)
    rows = [{"variant": "rtn", **{t: {"ppl": rtn[t].ppl} for t in texts}}]
    for s in a.seeds:
        f = work / f"{a.model}.rtn_{a.format}.ties_seed{s}.gguf"
        info = write_variant(ref, f, a.format, s)
        res = score(f)
        f.unlink()
        row = {"variant": f"ties seed {s}", **info}
        for t in texts:
            ratio, lo, hi = compare(res[t], rtn[t])
            row[t] = {"ppl": res[t].ppl, "vs_rtn": [ratio, lo, hi]}
        rows.append(row)
        print(f"seed {s}: {info['ties'] / info['linear_elements']:.1%} of linear weights are ties; " + "  ".join(
            f"{t} {row[t]['ppl']:.3f} (/ RTN {ratio:.4f} [{lo:.4f}, {hi:.4f}])"
            for t, (ratio, lo, hi) in ((t, row[t]["vs_rtn"]) for t in texts)), flush=True)
    rtn_path.unlink()
    spread = {}
    for t in texts:
        v = np.array([r[t]["ppl"] for r in rows])
        spread[t] = {"mean": float(v.mean()), "sd": float(v.std(ddof=1)), "sd_rel": float(v.std(ddof=1) / v.mean()),
                     "min": float(v.min()), "max": float(v.max())}
    out = {"model": a.model, "format": a.format, "windows": a.windows, "seconds": time.perf_counter() - t0,
           "float_reference": "registry model dequantized (bench/awq.py)", "rows": rows, "spread": spread}
    print(f"\n{a.model} {a.format}, {a.windows} windows x ctx 512: perplexity of round-to-nearest and of "
          f"{len(a.seeds)} tie-randomised copies (same weight error)")
    print_table(["variant", *(f"{t} PPL" for t in texts)],
                [*([r["variant"], *(r[t]["ppl"] for t in texts)] for r in rows),
                 ["sd (rel.)", *(f"{spread[t]['sd']:.3f} ({100 * spread[t]['sd_rel']:.1f}%)" for t in texts)]],
                fmt=".3f")
    print(f"wrote {write_result(Path(a.out) if a.out else f'quant-noise-{a.model}-{a.format}', out)}")


if __name__ == "__main__":
    main()
