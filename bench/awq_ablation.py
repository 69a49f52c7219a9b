"""Ablations of the AWQ quantizer: which part of it lowers perplexity.

    python bench/awq_ablation.py --model smollm2-135m-instruct --format q4_0 --wiki /path/enwiki_sample.txt \
        --work /tmp/edgerun-bench-awq-smol [--windows 16]

Variants (each quantized from the same F32 reference as bench/awq.py, into the same --work folder,
so run bench/awq.py first for the reference, RTN and default AWQ files; existing files are reused):
  awq_<fmt>_channel / awq_<fmt>_element  AWQ with the block search weighted by E[x^2] per input channel,
                                          or also by sqrt(sigma2 + w^2) per element (one is the default:
                                          pipeline.ELEMENT_IMPORTANCE; only the other is quantized here)
  awq_<fmt>_all                           AWQ scales also for o and down (1/s folded into v and up rows:
                                          the AWQ paper's groups; off by default, see pipeline.awq_block)
  search_<fmt>_channel / _element         no AWQ scale search: per-block d/m search vs round-to-nearest
  --extra NAME='{"rescore": 1}'           more variants: awq_block options as JSON (repeatable)
Perplexity is scored exactly as in bench/awq.py (ctx 512, second half of each window). Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from awq import eval_texts, float_reference, run_child  # noqa: E402

from edgerun.eval.perplexity import paired_ratio, perplexity# noqa: E402
from edgerun.quant.pipeline import ELEMENT_IMPORTANCE# noqa: E402
from edgerun.resolve import resolve_model# noqa: E402

CHILD = """import json, sys
from edgerun.resolve import quantize
r = quantize(sys.argv[1], sys.argv[2], method="awq", format=sys.argv[3], block_options=json.loads(sys.argv[4]))
print(json.dumps({"error_reduction": r.error_reduction}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--format", default="q4_0", choices=sorted(ELEMENT_IMPORTANCE))
    ap.add_argument("--wiki", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--from-bench", default=None, metavar="JSON",
                    help="bench/awq.py's JSON for the same --work and --windows: its float/RTN/AWQ perplexities "
                         "are reused instead of scored again (same files, same tokens)")
    ap.add_argument("--extra", action="append", default=[], metavar="NAME=JSON",
                    help="another variant: awq_block options as JSON, e.g. rescore1='{\"rescore\": 1}'")
    a = ap.parse_args()
    work, fmt, name = Path(a.work), a.format, a.model
    work.mkdir(parents=True, exist_ok=True)
    ref = float_reference(resolve_model(name), work / f"{name}.f32.gguf")
    default = "element" if ELEMENT_IMPORTANCE[fmt] else "channel"
    other = "channel" if default == "element" else "element"
    variants = {f"rtn_{fmt}": None, f"awq_{fmt}": None,
                f"awq_{fmt}_{other}": {"element": other == "element"},
                f"awq_{fmt}_all": {"scale_after_linear": True},
                f"search_{fmt}_channel": {"scales": False, "element": False},
                f"search_{fmt}_element": {"scales": False, "element": True}}
    for e in a.extra:
        k, _, js = e.partition("=")
        variants[f"{k}_{fmt}"] = json.loads(js)
    texts = eval_texts(a.wiki)
    res = {"model": name, "format": fmt, "windows": a.windows, "default_importance": default, "variants": {}}
    out = Path(a.out or ROOT / "bench" / "results" / f"awq-ablation-{name}-{fmt}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    prior = {}
    if a.from_bench:
        b = json.load(open(a.from_bench))
        if b["method"]["windows"] != a.windows:
            raise SystemExit(f"error: {a.from_bench} scored {b['method']['windows']} windows, not {a.windows}")
        prior = b["models"][name]["variants"]
    for key, opts in [("float", None), *variants.items()]:
        path = ref if key == "float" else work / f"{name}.{key}.gguf"
        v = res["variants"][key] = {"block_options": opts}
        if opts is None and all(f"ppl_{t}" in prior.get(key, {}) for t in texts):
            v.update({k: prior[key][k] for t in texts for k in (f"ppl_{t}", f"window_nll_{t}") if k in prior[key]},
                     from_bench=a.from_bench)
            continue
        if not path.exists():
            if opts is None:
                raise SystemExit(f"error: {path} is missing; run bench/awq.py with --work {work} first")
            print(f"[{name}] quantize {key} ...", flush=True)
            r = run_child([sys.executable, "-c", CHILD, str(ref), str(path), fmt, json.dumps(opts)])
            v.update(json.loads(r.pop("stdout")), **r)
        for t, text in texts.items():
            print(f"[{name}] ppl {key} on {t} ...", flush=True)
            r = perplexity(path, text, ctx=512, n_threads=a.threads, max_windows=a.windows)
            v[f"ppl_{t}"], v[f"window_nll_{t}"] = r.ppl, list(r.window_nll)
        json.dump(res, open(out, "w"), indent=1)
    f, r_ = res["variants"]["float"], res["variants"][f"rtn_{fmt}"]
    print(f"\n{name} {fmt}, perplexity at ctx 512, {a.windows} windows; gain = share of RTN's increase removed")
    print(f"{'variant':24s} {'wiki':>8s} {'code':>8s} {'gain wiki':>10s} {'gain code':>10s}   "
          f"PPL / default AWQ's, paired 95% (wiki; code)")
    base = res["variants"][f"awq_{fmt}"]
    for key, v in res["variants"].items():
        g = [(r_[f"ppl_{t}"] - v[f"ppl_{t}"]) / (r_[f"ppl_{t}"] - f[f"ppl_{t}"]) for t in texts]
        pair = []
        for t in texts:
            if key != f"awq_{fmt}" and f"window_nll_{t}" in v and f"window_nll_{t}" in base:
                r, lo, hi = paired_ratio(v[f"window_nll_{t}"], base[f"window_nll_{t}"])
                v[f"vs_awq_{t}"] = [r, lo, hi]
                pair.append(f"{r:.3f} [{lo:.3f}, {hi:.3f}]")
        print(f"{key:24s} {v['ppl_wiki']:8.3f} {v['ppl_code']:8.3f} {g[0]:10.1%} {g[1]:10.1%}   {'; '.join(pair)}")
    json.dump(res, open(out, "w"), indent=1)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
