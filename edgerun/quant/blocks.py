"""Q4_0 / Q4_1 / Q8_0 / IQ4_NL blocks (and ONNX MatMulNBits) in pure numpy, byte-exact vs `gguf.quants`.

A block is 32 consecutive elements of a row (the input dimension of a linear weight [out, in]).

- Q4_0: fp16 d + 16 bytes; byte j = element j (low nibble) | element j+16 (high nibble);
  value = (q - 8) * d.
- Q4_1: fp16 d, fp16 m + 16 bytes (same nibble order); value = q * d + m.
- Q8_0: fp16 d + 32 int8; value = q * d.
- Q4_K: super-blocks of 256 = 8 sub-blocks of 32: fp16 d, fp16 dmin, 12 bytes of 6-bit sub-block
  scales and mins, 128 bytes of codes; value = d * sc_j * q - dmin * m_j (4.5 bits per weight).
  llama.cpp repacks it for AVX2 (8x8) and NEON dot product (8x4) like Q4_0; rows must be a
  multiple of 256 long. Only round-to-nearest style storage here (`pack_q4_k`), no AWQ search.
- IQ4_NL: Q4_0's layout and size (fp16 d + 16 bytes, same nibble order), but the 16 codes index a
  non-uniform grid: value = IQ4_NL_VALUES[q] * d. Same bytes per weight as Q4_0, and llama.cpp repacks
  it for its CPU kernels as it does Q4_0 (AVX2: 8x8 rows, NEON dot product: 4x4), so it decodes and
  verifies at Q4_0's speed with a grid closer to the weights' bell-shaped distribution.

The format fixes how a block is decoded, not how d (and m) are chosen. `pack(fmt, w)` with no
params is round-to-nearest exactly as `gguf.quants` / llama.cpp's reference quantizer does it
(d = signed max / -8 for Q4_0, (max - min) / 15 for Q4_1). `search_params(fmt, w, weight)` chooses
each block's d (and m) to minimise an activation-weighted error sum_i,j e_i G_ij e_j per block,
where G is a per-channel importance vector [in] (diagonal), a per-element one [rows, in]
(diagonal; `element_importance`) or per-block Gram matrices [n_blocks, 32, 32] of the layer's
input; `pack(fmt, w, params)` then stores exactly those values.
`fake_quant` returns what llama.cpp will compute from the stored blocks (fp16 rounding included).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import QuantizationError

QK = 32                       # elements per block (Q4_0, Q4_1, Q8_0, IQ4_NL, MatMulNBits here)
FORMATS = ("q4_0", "q4_1", "q8_0", "iq4_nl")
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34, "iq4_nl": 18}
# llama.cpp's IQ4_NL grid (kvalues_iq4nl), and the midpoints between neighbours (nearest-code boundaries)
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)
_IQ4_NL_MIDS = (IQ4_NL_VALUES[1:] + IQ4_NL_VALUES[:-1]) / 2

# Default search grids. Q4_0 tries d = amax_signed / -k for these k (IQ4_NL: / -(k * 127 / 8), the same
# relative positions of the largest weight on its grid); Q4_1 rounds (x - min) * k /
# (max - min) for these k. Every candidate's codes are followed by a weighted least-squares refit of
# d (Q4_0) or (d, m) (Q4_1), and the best block is refined by REFINE rounds of re-rounding + refit.
Q4_0_DIVISORS = tuple(round(6.0 + 0.1 * i, 1) for i in range(31))   # 6.0 .. 9.0
Q4_1_STEPS = tuple(round(12.0 + 0.15 * i, 2) for i in range(31))     # 12.0 .. 16.5
REFINE = 2


@dataclass(frozen=True)
class BlockParams:
    """Per-block decode parameters as stored: d [rows, n_blocks] fp16, m (Q4_1 only) fp16."""

    d: np.ndarray
    m: np.ndarray | None = None


def _check(fmt: str, w: np.ndarray) -> None:
    if fmt not in FORMATS and fmt != "q4_k":
        raise QuantizationError(f"unsupported format {fmt!r}; expected one of {FORMATS + ('q4_k',)}")
    block = QK_K if fmt == "q4_k" else QK
    if w.ndim != 2 or w.shape[1] % block:
        raise QuantizationError(f"{fmt} needs a 2-D weight with rows a multiple of {block} long, got shape {w.shape}")
    if not np.isfinite(w).all():
        raise QuantizationError(f"weight has NaN or infinite values; expected finite floats for {fmt}")


def _blocks(w: np.ndarray) -> np.ndarray:
    """w [rows, K] -> [rows, K/32, 32] float32."""
    return np.asarray(w, dtype=np.float32).reshape(w.shape[0], -1, QK)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """q [rows, nb, 32] uint8 0..15 -> [rows, nb, 16]: byte j = q[j] | q[j+16] << 4."""
    return q[..., :16] | (q[..., 16:] << np.uint8(4))


def _unpack_nibbles(b: np.ndarray) -> np.ndarray:
    """[rows, nb, 16] -> q [rows, nb, 32] uint8."""
    return np.concatenate([b & np.uint8(0x0F), b >> np.uint8(4)], axis=-1)


# ----------------------------------------------------------------------------- codes from params

def _codes_rtn(fmt: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Round-to-nearest codes as gguf.quants computes them: (q [.., 32] uint8/int8, d16, m16)."""
    if fmt == "q4_0":
        imax = np.abs(x).argmax(axis=-1)[..., None]
        mx = np.take_along_axis(x, imax, axis=-1)                 # signed value of largest magnitude
        d = mx / np.float32(-8)
        with np.errstate(divide="ignore"):
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
        q = np.trunc(x * inv + np.float32(8.5)).astype(np.uint8).clip(0, 15)
        return q, d[..., 0].astype(np.float16), None
    if fmt == "iq4_nl":            # the weight of largest magnitude on the grid's end (-127), nearest codes
        imax = np.abs(x).argmax(axis=-1)[..., None]
        d16 = (np.take_along_axis(x, imax, axis=-1) / np.float32(-127))[..., 0].astype(np.float16)
        return _codes_given(fmt, x, BlockParams(d16)), d16, None
    if fmt == "q4_1":
        mx, mn = x.max(axis=-1, keepdims=True), x.min(axis=-1, keepdims=True)
        d = (mx - mn) / np.float32(15)
        with np.errstate(divide="ignore"):
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
        q = np.trunc((x - mn) * inv + np.float32(0.5)).astype(np.uint8).clip(0, 15)
        return q, d[..., 0].astype(np.float16), mn[..., 0].astype(np.float16)
    d = np.abs(x).max(axis=-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
    v = x * inv
    a = np.abs(v)
    q = (np.sign(v) * (np.floor(a) + np.floor(2 * (a - np.floor(a))))).astype(np.int8)   # round half away
    return q, d[..., 0].astype(np.float16), None


def _codes_given(fmt: str, x: np.ndarray, p: BlockParams) -> np.ndarray:
    """Nearest codes for stored (fp16) d, m: q [rows, nb, 32]."""
    d = p.d.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
    if fmt == "q4_0":
        return np.clip(np.floor(x * inv + np.float32(8.5)), 0, 15).astype(np.uint8)
    if fmt == "iq4_nl":
        return np.searchsorted(_IQ4_NL_MIDS, x * inv).astype(np.uint8)     # nearest grid value's index
    if fmt == "q4_1":
        m = p.m.astype(np.float32)[..., None]
        return np.clip(np.floor((x - m) * inv + np.float32(0.5)), 0, 15).astype(np.uint8)
    return np.clip(np.round(x * inv), -127, 127).astype(np.int8)


def _code_values(fmt: str, q: np.ndarray) -> np.ndarray:
    """What a code stands for before d scales it (Q4_0: q - 8; IQ4_NL: the grid value), float32."""
    if fmt == "iq4_nl":
        return IQ4_NL_VALUES[q]
    return q.astype(np.float32) - np.float32(8)


def _decode(fmt: str, q: np.ndarray, d16: np.ndarray, m16: np.ndarray | None) -> np.ndarray:
    d = d16.astype(np.float32)[..., None]
    if fmt in ("q4_0", "iq4_nl"):
        return _code_values(fmt, q) * d
    if fmt == "q4_1":
        return q.astype(np.float32) * d + m16.astype(np.float32)[..., None]
    return q.astype(np.float32) * d


def _codes(fmt: str, w: np.ndarray, params: BlockParams | None):
    x = _blocks(w)
    if params is None:
        return _codes_rtn(fmt, x)
    if params.d.shape != x.shape[:2] or (fmt == "q4_1") != (params.m is not None):
        raise QuantizationError(f"block params for {fmt} must be d{'/m' if fmt == 'q4_1' else ''} of shape "
                                f"{x.shape[:2]}, got d {params.d.shape}")
    return _codes_given(fmt, x, params), params.d.astype(np.float16), \
        None if params.m is None else params.m.astype(np.float16)


# ----------------------------------------------------------------------------- public API

def pack(fmt: str, w: np.ndarray, params: BlockParams | None = None) -> np.ndarray:
    """w [rows, K] -> raw blocks uint8 [rows, K/32 * bytes_per_block] as GGUF stores them."""
    _check(fmt, w)
    if fmt == "q4_k":
        if params is not None:
            raise QuantizationError("q4_k is stored by its own scale/min fit; searched block params are for "
                                    "q4_0, q4_1 and iq4_nl")
        return pack_q4_k(w)
    q, d16, m16 = _codes(fmt, w, params)
    rows, nb = q.shape[:2]
    parts = [d16.view(np.uint8).reshape(rows, nb, 2)]
    if fmt == "q4_1":
        parts.append(m16.view(np.uint8).reshape(rows, nb, 2))
    parts.append(_pack_nibbles(q) if fmt != "q8_0" else q.view(np.uint8))       # Q4_0 / Q4_1 / IQ4_NL nibbles
    return np.concatenate(parts, axis=-1).reshape(rows, nb * BLOCK_BYTES[fmt])


def unpack(fmt: str, raw: np.ndarray) -> np.ndarray:
    """raw blocks uint8 [rows, nb * bytes] -> float32 [rows, nb * 32] (what llama.cpp decodes)."""
    if fmt == "q4_k":
        return unpack_q4_k(raw)
    if fmt not in FORMATS:
        raise QuantizationError(f"unsupported format {fmt!r}; expected one of {FORMATS}")
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, BLOCK_BYTES[fmt])                    # [rows, nb, bytes]
    d16 = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0]
    if fmt == "q4_1":
        m16 = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0]
        q = _unpack_nibbles(b[..., 4:])
    elif fmt in ("q4_0", "iq4_nl"):
        m16, q = None, _unpack_nibbles(b[..., 2:])
    else:
        m16, q = None, np.ascontiguousarray(b[..., 2:]).view(np.int8)
    return _decode(fmt, q, d16, m16).reshape(rows, -1)


