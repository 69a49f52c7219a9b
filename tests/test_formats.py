"""quant/blocks.py: byte-exact vs gguf.quants, fake-quant == decode(pack), searched d/m never worse."""

import gguf
import numpy as np
import pytest

from edgerun.errors import QuantizationError
from edgerun.quant import blocks as F

QT = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "q4_1": gguf.GGMLQuantizationType.Q4_1,
      "q8_0": gguf.GGMLQuantizationType.Q8_0, "iq4_nl": gguf.GGMLQuantizationType.IQ4_NL}


def _weights(rng, rows=48, k=256):
    w = rng.standard_normal((rows, k)).astype(np.float32)
    w[0, :32] = 0.0                                   # an all-zero block
    w[1, :32] = 0.5                                   # a constant block
    w[2, 32:64] = np.linspace(-1, 1, 32)              # exact ties at half steps
    w[3] *= 1e-3
    w[4, ::7] *= 20                                   # outliers
    return w


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_rtn_byte_exact_vs_gguf(fmt):
    rng = np.random.default_rng(0)
    for _ in range(3):
        w = _weights(rng)
        ours = F.pack(fmt, w)
        ref = gguf.quants.quantize(w, QT[fmt])
        assert ours.dtype == np.uint8 and ours.shape == ref.shape
        assert np.array_equal(ours, ref)
        deq = gguf.quants.dequantize(ref, QT[fmt])
        np.testing.assert_array_equal(F.unpack(fmt, ours), deq)
        np.testing.assert_array_equal(F.fake_quant(fmt, w), deq)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "iq4_nl"])
@pytest.mark.parametrize("weighting", ["none", "diag", "elem", "gram"])
def test_search_never_worse_and_stored_exactly(fmt, weighting):
    rng = np.random.default_rng(1)
    w = _weights(rng)
    nb = w.shape[1] // 32
    x = rng.standard_normal((500, w.shape[1])).astype(np.float32) * np.exp(rng.standard_normal(w.shape[1]))
    weight = {"none": None, "diag": (x * x).mean(0), "elem": F.element_importance(w, (x * x).mean(0)),
              "gram": np.einsum("tbi,tbj->bij", x.reshape(500, nb, 32), x.reshape(500, nb, 32)) / 500}[weighting]
    p = F.search_params(fmt, w, weight)
    loss_rtn = F.block_loss(fmt, w, None, weight)
    loss = F.block_loss(fmt, w, p, weight)
    assert (loss <= loss_rtn + 1e-12).all()
    assert loss.sum() < 0.95 * loss_rtn.sum()           # the search really helps on random blocks
    raw = F.pack(fmt, w, p)
    deq = gguf.quants.dequantize(raw, QT[fmt])           # what llama.cpp decodes from the stored bytes
    np.testing.assert_array_equal(F.fake_quant(fmt, w, p), deq)
    np.testing.assert_array_equal(F.unpack(fmt, raw), deq)
    # the stored d/m are the chosen ones, bit for bit
    b = raw.reshape(w.shape[0], nb, -1)
    assert np.array_equal(b[..., :2].copy().view(np.float16)[..., 0], p.d)


def test_iq4_nl_decodes_as_gguf_and_picks_the_nearest_grid_value():
    """gguf.quants has no IQ4_NL quantizer, so: what we store decodes (gguf.quants.dequantize, llama.cpp's
    reference decoder) to what fake_quant computes, every code is the nearest grid value for the stored d,
    and at Q4_0's size the non-uniform grid fits bell-shaped weights better than Q4_0's uniform one."""
    rng = np.random.default_rng(0)
    w = _weights(rng)
    raw = F.pack("iq4_nl", w)
    assert raw.shape == F.pack("q4_0", w).shape                       # same bytes per block as Q4_0
    deq = gguf.quants.dequantize(raw, QT["iq4_nl"])
    np.testing.assert_array_equal(F.unpack("iq4_nl", raw), deq)
    np.testing.assert_array_equal(F.fake_quant("iq4_nl", w), deq)
    d = raw.reshape(w.shape[0], -1, 18)[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)   # [rows, nb]
    grid = F.IQ4_NL_VALUES[None, None, None, :] * d[..., None, None]  # [rows, nb, 1, 16]
    x = w.reshape(w.shape[0], -1, 32)[..., None]                      # [rows, nb, 32, 1]
    best = np.abs(x - grid).min(axis=-1)                              # distance to the nearest grid value
    got = np.abs(x[..., 0] - deq.reshape(x.shape[:3]))
    np.testing.assert_allclose(got, best, rtol=0, atol=1e-6)
    g = rng.standard_normal((64, 512)).astype(np.float32)
    err = {f: np.square(g - F.fake_quant(f, g, F.search_params(f, g))).mean() for f in ("q4_0", "iq4_nl")}
    assert err["iq4_nl"] < 0.9 * err["q4_0"]


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1"])
def test_search_finds_a_grid_the_weights_lie_on(fmt):
    """Weights that are exactly representable (e.g. dequantized from a Q4_K source, whose 32-element
    sub-blocks are Q4_1 blocks) are found again, although max/min of a block is off the grid."""
    rng = np.random.default_rng(4)
    rows, nb = 64, 8
    q = rng.integers(1, 15, (rows, nb, 32)).astype(np.float32)            # codes 0 and 15 unused
    q[..., 0], q[..., 1] = 1, 14
    d = (0.01 + 0.02 * rng.random((rows, nb, 1))).astype(np.float16).astype(np.float32)
    if fmt == "q4_0":
        w = ((q - 8) * d).reshape(rows, -1)
    else:
        m = (-0.1 * rng.random((rows, nb, 1))).astype(np.float16).astype(np.float32)
        w = (q * d + m).reshape(rows, -1)
    imp = np.exp(rng.standard_normal(w.shape[1])).astype(np.float32)
    loss_rtn = F.block_loss(fmt, w, None, imp).sum()
    loss = F.block_loss(fmt, w, F.search_params(fmt, w, imp), imp).sum()
    assert loss < 1e-3 * loss_rtn


