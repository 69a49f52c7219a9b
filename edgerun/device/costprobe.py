"""Backend cost probe: time one target eval of n tokens (n = 1..16) and one drafter step, on the
loaded backends, rolling the cache back between evals. Results are cached per device + model file
hash + engine settings in $EDGERUN_HOME/probes/ and reused on the next load.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from ..config import SamplingArgs
from ..errors import EdgerunError
from .cost import N_MAX, CostCurve
from .measurements import atomic_write_json, device_identity, file_sha256, key_of, probes_dir, read_json

log = logging.getLogger(__name__)

# a target step slower than this against the cached curve: the drafter's probe beside it ran contended.
# Measured: five servers started together on a 2-core Zen 3 cached a 0.5B drafter's step at 63 ms, twice its
# 31 ms alone, and the tuner, believing the drafter as dear as the 1.5B target, never drafted
CONTENDED_RATIO = 1.3

_TEXT = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
         "    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
         "The quick brown fox jumps over the lazy dog while the compiler checks every line. ")


def _probe_tokens(backend, n: int) -> list[int]:
    """n ordinary tokens of a fixed text (token ids of arbitrary rank if there is no tokenizer)."""
    toks: list[int] = []
    tok = getattr(backend, "tokenizer", None)
    if tok is not None:
        toks = [t for t in tok.tokenize(_TEXT, special=False, add_bos=False) if 0 <= t < backend.n_vocab]
    if not toks:
        toks = list(range(min(100, backend.n_vocab - 1), min(100, backend.n_vocab - 1) + 32))
    return [toks[i % len(toks)] for i in range(n)]


def _settings(backend) -> dict:
    return {k: getattr(backend, k, None) for k in ("n_threads", "n_gpu_layers", "flash_attn", "n_batch", "name")}


def _busy() -> bool:
    """Other work is competing for the CPU right now: a measurement then is not worth caching."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return False
    return load > (os.cpu_count() or 1) + 0.5


def _engine_version() -> str:
    try:
        import llama_cpp
        return str(getattr(llama_cpp, "__version__", "?"))
    except ImportError:
        return "none"


def measure_verify_curve(target, *, n_max: int = N_MAX, reps: int = 3, context: int = 64) -> list[float]:
    """Fastest seconds (of `reps`) of target.eval(n tokens, logits for all n) after `context` cached tokens,
    n = 1..n_max (other work only ever adds time; the tuner's load factor follows the machine's current speed).

    The n values are interleaved within each repetition so that machine load affects all alike.
    The target's cache is left empty.
    """
    return [float(x) for x in measure_verify_times(target, n_max=n_max, reps=reps, context=context).min(axis=0)]


def unsteady(times: np.ndarray, spread: float = 1.5) -> bool:
    """Repetitions [reps, n] that disagree by more than `spread` at some n: the machine was contended
    (a 2-thread llama.cpp whose second core is taken runs 10x slower), so the curve is cached as provisional
    only. With 3 or more repetitions the first is left out of the comparison: it is the first evaluation of most
    batch sizes (the warm-up runs 1 and n_max only), whose buffers llama.cpp sizes then, slower on any machine."""
    times = np.asarray(times)
    if times.shape[0] >= 3:
        times = times[1:]
    return times.shape[0] > 1 and bool((times.max(axis=0) > spread * times.min(axis=0)).any())


def measure_verify_times(target, *, n_max: int = N_MAX, reps: int = 3, context: int = 64) -> np.ndarray:
    """Seconds of each repetition: [reps, n_max] (see measure_verify_curve)."""
    context = max(1, min(context, target.n_ctx - n_max - 1))
    seq = _probe_tokens(target, context + n_max)
    target.truncate(0)
    target.eval(seq[:context], n_logits=0)
    for n in (1, n_max):                     # warm-up (caches, repacked weights): not timed
        target.eval(seq[context:context + n])
        target.truncate(context)
    points = probe_points(n_max)
    times = np.zeros((reps, len(points)))    # times [rep, point]
    for r in range(reps):
        for i, n in enumerate(points):
            t0 = time.perf_counter()
            target.eval(seq[context:context + n])
            times[r, i] = time.perf_counter() - t0
            target.truncate(context)
    target.truncate(0)
    if len(points) == n_max:
        return times
    return np.stack([np.interp(np.arange(1, n_max + 1), points, row) for row in times])   # [reps, n_max]


