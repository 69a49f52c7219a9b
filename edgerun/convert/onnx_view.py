"""The ONNX exporter's view of an INT4 checkpoint: each quantized linear as MatMulNBits with its own groups.

MatMulNBits computes (q - zero_point) * scale per block, so the published codes, zero points and
scales go in as they are (block_size = g; 4-bit zero points packed two per byte): bit-exact for
AutoAWQ GEMM/GEMV, compressed-tensors and GPTQ. AutoAWQ GEMV_fast stores fp16(-s*z) instead of z:
the zero point is recovered exactly and the graph computes (q - z)*s, which differs from its fp16
offset by that offset's rounding. Act-order GPTQ tensors are re-quantized (Q4_0, noted).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..onnx.weights import NBits, Source
from .checkpoint import Int4Checkpoint
from .unpack import Int4


def _pack_pairs(a: np.ndarray) -> np.ndarray:
    """uint8 codes [..., 2n] -> bytes [..., n]: element 2j low nibble, 2j+1 high."""
    return (a[..., 0::2] | (a[..., 1::2] << np.uint8(4))).astype(np.uint8)


def int4_to_nbits(w: Int4, note: str) -> NBits:
    """An Int4 [N, K] as MatMulNBits (bits 4, block g or 32 with the group's values repeated)."""
    N, K = w.q.shape
    block = w.g if (w.g & (w.g - 1)) == 0 and 16 <= w.g <= K else 32
    rep = w.g // block
    s = np.repeat(w.s, rep, axis=1).astype(np.float32)                     # [N, K/block]
    z = np.repeat(w.z, rep, axis=1)
    nb = K // block
    packed = _pack_pairs(w.q.reshape(N, nb, block))                        # [N, nb, block/2]
    if z.shape[1] % 2:
        z = np.concatenate([z, np.zeros((N, 1), np.uint8)], axis=1)
    return NBits(4, packed, s, note, block, _pack_pairs(z))               # zeros [N, ceil(nb/2)]


class CheckpointView:
    """Duck-types edgerun.onnx.weights.Source for an Int4Checkpoint."""

    def __init__(self, ckpt: Int4Checkpoint, metadata: dict) -> None:
        self.path = ckpt.path
        self.src = ckpt
        self.is_gguf = False
        self.cfg = ckpt.cfg
        self.arch = ckpt.cfg.arch
        self.names = set(ckpt.tensor_names())
        self._meta = metadata

    def get(self, key, default=None):
        return default

    def edgerun_metadata(self) -> dict:
        return dict(self._meta)

    def float32(self, name: str) -> np.ndarray:
        return np.ascontiguousarray(self.src.tensor(name), dtype=np.float32)

    def nbits(self, name: str, requant: str = "q4_0") -> NBits:
        w = self.src.weight(name)
        if isinstance(w, Int4) and w.blockwise and w.g % 32 == 0:
            exact = "lossless" if w.m is None else "lossless codes; fp16 offset -s*z taken as (q - z)*s"
            return int4_to_nbits(w, f"{self.src.scheme.label}->int4 g{w.g} ({exact})")
        return Source.nbits(self, name, requant)                           # float path: re-quantized, noted

    @property
    def file_name(self) -> str:
        return Path(self.path).name
