"""A PREDICTION, not a measurement: the gamma edgerun's tuner would choose on a GPU board, and its speed-up
over plain decoding, for the real Qwen2.5-Coder 1.5B + 0.5B pair.

The tuner's own code (edgerun/speculative/gamma.py: GammaTuner.rates, the cost model it decides with every
cycle) is fed
- a cost curve T(n)/T(1), n = 1..9 (one target eval of n tokens with logits at every position), and the
  drafter's step / the target's step;
- the acceptance measured on a CPU for the real pair, per hint class (the target's margin at the last
  verified position), as if the tuner had seen 10,000 cycles of each class (its posterior then is the
  measured rate). Acceptance is a property of the two models and the text, not of the device, as long as
  the logits are the same (on CUDA they are not bit for bit the CPU's; bench/gpu_curve.py measures how far).

Curves (--curve FILE adds a measured one, a bench/gpu_curve.py JSON):
- agx-orin: T(4)/T(1) = 0.97 published for llama.cpp's MMQ kernel on a Jetson AGX Orin (llama.cpp issue
  #28285, Qwen3.5-4B); T(2), T(3) interpolated between 1.00 and 0.97; n = 5..9 ASSUMED to grow 3% a
  position (no published point).
- orin-nano: an ESTIMATE, nothing published: the Orin Nano has half the AGX's GPU cores and a third of its
  memory bandwidth (68 vs 204.8 GB/s), so a step is at least as memory-bound: T(n)/T(1) = 1.00 for
  n <= 4, then +4% a position.
- orin-nano-pessimistic: +5% for every position from n = 2 (a kernel far from the roofline).
- zen3-cpu: the curve MEASURED on the 2-core AMD EPYC Zen 3 development CPU (docs/speculative.md, all-Q4_K
  1.5B @spec: T(2..4)/T(1) = 1.62, 2.41, 3.33, T(8) = 5.98; drafter step 0.31 T(1)); n = 5..7 interpolated,
  9 extrapolated: the check that the model predicts what was measured there (speculation loses).
The drafter's step on a GPU board: 0.44 T(1), the ratio of the weight bytes (491 / 1117 MB; a decode step
on these boards reads every weight once), and 0.65 as a sensitivity case (small models pay a fixed
launch cost per layer).

Acceptance (docs/gamma.md, "margin class" table: registry Qwen pair, gamma 3, 1 thread, 2 prompts x 128
tokens, `python bench/margin_classes.py`): mean drafts accepted of 3 per class, turned into a per-position
rate a with a + a^2 + a^3 = mean; class weights = its share of the cycles.

    python bench/predict_gpu.py [--curve bench/results/gpu_curve-gpu.json] [--out bench/results/predict_gpu.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgerun.device.cost import CostCurve  # noqa: E402
from edgerun.speculative.gamma import GammaTuner  # noqa: E402

GAMMA_MAX = 8
N_OBSERVED = 1e4

# docs/gamma.md: mean drafts accepted of 3 (cycles) per margin class (< 1, 1-3, 3-6, > 6 logits)
MARGIN_TABLE = {
    "code greedy": [(1.76, 17), (2.41, 17), (2.86, 7), (2.54, 35)],
    "code t=0.7": [(2.29, 17), (2.05, 20), (2.50, 12), (2.46, 28)],
    "prose greedy": [(1.31, 49), (1.49, 39), (2.00, 7), (2.13, 8)],
    "prose t=0.7": [(1.21, 56), (1.32, 34), (2.15, 13), (2.00, 4)],
}
ACCEPTANCE_SOURCE = ("docs/gamma.md margin-class table (bench/margin_classes.py; registry Qwen2.5-Coder 1.5B "
                     "Q4_K_M + 0.5B, gamma 3, 1 thread, 2-core CPU)")
CLASSES = ["margin < 1", "margin 1-3", "margin 3-6", "margin > 6"]

DRAFT_BYTES_RATIO = 491_400_064 / 1_117_320_768


def _grow(base: list[float], step: float, n: int = GAMMA_MAX + 1) -> list[float]:
    out = list(base)
    while len(out) < n:
        out.append(out[-1] + step)
    return out


def _zen3() -> list[float]:
    pts = {1: 1.0, 2: 1.62, 3: 2.41, 4: 3.33, 8: 5.98}
    n = np.arange(1, GAMMA_MAX + 2)
    known = sorted(pts)
    r = np.interp(n, known, [pts[k] for k in known])
    r[-1] = pts[8] + (pts[8] - pts[4]) / 4          # n = 9: the slope of 4..8
    return [float(x) for x in r]


CURVES = {
    "agx-orin": {"ratios": _grow([1.0, 0.99, 0.98, 0.97], 0.03), "draft": DRAFT_BYTES_RATIO,
                 "source": "published T(4)/T(1) = 0.97 (llama.cpp #28285, MMQ, AGX Orin); n > 4 assumed +3%/position"},
    "orin-nano": {"ratios": _grow([1.0, 1.0, 1.0, 1.0], 0.04), "draft": DRAFT_BYTES_RATIO,
                  "source": "estimate (no published curve): flat to n = 4, +4%/position after"},
    "orin-nano-pessimistic": {"ratios": _grow([1.0], 0.05), "draft": 0.65,
                              "source": "sensitivity: +5%/position from n = 2, drafter step 0.65 T(1)"},
    "zen3-cpu": {"ratios": _zen3(), "draft": 0.31,
                 "source": "measured on the 2-core Zen 3 CPU (docs/speculative.md): the model's check"},
}


def per_position(mean_of_3: float) -> float:
    """a with a + a^2 + a^3 = mean (drafts accepted of 3, each position accepted only after the ones before)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if mid + mid ** 2 + mid ** 3 < mean_of_3:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def tuner_with(curve: CostCurve, alphas: list[float]) -> GammaTuner:
    """A GammaTuner whose acceptance posterior per class is the given rate (as after N_OBSERVED cycles of
    each) and whose drafter always supplies what it is asked for."""
    t = GammaTuner(curve, gamma_max=GAMMA_MAX, n_classes=len(alphas))
    for c, a in enumerate(alphas):
        t._seen[c, :] = N_OBSERVED
        t._acc[c, :] = a * N_OBSERVED
        t._asked[c, :] = N_OBSERVED
        t._got[c, :] = N_OBSERVED
    t._tv_cache = None
    return t


