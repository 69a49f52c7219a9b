"""Small frozen dataclasses holding the knobs of sampling, speculation, backends and quantization."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from .errors import InvalidArgument

DEFAULT_MODEL = "smollm2-135m-instruct"   # what `edgerun chat` and edgerun.load() run when no model is named
FIXED_GAMMA = 4   # the draft length of a Runtime built with a drafter but neither a gamma nor a tuner
GAMMA_LIMIT = 64  # drafting more than this per cycle is refused (a verbatim copy's long drafts reach free_gamma_max)
MAX_TEMPERATURE = 100.0   # above this every token is equally likely to float precision: refused as a mistake
MIN_TEMPERATURE = 1e-3    # below this, logits / T overflow float64 for ordinary logits: sampled as greedy
REPEAT_PENALTY_RANGE = (1e-3, 1e3)   # outside, logits x penalty overflow or vanish
THREADS_PER_CPU = 4       # n_threads above this many per logical CPU is refused (llama.cpp crashes far above)


def _check(cond: bool, msg: str, param: str | None = None) -> None:
    if not cond:
        raise InvalidArgument(msg, param=param)


@dataclass(frozen=True)
class SamplingArgs:
    """How logits become a next-token distribution. temperature 0 means greedy (argmax)."""

    temperature: float = 0.8
    top_k: int = 40            # 0 disables
    top_p: float = 0.95        # 1.0 disables
    min_p: float = 0.05        # 0.0 disables
    repeat_penalty: float = 1.0  # 1.0 disables
    repeat_last_n: int = 64
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        _check(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)
               and 0 <= t <= MAX_TEMPERATURE,
               f"temperature must be a number in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {t!r}", "temperature")
        _check(isinstance(self.top_k, int) and self.top_k >= 0,
               f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}", "top_k")
        p = self.top_p
        _check(isinstance(p, (int, float)) and 0 < p <= 1,
               f"top_p must be in (0, 1], got {p!r}", "top_p")
        _check(isinstance(self.min_p, (int, float)) and 0 <= self.min_p < 1,
               f"min_p must be in [0, 1), got {self.min_p!r}", "min_p")
        lo, hi = REPEAT_PENALTY_RANGE
        _check(isinstance(self.repeat_penalty, (int, float)) and lo <= self.repeat_penalty <= hi,
               f"repeat_penalty must be a number in [{lo:g}, {hi:g}] (1.0 disables it), got {self.repeat_penalty!r}", "repeat_penalty")
        _check(isinstance(self.repeat_last_n, int) and self.repeat_last_n >= 0,
               f"repeat_last_n must be an integer >= 0, got {self.repeat_last_n!r}", "repeat_last_n")
        _check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                     and 0 <= self.seed < 2 ** 63),
               f"seed must be an integer in 0..2^63-1 (or unset for a random one), got {self.seed!r}", "seed")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one so small (< MIN_TEMPERATURE) that sampling is argmax to float precision."""
        return self.temperature < MIN_TEMPERATURE


@dataclass(frozen=True)
class SpeculativeArgs:
    """Speculation settings. gamma None means 'auto' (the GammaTuner decides every cycle)."""

    gamma: int | None = None
    gamma_max: int = 8
    free_gamma_max: int = 48    # model-free drafts (suffix lookup's match classes) may be this long: a long verbatim
                                # match copies far, and verifying many positions in one call is cheap per position
                                # (docs/free_drafts.md: on a 2-core CPU 33 positions cost ~1.1x 25, 49 ~1.5x)
    p_min: float = 0.0          # drafter stops early when its top probability falls below this
    lookup_ngram_max: int = 3    # prompt-lookup drafter: longest n-gram matched
    lookup_ngram_min: int = 1

    def __post_init__(self) -> None:
        g = self.gamma
        _check(g is None or (isinstance(g, int) and 0 <= g <= GAMMA_LIMIT),
               f"gamma must be 'auto' or an integer in 0..{GAMMA_LIMIT}, got {g!r}", "gamma")
        _check(isinstance(self.gamma_max, int) and 1 <= self.gamma_max <= GAMMA_LIMIT,
               f"gamma_max must be an integer in 1..{GAMMA_LIMIT}, got {self.gamma_max!r}", "gamma_max")
        _check(isinstance(self.free_gamma_max, int) and 1 <= self.free_gamma_max <= GAMMA_LIMIT,
               f"free_gamma_max must be an integer in 1..{GAMMA_LIMIT}, got {self.free_gamma_max!r}", "free_gamma_max")
        _check(0.0 <= self.p_min < 1.0, f"p_min must be in [0, 1), got {self.p_min!r}", "p_min")

    def limits(self, profile, free: bool) -> tuple[int, int]:
        """(gamma_max, model_gamma_max) of a GammaTuner: the profile's and these settings' cap for a model's drafts;
        with model-free drafts on offer (suffix lookup) those may reach free_gamma_max (never less than a model's)."""
        gmax = min(self.gamma_max, profile.gamma_max) if profile is not None else self.gamma_max
        return (max(gmax, self.free_gamma_max) if free else gmax), gmax