def fake_quant(fmt: str, w: np.ndarray, params: BlockParams | None = None) -> np.ndarray:
    """The float32 weights llama.cpp computes with after `pack(fmt, w, params)` (= unpack(pack(...)))."""
    _check(fmt, w)
    if fmt == "q4_k":
        return unpack_q4_k(pack(fmt, w, params))
    q, d16, m16 = _codes(fmt, w, params)
    return _decode(fmt, q, d16, m16).reshape(w.shape)


def rtn_params(fmt: str, w: np.ndarray) -> BlockParams:
    """The d (and m) round-to-nearest stores."""
    _, d16, m16 = _codes_rtn(fmt, _blocks(w))
    return BlockParams(d16, m16)


def _quad(a: np.ndarray, b: np.ndarray, weight: np.ndarray | None) -> np.ndarray:
    """sum_ij a_i G_ij b_j per block: a, b [rows, nb, 32] -> [rows, nb].

    weight: None (G = I), [K] (diagonal, one importance per input channel), [rows, K] (diagonal,
    one importance per element) or [nb, 32, 32] (per-block Gram matrices of the layer's input).
    """
    if weight is None:
        return np.einsum("rbi,rbi->rb", a, b)
    if weight.ndim == 1:
        return np.einsum("rbi,rbi->rb", a * weight.reshape(1, -1, QK), b)
    if weight.ndim == 2:
        return np.einsum("rbi,rbi->rb", a * weight.reshape(a.shape), b)
    ag = np.matmul(a.transpose(1, 0, 2), weight)                  # [nb, rows, 32]
    return np.einsum("bri,bri->rb", ag, b.transpose(1, 0, 2))


