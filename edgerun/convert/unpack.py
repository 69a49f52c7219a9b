"""Unpack published INT4 tensors (AutoAWQ, compressed-tensors, GPTQ) to codes, zero points and scales.

Every format here dequantizes to W[n, k] = (q[n, k] - z[n, k // g]) * s[n, k // g] with unsigned
codes q, z in 0..15 (N = out features, K = in features, g = group size, G = K / g groups). The
functions are pure numpy; each returns an `Int4` in the [out, in] orientation edgerun stores.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ModelFormatError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)      # AutoAWQ GEMM: nibble i of a word holds column 8c + AWQ_ORDER[i]


@dataclass(frozen=True)
class Int4:
    """One INT4 linear weight as published: q [N, K] uint8, z [N, G] uint8, s [N, G] float32, group g.

    s holds the stored fp16/bf16 scale exactly (widened). m, when set, is the format's own stored
    offset [N, G] float32 (AutoAWQ GEMV_fast keeps fp16(-s*z), and its kernel computes q*s + m).
    g_idx [K] (GPTQ act-order only) maps each input to its group when it is not k // g.
    """

    q: np.ndarray
    z: np.ndarray
    s: np.ndarray
    g: int
    symmetric: bool
    m: np.ndarray | None = None
    g_idx: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    @property
    def blockwise(self) -> bool:
        """True when input k belongs to group k // g (always, except GPTQ act-order)."""
        return self.g_idx is None

    def dequantize(self) -> np.ndarray:
        """float32 [N, K]: (q - z) * s, or q * s + m where the format stores m."""
        gi = np.arange(self.q.shape[1]) // self.g if self.g_idx is None else self.g_idx
        s = self.s[:, gi]                                                   # [N, K]
        if self.m is not None:
            return (self.q.astype(np.float32) * s + self.m[:, gi]).astype(np.float32)
        return ((self.q.astype(np.float32) - self.z[:, gi].astype(np.float32)) * s).astype(np.float32)


def nibbles(words: np.ndarray) -> np.ndarray:
    """int32 words [..., W] -> their 8 nibbles [..., W, 8] uint8, low nibble first."""
    u = np.ascontiguousarray(words).view(np.uint32)
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    return ((u[..., None] >> shifts) & np.uint32(15)).astype(np.uint8)


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise ModelFormatError(what)


def awq_gemm(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, g: int) -> Int4:
    """AutoAWQ GEMM: qweight int32 [K, N/8], qzeros int32 [K/g, N/8] (both packed along N in AWQ_ORDER),
    scales [K/g, N]."""
    K, n8 = qweight.shape
    N = n8 * 8
    G = K // g
    _need(qzeros.shape == (G, n8) and scales.shape == (G, N),
          f"qzeros {list(qzeros.shape)} / scales {list(scales.shape)} do not match qweight {list(qweight.shape)} "
          f"with group size {g}; expected [{G}, {n8}] and [{G}, {N}]")
    inv = np.argsort(AWQ_ORDER)                                             # column j of 8 -> nibble index

    def cols(w):                                                            # [R, N/8] -> [R, N] codes
        nb = nibbles(w)                                                     # [R, N/8, 8] by nibble
        return nb[..., inv].reshape(w.shape[0], -1)
    return Int4(cols(qweight).T.copy(), cols(qzeros).T.copy(), scales.astype(np.float32).T.copy(), g, False)


def awq_gemv(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, g: int) -> Int4:
    """AutoAWQ GEMV: qweight int32 [N, K/8] packed along K (natural order), qzeros int32 [N, W] and
    scales [N, 8W] padded per row (the first K/g entries are the groups)."""
    N, k8 = qweight.shape
    G = k8 * 8 // g
    _need(qzeros.shape[0] == N and qzeros.shape[1] * 8 >= G and scales.shape[0] == N and scales.shape[1] >= G,
          f"qzeros {list(qzeros.shape)} / scales {list(scales.shape)} do not match qweight {list(qweight.shape)} "
          f"with group size {g}")
    q = nibbles(qweight).reshape(N, -1)                                     # [N, K]
    z = nibbles(qzeros).reshape(N, -1)[:, :G]
    return Int4(q, np.ascontiguousarray(z), scales[:, :G].astype(np.float32), g, False)