def predict(ratios: list[float], draft_ratio: float, workload: list[tuple[float, int]]) -> dict:
    """The tuner's gamma and predicted speed-up per class, and over the workload's mix of classes."""
    t1 = 1.0                                        # seconds are relative: T(1) = 1
    curve = CostCurve(t_verify=tuple(r * t1 for r in ratios[:GAMMA_MAX + 1]), t_draft=draft_ratio * t1,
                      source="predicted")
    alphas = [per_position(m) for m, _ in workload]
    tuner = tuner_with(curve, alphas)
    classes, tok_sum, cost_sum, cycles = [], 0.0, 0.0, sum(n for _, n in workload)
    for c, (alpha, (_, n)) in enumerate(zip(alphas, workload)):
        tokens, cost = tuner._cycle(c)
        rates = tokens / cost
        g = int(np.argmax(rates))
        classes.append({"class": CLASSES[c], "alpha": round(alpha, 3), "gamma": g,
                        "speedup": round(float(rates[g] / rates[0]), 3), "share": round(n / cycles, 3)})
        tok_sum += n / cycles * tokens[g]
        cost_sum += n / cycles * cost[g]
    return {"classes": classes, "speedup": round(float(tok_sum / cost_sum * t1), 3)}


def curve_from_file(path: str) -> dict:
    d = json.loads(Path(path).read_text())
    ratios = list(d["ratios"])
    while len(ratios) < GAMMA_MAX + 1:
        ratios.append(ratios[-1] + (ratios[-1] - ratios[-2]))
    return {"ratios": ratios, "draft": d.get("draft_step_over_target_t1", DRAFT_BYTES_RATIO),
            "source": f"measured: {path}" + (" (random weights of the pair's shapes)" if "note" in d else "")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="PREDICTED gamma and speed-up of the Qwen pair on GPU boards.")
    ap.add_argument("--curve", action="append", default=[], help="a bench/gpu_curve.py JSON (measured curve)")
    ap.add_argument("--out", default="bench/results/predict_gpu.json")
    a = ap.parse_args(argv)
    curves = dict(CURVES)
    for p in a.curve:
        curves[Path(p).stem] = curve_from_file(p)
    doc = {"what": "PREDICTION of edgerun's gamma tuner (edgerun/speculative/gamma.py), not a measurement",
           "acceptance_source": ACCEPTANCE_SOURCE, "gamma_max": GAMMA_MAX, "curves": {}}
    print("PREDICTED (the tuner's cost model fed a curve + CPU-measured acceptance; not measured on a GPU)\n")
    print("| curve | T(2)/T(1) | T(4)/T(1) | T(9)/T(1) | drafter step / T(1) | workload | gamma per margin class "
          "(<1, 1-3, 3-6, >6) | predicted speed-up over plain |")
    print("|---|---|---|---|---|---|---|---|")
    for name, c in curves.items():
        entry = {**c, "workloads": {}}
        for w, table in MARGIN_TABLE.items():
            for dr in sorted({c["draft"]}):
                p = predict(c["ratios"], dr, table)
                entry["workloads"][w] = p
                print(f"| {name} | {c['ratios'][1]:.2f} | {c['ratios'][3]:.2f} | {c['ratios'][8]:.2f} | {dr:.2f} | {w} | "
                      f"{', '.join(str(k['gamma']) for k in p['classes'])} | **{p['speedup']:.2f}×** |")
        doc["curves"][name] = entry
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\nacceptance: {ACCEPTANCE_SOURCE}\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