def _block_loss(e: np.ndarray, weight: np.ndarray | None) -> np.ndarray:
    """e [rows, nb, 32] -> weighted squared error [rows, nb] (weight as in `_quad`)."""
    return _quad(e, e, weight)


def _check_weight(w: np.ndarray, weight: np.ndarray | None) -> np.ndarray | None:
    if weight is None:
        return None
    weight = np.asarray(weight, dtype=np.float32)
    nb = w.shape[1] // QK
    ok = {1: (w.shape[1],), 2: tuple(w.shape), 3: (nb, QK, QK)}.get(weight.ndim) == weight.shape
    if not ok:
        raise QuantizationError(f"importance weight must be [{w.shape[1]}], {list(w.shape)} or "
                                f"[{nb}, {QK}, {QK}] for a weight of shape {list(w.shape)}, got {list(weight.shape)}")
    return weight


def element_importance(w: np.ndarray, channel: np.ndarray) -> np.ndarray:
    """Per-element importance [rows, K] = channel[j] * sqrt(sigma2_r + w_rj^2), sigma2_r = mean_j w_rj^2.

    channel [K] is the input-channel importance (mean squared activation). The factor favours the
    larger weights of a row over what the layer's output error alone would: llama.cpp weights its
    importance-matrix block search this way (a published heuristic; the formula is all that is used).
    """
    w = np.asarray(w, dtype=np.float32)
    sigma2 = np.mean(np.square(w), axis=1, keepdims=True)
    return (np.asarray(channel, dtype=np.float32)[None, :] * np.sqrt(sigma2 + np.square(w))).astype(np.float32)