def awq_gemv_fast(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, g: int) -> Int4:
    """AutoAWQ GEMV_fast: qweight int16 [N/4, K] (4 rows interleaved per 64 inputs, nibbles reordered
    within 32), scales fp16 [8W, N] and qzeros fp16 [8W, N] holding -s*z (padded; the first K/g rows
    are the groups)."""
    n4, K = qweight.shape
    N, G = n4 * 4, K // g
    _need(K % 64 == 0, f"GEMV_fast qweight has {K} inputs; expected a multiple of 64")
    _need(scales.shape[1] == N and qzeros.shape[1] == N and scales.shape[0] >= G and qzeros.shape[0] >= G,
          f"qzeros {list(qzeros.shape)} / scales {list(scales.shape)} do not match qweight {list(qweight.shape)}")
    u = np.ascontiguousarray(qweight).view(np.uint16).astype(np.uint32)     # [N/4, K]
    nb = ((u[..., None] >> np.arange(0, 16, 4, dtype=np.uint32)) & 15).astype(np.uint8)   # [N/4, K, 4]
    # writer: [N, K] -> [N/4, 4, K/64, 64] -> transpose(0,2,1,3) -> flat 256 per tile -> 4 per int16
    t = nb.reshape(n4, K // 64, 4, 64).transpose(0, 2, 1, 3).reshape(N, K)  # undo the 4-row interleave
    # writer, within each 32: [4, 4, 2] -> transpose(1, 0, 2), then each 8 as [4, 2] -> transpose(1, 0)
    t = t.reshape(N, K // 32, 4, 2, 4).transpose(0, 1, 2, 4, 3).reshape(N, K // 32, 4, 4, 2)
    q = t.transpose(0, 1, 3, 2, 4).reshape(N, K)
    s = scales[:G].astype(np.float32).T.copy()                              # [N, G]
    m = qzeros[:G].astype(np.float32).T.copy()                              # fp16(-s*z) [N, G]
    with np.errstate(divide="ignore", invalid="ignore"):
        zf = np.where(s != 0, -m / s, 0)
    z = np.rint(zf)
    _need(bool(np.all((z >= 0) & (z <= 15))), "GEMV_fast qzeros do not hold -scale*z with z in 0..15")
    return Int4(np.ascontiguousarray(q), z.astype(np.uint8), s, g, False, m=m)


def ct_pack_quantized(weight_packed: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None,
                      shape: tuple[int, int], g: int, symmetric: bool) -> Int4:
    """compressed-tensors pack-quantized: weight_packed int32 [N, K/8] packed along K low nibble first,
    each nibble q_signed + 8; weight_scale [N, G]; weight_zero_point (asymmetric) int32 [ceil(N/8), G]
    packed along N, or unpacked int8 [N, G] (older checkpoints), holding z_signed."""
    N, K = shape
    G = K // g
    _need(weight_packed.shape == (N, K // 8), f"weight_packed has shape {list(weight_packed.shape)}; "
          f"expected [{N}, {K // 8}] for weight_shape [{N}, {K}]")
    _need(scale.shape == (N, G), f"weight_scale has shape {list(scale.shape)}; expected [{N}, {G}]")
    q = nibbles(weight_packed).reshape(N, K)                                # q_signed + 8
    if symmetric:
        z = np.full((N, G), 8, np.uint8)
    else:
        _need(zero_point is not None, "asymmetric scheme without weight_zero_point")
        if zero_point.dtype == np.int32 and zero_point.shape == ((N + 7) // 8, G):
            zs = nibbles(zero_point.T).reshape(G, -1)[:, :N].T                # [N, G] (q_signed + 8)
            z = zs.astype(np.uint8)
        elif zero_point.shape == (N, G):
            zi = zero_point.astype(np.int32) + 8
            _need(bool(np.all((zi >= 0) & (zi <= 15))), "weight_zero_point values outside -8..7")
            z = zi.astype(np.uint8)
        else:
            raise ModelFormatError(f"weight_zero_point has shape {list(zero_point.shape)} {zero_point.dtype}; "
                                   f"expected int32 [{(N + 7) // 8}, {G}] (packed) or [{N}, {G}]")
    return Int4(q, np.ascontiguousarray(z), scale.astype(np.float32), g, symmetric)


def gptq(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray | None, g: int,
         v1: bool, symmetric: bool) -> Int4:
    """GPTQ: qweight int32 [K/8, N] packed along K, qzeros int32 [G, N/8] packed along N (v1 stores z - 1),
    scales [G, N], g_idx [K]."""
    k8, N = qweight.shape
    K = k8 * 8
    G = scales.shape[0]
    _need(scales.shape[1] == N and qzeros.shape == (G, N // 8),
          f"qzeros {list(qzeros.shape)} / scales {list(scales.shape)} do not match qweight {list(qweight.shape)}")
    q = nibbles(qweight).transpose(0, 2, 1).reshape(K, N).T.copy()          # [K/8, N, 8] -> [K, N] -> [N, K]
    z = nibbles(qzeros).reshape(G, N).T.astype(np.int32)                    # [N, G]
    if v1:
        z = z + 1
    _need(bool(np.all(z <= 15)), "GPTQ v1 qzeros hold 15 (z = 16 after the +1); expected zero points 0..15 "
          "(re-save the checkpoint in the v2 format)")
    gi = None
    if g_idx is not None:
        _need(g_idx.shape == (K,), f"g_idx has shape {list(g_idx.shape)}; expected [{K}]")
        gi = g_idx.astype(np.int64)
        _need(bool(np.all((gi >= 0) & (gi < G))), f"g_idx values outside 0..{G - 1}")
        if np.array_equal(gi, np.arange(K) // g):
            gi = None
    else:
        _need(G * g == K, f"scales have {G} groups; expected {K // g} for {K} inputs and group size {g}")
    return Int4(q, z.astype(np.uint8), scales.astype(np.float32).T.copy(), g, symmetric, g_idx=gi)