DENSE = 10      # the probe times every n up to this; past it every STRIDE-th up to FAR, then every FAR_STRIDE-th
STRIDE = 4
FAR, FAR_STRIDE = 32, 16


def probe_points(n_max: int) -> list[int]:
    """The n the probe times: 1..DENSE, then every STRIDE-th up to FAR, every FAR_STRIDE-th past it, and n_max
    (interpolated between): long drafts (suffix lookup's, up to SpeculativeArgs.free_gamma_max) need the curve far
    out, where it is smooth, and timing every n there would add seconds to a first start."""
    pts = list(range(1, min(n_max, DENSE) + 1))
    pts += list(range(DENSE + STRIDE // 2, min(n_max, FAR + 1), STRIDE))
    pts += list(range(FAR + FAR_STRIDE, n_max - FAR_STRIDE // 2, FAR_STRIDE))
    if n_max > DENSE and pts[-1] != n_max:
        pts.append(n_max)
    return pts


def measure_draft_step(drafter, target, *, gamma: int = 4, reps: int = 5, context: int = 64) -> float:
    """Fastest seconds per drafted token of drafter.propose(context, gamma) (greedy), after a warm-up
    call; each call rolls the drafter back to the context and evaluates the last context token again,
    as the decode loop's catch-up does."""
    ctx = _probe_tokens(target, context)
    sampling = SamplingArgs(temperature=0.0)
    rng = np.random.default_rng(0)
    drafter.propose(ctx, gamma, sampling, rng)
    per_token = []
    for _ in range(reps):
        t0 = time.perf_counter()
        toks, _q = drafter.propose(ctx, gamma, sampling, rng)
        per_token.append((time.perf_counter() - t0) / max(len(toks), 1))
    be = getattr(drafter, "backend", None)
    if be is not None:
        be.truncate(0)
    return float(np.min(per_token))           # noise only adds time: the fastest call


def target_step_now(target, *, reps: int = 3) -> float:
    """Fastest seconds of a one-token target step now (the curve's first point, measured again).

    Set beside the cost curve it tells whether a measurement just made ran on a contended machine: a
    probe that ran while another process held the cores (servers started together, each probing) is
    slow throughout, so its repetitions agree with each other, but not with the curve measured quietly."""
    return measure_verify_curve(target, n_max=1, reps=reps)[0]


def _model_id(backend) -> str | None:
    """Content hash of the backend's model file (a directory model is identified by its path)."""
    path = getattr(backend, "path", None)
    if path is None:
        return None
    p = Path(path)
    try:
        return f"dir:{p.resolve()}" if p.is_dir() else file_sha256(p)
    except OSError:
        return None


def target_key(target) -> str | None:
    mid = _model_id(target)
    return None if mid is None else key_of("target", device_identity(), mid, _settings(target), _engine_version())


def drafter_key(drafter, target) -> str | None:
    be = getattr(drafter, "backend", None)
    if be is None:
        return key_of("drafter", device_identity(), getattr(drafter, "name", "?"), target.n_vocab)
    mid = _model_id(be)
    return None if mid is None else key_of("drafter", device_identity(), mid, _settings(be), _engine_version(),
                                           target.n_vocab)


def _cached(doc, ok) -> bool:
    """Whether a cached probe result serves: it fits (ok), and it was measured on a quiet machine, or it is
    provisional (measured on a busy one) and the machine is busy now too, so a new measurement would be no better."""
    return bool(doc) and ok(doc) and (not doc.get("provisional") or _busy())


def _keep(path, doc: dict, contended: bool, old, merge: str) -> dict:
    """Cache a probe result. Measured on a contended machine it is kept as provisional: used while the machine
    stays busy (every start of a service on a loaded board would otherwise pay the probe again, and a drafter
    whose tuner state says it will not draft would still be loaded: speculative/lazy.py needs its step time),
    and measured again at the first start on a quiet machine. Noise only adds time: a provisional figure is the
    least of the provisional measurements so far."""
    if contended:
        prev = old.get(merge) if isinstance(old, dict) and old.get("provisional") else None
        if isinstance(prev, list) and len(prev) >= len(doc[merge]):
            doc[merge] = [min(float(a), float(b)) for a, b in zip(doc[merge], prev)]
        elif isinstance(prev, (int, float)):
            doc[merge] = min(float(doc[merge]), float(prev))
        doc["provisional"] = True
    atomic_write_json(path, doc)
    return doc


def probe_costs(target, drafter=None, *, use_cache: bool = True, n_max: int = N_MAX, reps: int = 3) -> CostCurve:
    """Measured cost curve for the loaded target (+ drafter), from the cache when it has it
    (a cached curve longer than n_max serves too)."""
    tkey = target_key(target)
    tpath = probes_dir() / f"verify-{tkey}.json" if tkey else None
    doc = read_json(tpath) if (use_cache and tpath) else None
    if _cached(doc, lambda d: len(d.get("t_verify", [])) >= n_max):
        tv = [float(x) for x in doc["t_verify"][:n_max]]
    else:
        log.info("measuring the target's verify cost curve (n = 1..%d); cached for next time", n_max)
        times = measure_verify_times(target, n_max=n_max, reps=reps)
        tv = [float(x) for x in times.min(axis=0)]     # noise only adds time: the fastest repetition
        contended = _busy() or unsteady(times)
        if contended:
            log.warning("the machine was busy (load average %.1f; repetitions %s) while measuring the cost curve: "
                        "cached as provisional, measured again at a start on a quiet machine; the gamma tuner "
                        "corrects the costs online", os.getloadavg()[0], "disagreed" if unsteady(times) else "agreed")
        if tpath:
            tv = _keep(tpath, {"t_verify": tv, "model": getattr(target, "name", "?"), "settings": _settings(target),
                               "device": device_identity()}, contended, doc, "t_verify")["t_verify"][:n_max]
    td = 0.0
    if drafter is not None:
        dkey = drafter_key(drafter, target)
        dpath = probes_dir() / f"draft-{dkey}.json" if dkey else None
        ddoc = read_json(dpath) if (use_cache and dpath) else None
        if _cached(ddoc, lambda d: isinstance(d.get("t_draft"), (int, float))):
            td = float(ddoc["t_draft"])
        else:
            td = measure_draft_step(drafter, target)
            now = target_step_now(target)
            contended = now > CONTENDED_RATIO * tv[0] or _busy()
            if contended:
                log.warning("the target's step took %.1f ms right after the drafter's probe, %.1fx the curve's %.1f ms "
                            "(load average %.1f): the drafter's cost is cached as provisional (the gamma tuner corrects "
                            "it online)", now * 1e3, now / tv[0], tv[0] * 1e3, os.getloadavg()[0])
            if dpath:
                td = _keep(dpath, {"t_draft": td, "drafter": getattr(drafter, "name", "?"), "device": device_identity()},
                           contended, ddoc, "t_draft")["t_draft"]
    return CostCurve(t_verify=tuple(tv), t_draft=td, source="measured")


def roofline_for(target, drafter, profile, bandwidth_gbs: float | None = None) -> CostCurve:
    """Predicted curve from weight bytes / bandwidth and FLOPs / peak compute (profile priors)."""
    pri = profile.priors
    bw = bandwidth_gbs or pri.bandwidth_gbs or 20.0
    peak = pri.peak_gflops or 100.0
    be = getattr(drafter, "backend", None)
    return CostCurve.roofline(
        target_bytes=int(target.weight_bytes), target_params=getattr(target, "n_params", None),
        draft_bytes=int(be.weight_bytes) if be is not None else None,
        draft_params=getattr(be, "n_params", None) if be is not None else None,
        lookup=drafter is not None and be is None, bandwidth_gbs=bw, peak_gflops=peak)


def cost_curve_for(target, drafter, profile, *, measure: bool = True, n_max: int = N_MAX) -> CostCurve:
    """The curve the tuner starts from: measured (cached) if allowed, else the roofline prior
    with the cached measured bandwidth when there is one."""
    if measure:
        try:
            return probe_costs(target, drafter, n_max=n_max)
        except (EdgerunError, OSError) as e:   # a failed probe must not stop generation: roofline instead
            log.warning("cost probe failed (%s: %s); using the roofline prior", type(e).__name__, e)
    from .bandwidth import cached_bandwidth

    bw = cached_bandwidth(profile.priors.compute if profile is not None else "cpu") if profile is not None else None
    if profile is None:
        from .detect import detect
        profile = detect()[0]
    return roofline_for(target, drafter, profile, bandwidth_gbs=bw.best_gbs if bw else None)


def verify_ratios(curve: CostCurve, points: Sequence[int] = (2, 4, 8, 16)) -> dict[int, float]:
    r = curve.ratios()
    return {n: r[n - 1] for n in points if n <= len(r)}