def block_loss(fmt: str, w: np.ndarray, params: BlockParams | None, weight: np.ndarray | None = None) -> np.ndarray:
    """Weighted error [rows, nb] of storing w with params (None = round-to-nearest)."""
    x = _blocks(w)
    return _block_loss(x - fake_quant(fmt, w, params).reshape(x.shape), _check_weight(w, weight))


def _refit(fmt: str, x: np.ndarray, q: np.ndarray, weight: np.ndarray | None, fallback: BlockParams) -> BlockParams:
    """Weighted least-squares d (Q4_0) or (d, m) (Q4_1) for fixed codes q; `fallback` where singular."""
    if fmt in ("q4_0", "iq4_nl"):
        c = _code_values(fmt, q)                                   # d = <c, x>_G / <c, c>_G
        num, den = _quad(c, x, weight), _quad(c, c, weight)
        with np.errstate(divide="ignore", invalid="ignore"):
            d = np.where(den > 0, num / den, fallback.d.astype(np.float32))
        return BlockParams(d.astype(np.float16))
    qf = q.astype(np.float32)                                      # 2x2 normal equations per block
    one = np.ones_like(qf)
    a11, a12, a22 = _quad(qf, qf, weight), _quad(qf, one, weight), _quad(one, one, weight)
    b1, b2 = _quad(qf, x, weight), _quad(one, x, weight)
    det = a11 * a22 - a12 * a12
    ok = np.abs(det) > 1e-12 * np.maximum(a11 * a22, 1e-30)
    with np.errstate(divide="ignore", invalid="ignore"):
        d = np.where(ok, (a22 * b1 - a12 * b2) / det, np.nan)
        m = np.where(ok, (a11 * b2 - a12 * b1) / det, np.nan)
    good = np.isfinite(d) & np.isfinite(m) & (d >= 0) & (np.abs(d) < 6e4) & (np.abs(m) < 6e4)
    return BlockParams(np.where(good, d, fallback.d.astype(np.float32)).astype(np.float16),
                       np.where(good, m, fallback.m.astype(np.float32)).astype(np.float16))