def parse_gamma(gamma) -> int | None:
    """A gamma option (an integer, its text, 'auto' or None) -> None for 'auto', else a checked draft length."""
    if gamma is None or gamma == "auto":
        return None
    if isinstance(gamma, str):
        if not gamma.strip().lstrip("-").isdigit():
            raise InvalidArgument(f"gamma must be 'auto' or an integer, got {gamma!r}", param="gamma")
        gamma = int(gamma)
    SpeculativeArgs(gamma=gamma)          # checks the range
    return gamma


@dataclass(frozen=True)
class BackendArgs:
    """Engine settings; the device profile fills the defaults, the user may override."""

    n_ctx: int = 4096
    n_threads: int | None = None      # None: physical cores
    n_batch: int = 512
    n_seq: int = 1                    # sequences one context holds (continuous batching; llama.cpp only)
    n_gpu_layers: int = 0
    flash_attn: bool = True
    use_mmap: bool = True
    use_mlock: bool = False
    huge_pages: bool = True           # what a load adds (weights, KV) on transparent huge pages (util/hugepages.py)
    providers: tuple[str, ...] = ("CPUExecutionProvider",)   # onnxruntime execution providers

    def __post_init__(self) -> None:
        _check(isinstance(self.n_ctx, int) and self.n_ctx >= 16, f"n_ctx must be an integer >= 16, got {self.n_ctx!r}")
        cap = THREADS_PER_CPU * (os.cpu_count() or 1)
        _check(self.n_threads is None or (isinstance(self.n_threads, int) and 1 <= self.n_threads <= cap),
               f"n_threads must be an integer in 1..{cap} ({THREADS_PER_CPU} per logical CPU here), "
               f"got {self.n_threads!r}")
        _check(isinstance(self.n_batch, int) and self.n_batch >= 1, f"n_batch must be >= 1, got {self.n_batch!r}")
        _check(isinstance(self.n_seq, int) and 1 <= self.n_seq <= 64,
               f"n_seq (parallel sequences) must be an integer in 1..64, got {self.n_seq!r}")


@dataclass(frozen=True)
class QuantArgs:
    """Quantization settings for `edgerun quantize`."""

    method: str = "awq"             # awq | rtn
    format: str = "q4_0"            # q4_0 | q4_1 | iq4_nl | q4_k (rtn only)
    calib: str = "builtin"          # 'builtin' (CPython reference prose) or a text file path
    calib_tokens: int = 4096
    embed_type: str = "q8_0"        # q8_0 | q4_0 | iq4_nl | q4_k (4-bit head: fastest verification on CPUs) | f16
    grid: int = 20
    seq_len: int = 512
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(self.method in ("awq", "rtn"), f"method must be 'awq' or 'rtn', got {self.method!r}")
        _check(self.format in ("q4_0", "q4_1", "iq4_nl", "q4_k"),
               f"format must be 'q4_0', 'q4_1', 'iq4_nl' or 'q4_k', got {self.format!r}")
        _check(self.embed_type in ("q8_0", "q4_0", "iq4_nl", "q4_k", "f16"),
               f"embed_type must be 'q8_0', 'q4_0', 'iq4_nl', 'q4_k' or 'f16', got {self.embed_type!r}")
        _check(self.method == "rtn" or "q4_k" not in (self.format, self.embed_type),
               "q4_k is stored by round-to-nearest only (AWQ searches q4_0, q4_1 and iq4_nl): use method 'rtn'")
        _check(isinstance(self.calib_tokens, int) and self.calib_tokens >= 64,
               f"calib_tokens must be an integer >= 64, got {self.calib_tokens!r}")
        _check(isinstance(self.grid, int) and self.grid >= 1, f"grid must be >= 1, got {self.grid!r}")
