"""Perplexity of a GGUF model on a text through the llama.cpp backend, scored as `llama-perplexity`.

Method (the same as llama.cpp's `llama-perplexity`, so the figures are comparable):
the whole text is tokenized once (with BOS first if the model adds one); it is cut into
non-overlapping windows of `ctx` tokens (a trailing partial window is dropped); each window is
evaluated from an empty cache, with its first token replaced by BOS when the model adds one; only
the second half of each window is scored: the logits at positions ctx/2 .. ctx-2 predict tokens
ctx/2+1 .. ctx-1 (ctx/2 - 1 predictions per window, each with at least ctx/2 tokens of context).
PPL = exp(mean negative log-likelihood over all scored tokens).
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..backends import open_backend
from ..config import BackendArgs
from ..errors import InvalidArgument

log = logging.getLogger(__name__)

METHOD = ("llama-perplexity: non-overlapping windows of ctx tokens, BOS first if the model adds one, "
          "second half of each window scored")


@dataclass(frozen=True)
class PerplexityResult:
    model: str
    text: str
    ctx: int
    ppl: float
    nll: float               # mean negative log-likelihood (nats per token)
    nll_stderr: float        # standard error of the mean
    n_windows: int
    n_scored: int
    n_text_tokens: int
    seconds: float
    method: str = METHOD
    window_nll: tuple[float, ...] = ()   # mean NLL of each window's scored tokens (for paired comparisons)
    tokens_sha256: str = ""              # sha256 of the windows' token ids (int64): equal = same windows

    def to_dict(self) -> dict:
        return asdict(self)


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float]:
    """PPL(a) / PPL(b) with a ~95% interval, from two models' `window_nll` on the same windows.

    Both must have scored the same text with the same ctx and windows. The interval is
    exp(mean(d) +- t * se(d)) over the per-window NLL differences d (the windows, not the tokens,
    are taken as independent: tokens of one window share their context), t from Student's t with
    n_windows - 1 degrees of freedom. Paired, it resolves differences far below each model's own
    standard error, because both models meet the same hard and easy tokens.
    """
    wa, wb = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if wa.shape != wb.shape or wa.size < 2:
        raise InvalidArgument(f"paired comparison needs the same windows (>= 2) in both results, got "
                              f"{wa.size} and {wb.size}")
    d = wa - wb
    se = float(d.std(ddof=1) / math.sqrt(d.size))
    t = t975(d.size - 1)
    m = float(d.mean())
    return math.exp(m), math.exp(m - t * se), math.exp(m + t * se)


def compare(a: PerplexityResult, b: PerplexityResult) -> tuple[float, float, float]:
    """`paired_ratio` of two results, after checking that they scored the very same windows.

    Models whose tokenizers split the text differently score different tokens; their perplexities
    are not comparable token for token, so this refuses them rather than pair unrelated windows.
    """
    if a.ctx != b.ctx or a.n_windows != b.n_windows:
        raise InvalidArgument(f"paired comparison needs the same windows: {a.model} has {a.n_windows} x ctx {a.ctx}, "
                              f"{b.model} has {b.n_windows} x ctx {b.ctx}")
    if a.tokens_sha256 != b.tokens_sha256:
        raise InvalidArgument(f"{a.model} and {b.model} tokenize the text differently ({a.n_text_tokens} vs "
                              f"{b.n_text_tokens} tokens, different token ids); a paired comparison needs "
                              "models with the same tokenizer")
    return paired_ratio(a.window_nll, b.window_nll)


def t975(dof: int) -> float:
    """Student's t 97.5% quantile (two-sided 95%): the table to 30 degrees of freedom, then the
    Cornish-Fisher expansion around the normal quantile (within 1e-3 of the exact value there)."""
    if dof < 1:
        raise InvalidArgument(f"degrees of freedom must be >= 1, got {dof}")
    if dof in _T975:
        return _T975[dof]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * dof) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * dof ** 2)


# Student's t 97.5% quantiles for 1..30 degrees of freedom (two-sided 95% intervals).
_T975 = dict(enumerate((12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
                        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
                        2.060, 2.056, 2.052, 2.048, 2.045, 2.042), start=1))


def _log_softmax_at(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """log p(target) per row: logits [k, V] float32, targets [k] -> [k] float64."""
    z = logits.astype(np.float64)
    m = z.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(z - m).sum(axis=1))
    return z[np.arange(len(targets)), targets] - lse


def perplexity(model: str | Path, text: str, *, ctx: int = 512, n_threads: int | None = None,
               max_windows: int | None = None, text_name: str = "",
               progress: Callable[[str, int, int], None] | None = None) -> PerplexityResult:
    """Perplexity of the GGUF (or ONNX directory) at `model` on `text` (see the module docstring for the method)."""
    if not isinstance(ctx, int) or ctx < 16 or ctx % 2:
        raise InvalidArgument(f"ctx must be an even integer >= 16, got {ctx!r}")
    t0 = time.perf_counter()
    be = open_backend(model, BackendArgs(n_ctx=ctx, n_batch=ctx, n_threads=n_threads, flash_attn=True))
    try:
        tok = be.tokenizer
        add_bos = bool(tok.add_bos) and tok.bos_id >= 0
        tokens = tok.tokenize(text, special=False, add_bos=add_bos)
        n_windows = len(tokens) // ctx
        if max_windows is not None:
            n_windows = min(n_windows, max_windows)
        if n_windows < 1:
            raise InvalidArgument(f"the text has {len(tokens)} tokens; expected at least ctx = {ctx} "
                                  "for one perplexity window")
        first = ctx // 2
        windows = np.asarray(tokens[:n_windows * ctx], dtype=np.int64).reshape(n_windows, ctx)
        if add_bos:
            windows[:, 0] = tok.bos_id
        nll = []
        for w, window in enumerate(windows):
            be.truncate(0)
            logits = be.eval(window.tolist(), n_logits=ctx - first)   # positions first .. ctx-1
            targets = window[first + 1:]                              # [ctx - first - 1]
            nll.append(-_log_softmax_at(logits[:-1], targets))
            if progress is not None:
                progress("perplexity", w + 1, n_windows)
        all_nll = np.concatenate(nll)
        mean = float(all_nll.mean())
        se = float(all_nll.std(ddof=1) / math.sqrt(len(all_nll))) if len(all_nll) > 1 else 0.0
        return PerplexityResult(model=Path(model).name, text=text_name, ctx=ctx, ppl=math.exp(mean), nll=mean,
                                nll_stderr=se, n_windows=n_windows, n_scored=int(all_nll.size),
                                n_text_tokens=len(tokens), seconds=time.perf_counter() - t0,
                                window_nll=tuple(float(v.mean()) for v in nll),
                                tokens_sha256=hashlib.sha256(windows.tobytes()).hexdigest())
    finally:
        be.close()
