"""Weights for the ONNX graph: GGUF Q4_0/Q8_0 blocks as MatMulNBits (lossless), anything else requantized.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from ..formats.source import open_source
from ..formats.arch import ModelConfig
from ..formats.gguf import GGUFSource
from ..errors import ModelFormatError, ModelNotFound
from ..llama_lib import check_gguf
from ..quant.blocks import pack, q4_0_to_matmulnbits
from .layout import BLOCK


log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------- weights

@dataclass(frozen=True)
class NBits:
    """One linear weight in MatMulNBits layout: packed uint8 [N, K/block, block*bits/8], scales f32 [N, K/block],
    optional 4-bit zero points uint8 [N, ceil(K/block / 2)] (two per byte, low nibble first; None = implicit 2^(bits-1))."""

    bits: int
    packed: np.ndarray
    scales: np.ndarray
    note: str                          # "Q4_0->int4 (lossless)" etc.
    block: int = BLOCK
    zeros: np.ndarray | None = None

    @property
    def n(self) -> int:
        return self.packed.shape[0]

    @property
    def k(self) -> int:
        return self.packed.shape[1] * self.block

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes + (0 if self.zeros is None else self.zeros.nbytes)


def q8_0_to_nbits(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q8_0 rows -> MatMulNBits int8 (packed, scales); lossless (value = (u - 128) * d)."""
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, -1, 34)     # [N, nb, 2 + 32]
    d = blocks[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)    # [N, nb]
    q = blocks[:, :, 2:].view(np.int8).astype(np.int16) + 128                  # [N, nb, 32] in 1..255
    return q.astype(np.uint8), d


def nbits_dequantize(w: NBits) -> np.ndarray:
    """Float32 [N, K] of a MatMulNBits weight (tests and diagnostics)."""
    if w.bits == 4:
        q = np.stack([w.packed & 0x0F, w.packed >> 4], axis=-1).reshape(w.n, -1, w.block)   # [N, nb, block]
    else:
        q = w.packed
    nb = q.shape[1]
    if w.zeros is None:
        zero = np.float32(1 << (w.bits - 1))
    else:                                                          # [N, ceil(nb/2)] -> [N, nb, 1]
        zero = np.stack([w.zeros & 0x0F, w.zeros >> 4], axis=-1).reshape(w.n, -1)[:, :nb, None].astype(np.float32)
    return ((q.astype(np.float32) - zero) * w.scales[..., None]).reshape(w.n, w.k)


class Source:
    """The exporter's view of a model (edgerun.formats): metadata, and each weight as MatMulNBits."""

    def __init__(self, path: Path) -> None:
        if not path.exists():
            raise ModelNotFound(f"model not found: {path}; expected a .gguf file or a Hugging Face "
                                f"checkpoint directory")
        if path.is_file():
            check_gguf(path)                 # clear errors for truncated / non-GGUF files
        self.path = path
        self.src = open_source(path)
        self.is_gguf = isinstance(self.src, GGUFSource)
        self.cfg: ModelConfig = self.src.cfg
        self.arch = self.cfg.arch
        self.names = set(self.src.tensor_names())

    def get(self, key: str, default: Any = None) -> Any:
        return self.src.get(key, default)

    def edgerun_metadata(self) -> dict:
        if not self.is_gguf:
            return {}
        return {kv.key: kv.value for kv in self.src.kv() if kv.key.startswith("edgerun.")}

    def float32(self, name: str) -> np.ndarray:
        """A tensor as float32 in GGUF layout ([out, in] for matrices), dequantized if stored quantized."""
        return np.ascontiguousarray(self.src.tensor(name), dtype=np.float32)

    def nbits(self, name: str, requant: str = "q4_0") -> NBits:
        """A 2-D weight as MatMulNBits: Q4_0/Q8_0 blocks as they are, anything else re-quantized to `requant`."""
        T = gguf.GGMLQuantizationType
        kind = self.src.tensor_type(name) if self.is_gguf else None
        if kind == T.Q4_0:
            packed, d = q4_0_to_matmulnbits(np.asarray(self.src.raw(name)))
            return NBits(4, packed, d, "Q4_0->int4 (lossless)")
        if kind == T.Q8_0:
            packed, d = q8_0_to_nbits(np.asarray(self.src.raw(name)))
            return NBits(8, packed, d, "Q8_0->int8 (lossless)")
        w = self.float32(name)                                       # [N, K]
        if w.ndim != 2 or w.shape[1] % BLOCK:
            raise ModelFormatError(f"{self.path}: {name} has shape {w.shape}; MatMulNBits needs a matrix whose "
                                   f"rows are a multiple of {BLOCK} long")
        raw = pack(requant, w)
        what = kind.name if kind is not None else "float"
        log.info("%s: %s re-quantized to %s for MatMulNBits", name, what, requant.upper())
        if requant == "q4_0":
            packed, d = q4_0_to_matmulnbits(raw)
            return NBits(4, packed, d, f"{what}->Q4_0->int4 (requantized)")
        packed, d = q8_0_to_nbits(raw)
        return NBits(8, packed, d, f"{what}->Q8_0->int8 (requantized)")


def rope_tables(src: Source, cfg: ModelConfig, n_ctx: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [n_ctx, head_dim/2] float32 as llama.cpp rotates (base, linear scaling, freq factors)."""
    arch = src.arch
    n_rot = int(src.get(f"{arch}.rope.dimension_count", cfg.head_dim))
    if n_rot != cfg.head_dim:
        raise ModelFormatError(f"{src.path}: partial RoPE ({n_rot} of {cfg.head_dim} dims) is not supported; "
                               f"expected rope.dimension_count == head_dim")
    scaling = src.get(f"{arch}.rope.scaling.type", "none")
    factor = float(src.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    if scaling not in ("none", "linear") and factor != 1.0:
        raise ModelFormatError(f"{src.path}: RoPE scaling {scaling!r} is not supported by the ONNX export; "
                               f"expected none or linear")
    inv = cfg.rope_base ** (-np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim)   # [hd/2]
    if "rope_freqs.weight" in src.names:
        inv = inv / src.float32("rope_freqs.weight").astype(np.float64).reshape(-1)
    pos = np.arange(n_ctx, dtype=np.float64) / (factor if scaling == "linear" else 1.0)
    ang = pos[:, None] * inv[None, :]                                                             # [n_ctx, hd/2]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
