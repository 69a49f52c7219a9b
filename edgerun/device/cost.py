"""CostCurve: what one speculative cycle costs on this device, measured or predicted by a roofline.

t_verify[n-1] is the time of one target eval of n tokens with logits for all n positions (the
verification of n-1 drafted tokens plus the pending one); t_draft is the time of one drafter
step. The curve is never assumed flat: on a CPU, T(8) is several times T(1).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import InvalidArgument

N_MAX = 16                 # the probe measures n = 1..N_MAX; beyond it the curve is extrapolated
EVAL_OVERHEAD_S = 3e-4     # roofline: fixed cost of one eval call (graph build, Python, launch)
LOOKUP_STEP_S = 3e-5       # roofline: one prompt-lookup proposal (numpy n-gram search)


@dataclass(frozen=True)
class CostCurve:
    t_verify: tuple[float, ...]      # seconds, n = 1..len(t_verify)
    t_draft: float                   # seconds per drafted token (0: no drafter)
    source: str = "measured"         # measured | roofline

    def __post_init__(self) -> None:
        if not self.t_verify or any(not (t > 0) for t in self.t_verify):
            raise InvalidArgument(f"t_verify must be a non-empty list of positive seconds, got {self.t_verify!r}")
        if not self.t_draft >= 0:
            raise InvalidArgument(f"t_draft must be >= 0 seconds, got {self.t_draft!r}")

    def verify(self, n: int) -> float:
        """Seconds for one target eval of n >= 1 tokens (linear extrapolation past the table)."""
        if n < 1:
            raise InvalidArgument(f"a target eval has at least one token, got n={n}")
        t = self.t_verify
        if n <= len(t):
            return t[n - 1]
        slope = max(t[-1] - t[-2], 0.0) if len(t) >= 2 else t[0]
        return t[-1] + slope * (n - len(t))

    def ratios(self) -> list[float]:
        """T(n)/T(1) for n = 1..len: how much more verifying n positions costs than decoding one."""
        return [t / self.t_verify[0] for t in self.t_verify]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CostCurve":
        return cls(t_verify=tuple(float(x) for x in d["t_verify"]), t_draft=float(d["t_draft"]),
                   source=str(d.get("source", "measured")))

    @classmethod
    def roofline(cls, *, target_bytes: int, bandwidth_gbs: float, peak_gflops: float,
                 target_params: int | None = None, draft_bytes: int | None = None, draft_params: int | None = None,
                 lookup: bool = False, n_max: int = N_MAX, overhead_s: float = EVAL_OVERHEAD_S) -> "CostCurve":
        """Predict the curve before measuring: an eval of n tokens reads every weight once (bytes /
        bandwidth) and does 2 x params x n FLOPs (/ peak compute); it takes the larger of the two.

        params default to bytes x 2 (about 4.5 bits per weight). draft_bytes None and lookup False:
        no drafter (t_draft 0); lookup True: the model-free drafter's small constant step.
        """
        if bandwidth_gbs <= 0 or peak_gflops <= 0:
            raise InvalidArgument(f"bandwidth and peak compute must be > 0, got {bandwidth_gbs}, {peak_gflops}")

        def t_eval(nbytes: int, params: int | None, n: int) -> float:
            params = params or 2 * nbytes
            return max(nbytes / (bandwidth_gbs * 1e9), 2.0 * params * n / (peak_gflops * 1e9)) + overhead_s

        tv = tuple(t_eval(target_bytes, target_params, n) for n in range(1, n_max + 1))
        if draft_bytes:
            td = t_eval(draft_bytes, draft_params, 1)
        else:
            td = LOOKUP_STEP_S if lookup else 0.0
        return cls(t_verify=tv, t_draft=td, source="roofline")
