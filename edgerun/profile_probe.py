"""What `edgerun profile probe` measures: memory bandwidth, and the cost curve of a model pair.

Returns plain dicts (the CLI prints them as a table or JSON). Both results are cached. It loads models,
so it sits above device/ (which backends use) beside its caller, not inside it.
"""

from __future__ import annotations

import logging

from .backends import open_backend
from .config import SpeculativeArgs
from .device import bandwidth as B
from .device.costprobe import probe_costs, verify_ratios
from .device.profiles import DeviceProfile
from .resolve import resolve_model
from .speculative.drafters import make_drafter

log = logging.getLogger(__name__)


def bandwidth_report(profile: DeviceProfile, *, array_bytes: int | None = None, threads: int | None = None,
                     reps: int = 5, rounds: int = 3) -> dict:
    """CPU bandwidth (C kernel or numpy) with the independent numpy check, plus the GPU variant on
    CUDA/Metal profiles; each figure also as a fraction of the profile's datasheet bandwidth."""
    out: dict = {"profile": profile.name, "datasheet_gbs": profile.priors.bandwidth_gbs, "results": []}
    cpu = B.measure_and_cache("cpu", array_bytes=array_bytes, threads=threads, reps=reps, rounds=rounds)
    out["results"].append({"where": "cpu", **cpu.to_dict()})
    if profile.priors.compute in ("cuda", "metal"):
        gpu = B.measure_and_cache(profile.priors.compute, array_bytes=array_bytes, reps=reps)
        if gpu.method == profile.priors.compute:
            out["results"].append({"where": profile.priors.compute, **gpu.to_dict()})
    ds = profile.priors.bandwidth_gbs
    for r in out["results"]:
        r["fraction_of_datasheet"] = (max(r["copy_gbs"], r["triad_gbs"]) / ds) if ds else None
    return out


def cost_report(profile: DeviceProfile, model: str, draft: str | None = None, *, remeasure: bool = False,
                pull: bool = True, n_ctx: int = 512) -> dict:
    """Load the target (+ drafter) with the profile's settings and measure (or read) the cost curve."""
    args = profile.backend_args(n_ctx=n_ctx)
    target = open_backend(resolve_model(model, pull=pull), args)
    try:
        drafter = make_drafter(draft, target, backend_args=args, spec_args=SpeculativeArgs(), pull=pull)
        try:
            curve = probe_costs(target, drafter, use_cache=not remeasure)
        finally:
            if drafter is not None:
                drafter.close()
    finally:
        target.close()
    return {"model": model, "draft": draft, "t_verify_s": list(curve.t_verify), "ratios": curve.ratios(),
            "ratios_at": verify_ratios(curve), "t_draft_s": curve.t_draft,
            "draft_vs_target": curve.t_draft / curve.t_verify[0] if draft else None}
