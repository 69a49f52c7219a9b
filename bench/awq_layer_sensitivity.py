"""Where does round-to-nearest lose perplexity? RTN everywhere, one group of layers kept at Q8_0.

    python bench/awq_layer_sensitivity.py --model qwen2.5-coder-0.5b-instruct --wiki /path/enwiki_sample.txt \
        [--format q4_0] [--groups 0 1-3 4-11 12-19 20-22 23] [--windows 16] [--work DIR] [--out JSON]

The float reference is bench/awq.py's (the registry model dequantized, F32 GGUF in --work). For each
layer group, the round-to-nearest file is written with that group's linear weights stored as Q8_0
(near lossless) instead of the 4-bit format, and scored against plain round-to-nearest on the same
windows (paired 95% interval). The perplexity each group's Q8_0 recovers, as a share of RTN's
increase over the float reference, says whether a model's 4-bit loss sits in a few layers (which a
method could target) or is spread over all of them. Writes JSON, prints a table.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

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


def layer_set(spec: str) -> set[int]:
    """'4-11' -> {4..11}; '7' -> {7}."""
    lo, _, hi = spec.partition("-")
    return set(range(int(lo), int(hi or lo) + 1))


def write_mixed(ref: Path, out: Path, fmt: str, keep: set[int]) -> None:
    """Round-to-nearest `fmt` of the float reference, with the linears of layers `keep` as Q8_0."""
    src = open_source(str(ref))
    cfg = src.cfg
    args = QuantArgs(method="rtn", format=fmt)

    def kept(n: str) -> bool:
        return P._kind(cfg, n) == "linear" and int(n.split(".")[1]) in keep

    plan = P.tensor_plan(src, args, lambda n: "q8_0" if kept(n) else P.storage_type(cfg, n, args))
    data = (F.pack("q8_0", src.tensor(n)) if kept(n) else P._store(P._kind(cfg, n), src.tensor(n), args)
            for n in src.tensor_names())
    write_gguf(out, cfg.arch, list(source_kv(src)), plan, data, P.FILE_TYPE[fmt])


def main() -> None:
    ap = arg_parser(__doc__.split("\n")[0], windows=16, threads=2, work="/tmp/edgerun-bench-layers", out=None)
    ap.add_argument("--model", required=True)
    ap.add_argument("--format", default="q4_0", choices=sorted(P.FILE_TYPE))
    ap.add_argument("--wiki", required=True)
    ap.add_argument("--groups", nargs="+", default=["0", "1-3", "4-11", "12-19", "20-22", "23"])
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    ref = float_reference(resolve_model(a.model), work / f"{a.model}.f32.gguf")
    texts = eval_texts(a.wiki)
    n_layer = open_source(str(ref)).cfg.n_layer
    groups = [(g, layer_set(g)) for g in a.groups]
    bad = [g for g, s in groups if not s or max(s) >= n_layer]
    if bad:
        sys.exit(f"error: layer groups {bad} are outside 0..{n_layer - 1}")

    def score(path: Path) -> dict:
        return score_texts(path, texts, a.windows, a.threads)

    t0 = time.perf_counter()
    rtn = work / f"{a.model}.rtn_{a.format}.q8_layers_none.gguf"     # written here, never a bench file
    write_mixed(ref, rtn, a.format, set())
    base = {"float": score(ref), "rtn": score(rtn)}
    rows = []
    for g, keep in groups:
        f = work / f"{a.model}.rtn_{a.format}.q8_layers_{g}.gguf"
        write_mixed(ref, f, a.format, keep)
        res = score(f)
        f.unlink()
        row = {"layers": g}
        for t in texts:
            gap = base["rtn"][t].ppl - base["float"][t].ppl
            ratio, lo, hi = compare(res[t], base["rtn"][t])
            row[t] = {"ppl": res[t].ppl, "share_of_gap": (base["rtn"][t].ppl - res[t].ppl) / gap,
                      "vs_rtn": [ratio, lo, hi]}
        rows.append(row)
        print(f"layers {g:>6s} at Q8_0: " + "  ".join(
            f"{t} {row[t]['ppl']:.3f} ({100 * row[t]['share_of_gap']:5.1f}% of the gap; / RTN {row[t]['vs_rtn'][0]:.3f} "
            f"[{row[t]['vs_rtn'][1]:.3f}, {row[t]['vs_rtn'][2]:.3f}])" for t in texts), flush=True)
    out = {"model": a.model, "format": a.format, "windows": a.windows, "seconds": time.perf_counter() - t0,
           "float": {t: r.ppl for t, r in base["float"].items()}, "rtn": {t: r.ppl for t, r in base["rtn"].items()},
           "groups": rows}
    print(f"\n{a.model} {a.format}, {a.windows} windows x ctx 512: float " +
          ", ".join(f"{t} {out['float'][t]:.3f}" for t in texts) + "; RTN " +
          ", ".join(f"{t} {out['rtn'][t]:.3f}" for t in texts))
    print_table(["Q8_0 layers", *(h for t in texts for h in (f"{t} PPL", "share"))],
                [[r["layers"], *(c for t in texts for c in (f"{r[t]['ppl']:.3f}", f"{100 * r[t]['share_of_gap']:.1f}%"))]
                 for r in rows])
    print(f"wrote {write_result(Path(a.out) if a.out else f'awq-layers-{a.model}-{a.format}', out)}")


if __name__ == "__main__":
    main()
