"""How an imported INT4 weight is stored in GGUF, keeping the published codes and scales.

Blocks of 32 along K (a group of g = 128 is four blocks sharing one (s, z)):

- symmetric (z = 8 everywhere) -> Q4_0: d = s, codes q. Bit-exact when s is an fp16 value.
- asymmetric -> Q4_1: value q*d + m. Per block, of d = s, m = -z*s (codes q) and the mirrored
  d = -s, m = (15 - z)*s (codes 15 - q), the one whose fp16 m is exact (else the closer one);
  AutoAWQ GEMV_fast's own fp16 offset is stored as it is (its kernel computes q*s + m).
- `exact` -> Q5_0 for asymmetric tensors: d = s, codes q - z + 16; bit-exact for every z
  (GEMV_fast stays Q4_1, which is already exact for it).
- A tensor whose groups are not blockwise (GPTQ act-order) or whose group is not a multiple of 32
  -> F16 of its dequantized values (logged with the tensor's name).

Each stored tensor comes with a `StoreStat`: blocks, bit-exact blocks, max |dw| / s, measured by
dequantizing the written blocks with `gguf.quants` (llama.cpp's reference).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import gguf
import numpy as np

from ..quant.blocks import QK, encode_codes
from .unpack import Int4

log = logging.getLogger(__name__)


@dataclass
class StoreStat:
    name: str
    stored: str              # "q4_0" | "q4_1" | "q5_0" | "f16" | "f32"
    n_blocks: int = 0
    n_exact: int = 0
    max_rel_err: float = 0.0  # max |dw| / s over the tensor
    note: str = ""

    @property
    def exact_share(self) -> float:
        return 1.0 if self.n_blocks == 0 else self.n_exact / self.n_blocks


def _per_block(a: np.ndarray, g: int) -> np.ndarray:
    """[N, G] per group -> [N, K/32] per block of 32 (g = k * 32)."""
    return np.repeat(a, g // QK, axis=1)


def choose_type(w: Int4, exact: bool) -> str:
    if not w.blockwise or w.g % QK:
        return "f16"
    if w.m is not None:
        return "q4_1"             # GEMV_fast: d = s, m = its fp16 offset is exactly what its kernel computes
    if w.symmetric:
        return "q4_0"
    return "q5_0" if exact else "q4_1"


def store(name: str, w: Int4, exact: bool) -> tuple[str, np.ndarray, StoreStat]:
    """(type, raw array for the GGUF writer, stats) of one INT4 weight [N, K] in GGUF layout."""
    fmt = choose_type(w, exact)
    ref = w.dequantize().astype(np.float64)                                   # [N, K] what the checkpoint means
    if fmt == "f16":
        why = "act-order groups (not blockwise)" if not w.blockwise else f"group size {w.g} not a multiple of {QK}"
        log.info("%s: stored as F16 (%s)", name, why)
        raw = ref.astype(np.float16)
        stat = StoreStat(name, "f16", note=why)
        dec = raw.astype(np.float64)
    else:
        s = _per_block(w.s, w.g)                                              # [N, nb]
        z = _per_block(w.z, w.g).astype(np.int32)
        qb = w.q.reshape(w.q.shape[0], -1, QK)                                # [N, nb, 32]
        if fmt == "q4_0":
            raw = encode_codes("q4_0", w.q, s.astype(np.float16))
        elif fmt == "q5_0":
            codes = (qb.astype(np.int32) - z[..., None] + 16).astype(np.uint8).reshape(w.q.shape)
            raw = encode_codes("q5_0", codes, s.astype(np.float16))
        else:
            if w.m is not None:                                               # GEMV_fast: its own fp16 offset
                d, m, codes = s, _per_block(w.m, w.g), qb
            else:
                m_a = -z * s                                                  # d = s, codes q
                m_b = (15 - z) * s                                            # d = -s, codes 15 - q
                err_a = np.abs(m_a.astype(np.float16).astype(np.float64) - m_a)
                err_b = np.abs(m_b.astype(np.float16).astype(np.float64) - m_b)
                use_b = (err_b < err_a)[..., None]                            # [N, nb, 1]
                d = np.where(use_b[..., 0], -s, s)
                m = np.where(use_b[..., 0], m_b, m_a)
                codes = np.where(use_b, 15 - qb, qb).astype(np.uint8)
            raw = encode_codes("q4_1", codes.reshape(w.q.shape), d.astype(np.float16), m.astype(np.float16))
        qtype = getattr(gguf.GGMLQuantizationType, fmt.upper())
        dec = gguf.quants.dequantize(raw, qtype).astype(np.float64).reshape(w.q.shape)
        stat = StoreStat(name, fmt)
    # exactness per block of 32 (F16 too: blocks whose fp16 values equal the checkpoint's)
    diff = np.abs(dec - ref).reshape(ref.shape[0], -1, QK)                     # [N, nb, 32]
    sb = np.abs(_per_block(w.s, w.g) if w.blockwise and w.g % QK == 0 else
                w.s[:, (w.g_idx if w.g_idx is not None else np.arange(ref.shape[1]) // w.g)]
                .reshape(ref.shape[0], -1, QK).max(axis=-1))
    stat.n_blocks = int(diff.shape[0] * diff.shape[1])
    stat.n_exact = int((diff.max(axis=-1) == 0).sum())
    stat.max_rel_err = float((diff.max(axis=-1) / sb).max())
    return fmt, raw, stat