def search_params(fmt: str, w: np.ndarray, weight: np.ndarray | None = None,
                  divisors=Q4_0_DIVISORS, steps=Q4_1_STEPS, refine: int = REFINE) -> BlockParams:
    """Choose each block's d (and m) minimising its weighted error (never worse than round-to-nearest).

    Candidates: Q4_0 codes of d = signed max / -k for k in `divisors` (IQ4_NL: / -(k * 127 / 8)); Q4_1 codes of
    round((x - min) * k / (max - min)) for k in `steps`. Each candidate's codes get a weighted
    least-squares refit of d (Q4_0: also the unrefitted d is tried) or (d, m) (Q4_1); then the best
    block is refined `refine` times (nearest codes for its d/m, refit). Every candidate is scored
    with fp16-rounded d, m exactly as stored, and codes re-chosen nearest to the stored values.
    `weight`: see `_quad` (None, [K], [rows, K] or [nb, 32, 32]).
    """
    _check(fmt, w)
    if fmt == "q8_0":
        return rtn_params(fmt, w)
    weight = _check_weight(w, weight)
    x = _blocks(w)
    best = rtn_params(fmt, w)
    best_loss = _block_loss(x - fake_quant(fmt, w, best).reshape(x.shape), weight)

    def consider(p: BlockParams) -> np.ndarray:
        nonlocal best, best_loss
        q = _codes_given(fmt, x, p)
        loss = _block_loss(x - _decode(fmt, q, p.d, p.m), weight)
        better = loss < best_loss
        best_loss = np.where(better, loss, best_loss)
        best = BlockParams(np.where(better, p.d, best.d),
                           None if p.m is None else np.where(better, p.m, best.m))
        return q

    if fmt in ("q4_0", "iq4_nl"):
        imax = np.abs(x).argmax(axis=-1)[..., None]
        mx = np.take_along_axis(x, imax, axis=-1)[..., 0]          # [rows, nb] signed max
        span = np.float32(1 if fmt == "q4_0" else 127 / 8)         # grid end: -8 codes of d, or -127
        for k in divisors:
            p = BlockParams((mx / (np.float32(-k) * span)).astype(np.float16))
            consider(_refit(fmt, x, consider(p), weight, p))
    else:
        mx, mn = x.max(axis=-1, keepdims=True), x.min(axis=-1, keepdims=True)
        rng = mx - mn
        rtn = best
        for k in steps:
            with np.errstate(divide="ignore", invalid="ignore"):
                inv = np.where(rng > 0, np.float32(k) / rng, np.float32(0))
            q = np.clip(np.floor((x - mn) * inv + np.float32(0.5)), 0, 15)
            consider(_refit(fmt, x, q, weight, rtn))
    for _ in range(refine):
        consider(_refit(fmt, x, _codes_given(fmt, x, best), weight, best))
    return best


# ----------------------------------------------------------------------------- Q4_K super-blocks

QK_K = 256                    # elements per Q4_K super-block (8 sub-blocks of 32)
Q4_K_BYTES = 144              # fp16 d, fp16 dmin, 12 bytes of scales/mins, 128 bytes of codes
_Q4_K_STEPS = 20              # sub-block fits tried: (15 + (-1 + 0.1 i)) / (max - min), i = 0..20
_Q4_K_CHUNK = 4096            # rows per chunk (a 152k-row output head is fitted in pieces)


