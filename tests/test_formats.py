"""quant/formats.py: byte-exact vs gguf.quants, fake-quant == decode(pack), searched d/m never worse."""

import gguf
import numpy as np
import pytest

from edgerun.errors import QuantizationError
from edgerun.quant import formats as F

QT = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "q4_1": gguf.GGMLQuantizationType.Q4_1,
      "q8_0": gguf.GGMLQuantizationType.Q8_0}


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


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1"])
@pytest.mark.parametrize("weighting", ["none", "diag", "gram"])
def test_search_never_worse_and_stored_exactly(fmt, weighting):
    rng = np.random.default_rng(1)
    w = _weights(rng)
    nb = w.shape[1] // 32
    x = rng.standard_normal((500, w.shape[1])).astype(np.float32) * np.exp(rng.standard_normal(w.shape[1]))
    weight = {"none": None, "diag": (x * x).mean(0),
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