def test_refined_search_beats_the_coarse_grid():
    """The default grids with refits and refinement are at least as good as a coarse grid (q4_0, q4_1)."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((96, 256)).astype(np.float32) * np.exp(0.5 * rng.standard_normal((96, 1)))
    imp = np.exp(1.5 * rng.standard_normal(256)).astype(np.float32)
    for fmt in ("q4_0", "q4_1"):
        coarse = F.search_params(fmt, w, imp, divisors=(8.0,), steps=(15.0,), refine=0)
        full = F.search_params(fmt, w, imp)
        assert F.block_loss(fmt, w, full, imp).sum() < 0.99 * F.block_loss(fmt, w, coarse, imp).sum()


def test_element_importance():
    w = np.array([[3.0, 4.0] * 16, [0.0] * 32], np.float32)
    ch = np.linspace(1, 2, 32).astype(np.float32)
    e = F.element_importance(w, ch)
    sigma2 = 12.5
    np.testing.assert_allclose(e[0], ch * np.sqrt(sigma2 + w[0] ** 2), rtol=1e-6)
    np.testing.assert_allclose(e[1], 0.0)
    with pytest.raises(QuantizationError, match="importance weight"):
        F.search_params("q4_0", w, np.ones((2, 16), np.float32))


def test_output_error_tracks_block_loss():
    """With the block Gram of real inputs, the searched params reduce the layer's output error."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 128)).astype(np.float32)
    x = rng.standard_normal((400, 128)).astype(np.float32) * np.exp(2 * rng.standard_normal(128))
    g = np.einsum("tbi,tbj->bij", x.reshape(400, 4, 32), x.reshape(400, 4, 32))
    for fmt in ("q4_0", "q4_1"):
        e_rtn = np.square(x @ (w - F.fake_quant(fmt, w)).T).sum()
        e_s = np.square(x @ (w - F.fake_quant(fmt, w, F.search_params(fmt, w, g))).T).sum()
        assert e_s < e_rtn


def test_bad_inputs():
    with pytest.raises(QuantizationError, match="multiple of 32"):
        F.pack("q4_0", np.zeros((4, 40), np.float32))
    with pytest.raises(QuantizationError, match="NaN"):
        F.pack("q4_0", np.full((4, 32), np.nan, np.float32))
    with pytest.raises(QuantizationError, match="unsupported format"):
        F.pack("q3_k", np.zeros((4, 32), np.float32))


def test_q4_0_to_matmulnbits_lossless():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((16, 96)).astype(np.float32)
    raw = F.pack("q4_0", w)
    packed, scales = F.q4_0_to_matmulnbits(raw)
    assert packed.shape == (16, 3, 16) and packed.dtype == np.uint8 and scales.shape == (16, 3)
    lo, hi = packed & 15, packed >> 4
    q = np.stack([lo, hi], axis=-1).reshape(16, 3, 32).astype(np.float32)   # element 2i low, 2i+1 high
    deq = ((q - 8) * scales[..., None]).reshape(16, 96)
    np.testing.assert_array_equal(deq, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_0))


def test_q4_k_decodes_as_gguf_and_fits_better_than_q4_0():
    """Q4_K super-blocks: what we store decodes (gguf.quants, llama.cpp's reference decoder) to what
    fake_quant computes; zero and constant rows survive; the fit beats Q4_0's round-to-nearest."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((40, 512)).astype(np.float32) * 0.02
    w[0] = 0.0                                        # all zero
    w[1, :256] = 0.5                                  # a constant super-block
    w[2] += 0.05                                      # all positive (offset 0)
    w[3, ::9] *= 30                                   # outliers
    raw = F.pack("q4_k", w)
    assert raw.shape == (40, 2 * 144) and raw.dtype == np.uint8
    deq = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)
    np.testing.assert_array_equal(F.unpack("q4_k", raw), deq)
    np.testing.assert_array_equal(F.fake_quant("q4_k", w), deq)
    assert np.all(deq[0] == 0) and np.allclose(deq[1, :256], 0.5, rtol=1e-3)
    err_k = np.square(w - deq).mean(axis=1)                                   # [rows]
    err_0 = np.square(w - F.fake_quant("q4_0", w)).mean(axis=1)
    assert (err_k <= err_0).all() and err_k[4:].mean() < 0.8 * err_0[4:].mean()
    with pytest.raises(QuantizationError, match="multiple of 256"):
        F.pack("q4_k", w[:, :288])
    with pytest.raises(QuantizationError, match="searched block params"):
        F.pack("q4_k", w, F.rtn_params("q4_0", w))