def _fit_sub_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per 32-element sub-block, the (scale >= 0, offset >= 0) with x ~ scale * q - offset, q in 0..15,
    minimising sum_i w_i (scale q_i - offset - x_i)^2 with w_i = rms(x) + |x_i| (the larger weights count
    more): codes for a range of steps over [min(x, 0), max(x)], each refitted by weighted least squares.
    x [..., 32] -> scale [...], offset [...]."""
    w = np.sqrt(np.mean(x * x, axis=-1, keepdims=True)) + np.abs(x)              # [..., 32]
    lo = np.minimum(x.min(axis=-1, keepdims=True), 0)
    hi = x.max(axis=-1, keepdims=True)
    span = hi - lo
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(span > 0, np.float32(15) / span, np.float32(0))
    best_s, best_m = (span / np.float32(15))[..., 0], -lo[..., 0]
    q = np.clip(np.rint((x - lo) * inv), 0, 15)
    best_e = np.sum(w * np.square(best_s[..., None] * q - best_m[..., None] - x), axis=-1)
    sw, sx = w.sum(axis=-1), (w * x).sum(axis=-1)
    for i in range(_Q4_K_STEPS + 1):
        with np.errstate(divide="ignore", invalid="ignore"):
            inv_i = np.where(span > 0, (np.float32(15 - 1 + 0.1 * i)) / span, np.float32(0))
        q = np.clip(np.rint((x - lo) * inv_i), 0, 15)
        sl, sl2, sxl = (w * q).sum(axis=-1), (w * q * q).sum(axis=-1), (w * q * x).sum(axis=-1)
        det = sw * sl2 - sl * sl
        with np.errstate(divide="ignore", invalid="ignore"):
            s = (sw * sxl - sx * sl) / det
            m = (sl2 * sx - sl * sxl) / det                      # x ~ s q + m: the offset stored is -m
            pos = m > 0                                          # an offset must stay <= 0: refit s alone
            s = np.where(pos, sxl / sl2, s)
            m = np.where(pos, 0, m)
        ok = (det > 0) & np.isfinite(s) & np.isfinite(m) & (s >= 0)
        e = np.sum(w * np.square(s[..., None] * q + m[..., None] - x), axis=-1)
        better = ok & (e < best_e)
        best_e, best_s, best_m = np.where(better, e, best_e), np.where(better, s, best_s), np.where(better, -m, best_m)
    return best_s.astype(np.float32), best_m.astype(np.float32)


def _pack_q4_k_rows(w: np.ndarray) -> np.ndarray:
    rows = w.shape[0]
    x = np.asarray(w, dtype=np.float32).reshape(rows, -1, 8, 32)             # [rows, nsb, 8, 32]
    scale, offset = _fit_sub_blocks(x)                                       # [rows, nsb, 8] each
    d = (scale.max(axis=-1) / np.float32(63)).astype(np.float16)             # [rows, nsb]
    dmin = (offset.max(axis=-1) / np.float32(63)).astype(np.float16)
    d32, dm32 = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.clip(np.rint(scale / d32), 0, 63), 0).astype(np.uint8)     # [rows, nsb, 8]
        mn = np.where(dm32 > 0, np.clip(np.rint(offset / dm32), 0, 63), 0).astype(np.uint8)
    step = (d32 * sc)[..., None]                                             # [rows, nsb, 8, 1] as stored
    off = (dm32 * mn)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step > 0, np.clip(np.rint((x + off) / step), 0, 15), 0).astype(np.uint8)   # [rows, nsb, 8, 32]
    # 12 scale bytes: 0-3 sc[0..3] | hi2(sc[4..7]) << 6; 4-7 mn[0..3] | hi2(mn[4..7]) << 6;
    # 8-11 lo4(sc[4..7]) | lo4(mn[4..7]) << 4
    s12 = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                          (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)], axis=-1).astype(np.uint8)   # [rows, nsb, 12]
    # 128 code bytes: per 64 elements, byte l = element l (low nibble) | element l + 32 (high nibble)
    q64 = q.reshape(rows, -1, 4, 2, 32)                                      # [rows, nsb, 4, (lo, hi), 32]
    qs = (q64[..., 0, :] | (q64[..., 1, :] << np.uint8(4))).reshape(rows, -1, 128)
    parts = [d.view(np.uint8).reshape(rows, -1, 2), dmin.view(np.uint8).reshape(rows, -1, 2), s12, qs]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def pack_q4_k(w: np.ndarray) -> np.ndarray:
    """w [rows, K] (K a multiple of 256) -> Q4_K super-blocks uint8 [rows, K/256 * 144] as GGUF stores them."""
    _check("q4_k", w)
    return np.concatenate([_pack_q4_k_rows(w[i:i + _Q4_K_CHUNK]) for i in range(0, w.shape[0], _Q4_K_CHUNK)])


def unpack_q4_k(raw: np.ndarray) -> np.ndarray:
    """Q4_K super-blocks uint8 [rows, nsb * 144] -> float32 [rows, nsb * 256] (what llama.cpp decodes)."""
    rows = raw.shape[0]
    b = np.asarray(raw, dtype=np.uint8).reshape(rows, -1, Q4_K_BYTES)       # [rows, nsb, 144]
    d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)[..., None]
    dmin = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)[..., None]
    s = b[..., 4:16]
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    qs = b[..., 16:].reshape(rows, -1, 4, 1, 32)                             # [rows, nsb, 4, 1, 32]
    q = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(rows, -1, 8, 32).astype(np.float32)
    out = (d * sc)[..., None] * q - (dmin * mn)[..., None]                  # [rows, nsb, 8, 32]
    return out.reshape(rows, -1).astype(np.float32)


# ----------------------------------------------------------------------------- blocks from given codes

CODE_FORMATS = {"q4_0": 15, "q4_1": 15, "q5_0": 31}     # format -> largest code
CODE_BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q5_0": 22}


def encode_codes(fmt: str, q: np.ndarray, d: np.ndarray, m: np.ndarray | None = None) -> np.ndarray:
    """Store given codes and block parameters as GGUF blocks (no rounding of the codes: they are kept).

    q [rows, K] uint8 codes (0..15; q5_0: 0..31), d [rows, K/32] fp16, m [rows, K/32] fp16 (q4_1 only).
    Decoded as llama.cpp does: q4_0 (q - 8) * d, q4_1 q * d + m, q5_0 (q - 16) * d (Q5_0 block: fp16 d,
    uint32 qh with bit j the high bit of element j, 16 bytes of low nibbles paired j | j+16).
    Returns uint8 [rows, K/32 * bytes per block].
    """
    if fmt not in CODE_FORMATS:
        raise QuantizationError(f"unsupported format {fmt!r} for stored codes; expected one of {sorted(CODE_FORMATS)}")
    rows, K = q.shape
    if K % QK:
        raise QuantizationError(f"{fmt} needs rows a multiple of {QK} long, got {K}")
    nb = K // QK
    if q.max(initial=0) > CODE_FORMATS[fmt]:
        raise QuantizationError(f"code {int(q.max())} does not fit {fmt} (0..{CODE_FORMATS[fmt]})")
    qb = np.asarray(q, dtype=np.uint8).reshape(rows, nb, QK)                 # [rows, nb, 32]
    parts = [np.asarray(d, dtype=np.float16).reshape(rows, nb).view(np.uint8).reshape(rows, nb, 2)]
    if fmt == "q4_1":
        if m is None:
            raise QuantizationError("q4_1 blocks need m")
        parts.append(np.asarray(m, dtype=np.float16).reshape(rows, nb).view(np.uint8).reshape(rows, nb, 2))
    if fmt == "q5_0":
        hi = (qb >> np.uint8(4)).astype(np.uint32)                            # [rows, nb, 32] 0/1
        qh = (hi << np.arange(QK, dtype=np.uint32)).sum(axis=-1, dtype=np.uint32)   # [rows, nb]
        parts.append(qh.astype("<u4").view(np.uint8).reshape(rows, nb, 4))
        qb = qb & np.uint8(15)
    parts.append(_pack_nibbles(qb))
    return np.concatenate(parts, axis=-1).reshape(rows, nb * CODE_BLOCK_BYTES[fmt])


# ----------------------------------------------------------------------------- ONNX MatMulNBits

def q4_0_to_matmulnbits(raw_blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0 blocks -> onnxruntime MatMulNBits (bits 4, block 32, no zero points = implicit 8). Lossless.

    raw_blocks: uint8 [N, K/32 * 18] (a Q4_0 tensor of a weight [N, K] as GGUF stores it).
    Returns (B uint8 [N, K/32, 16] with element 2i in the low and 2i+1 in the high nibble of byte i,
    scales float32 [N, K/32], each exactly the block's fp16 d).
    """
    raw_blocks = np.asarray(raw_blocks, dtype=np.uint8)
    if raw_blocks.ndim != 2 or raw_blocks.shape[1] % BLOCK_BYTES["q4_0"]:
        raise QuantizationError(f"expected Q4_0 blocks uint8 [N, K/32*18], got shape {raw_blocks.shape}")
    n = raw_blocks.shape[0]
    b = raw_blocks.reshape(n, -1, 18)                                # [N, nb, 18]
    scales = np.ascontiguousarray(b[..., :2]).view(np.float16)[..., 0].astype(np.float32)   # [N, nb]
    q = _unpack_nibbles(b[..., 2:])                                  # [N, nb, 32] in element order
    pairs = q.reshape(n, q.shape[1], 16, 2)                          # [N, nb, 16, (2i, 2i+1)]
    packed = pairs[..., 0] | (pairs[..., 1] << np.uint8(4))
    return np.ascontiguousarray(packed), scales
