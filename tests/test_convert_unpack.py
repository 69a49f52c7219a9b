"""edgerun.convert's unpacking of published INT4 checkpoints against the writing libraries' own dequantization.

The fixtures in tests/fixtures/int4/ were written by AutoAWQ, compressed-tensors and auto-gptq
(tests/fixtures/make_int4_checkpoints.py); dequant.npz holds each library's dequantized weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgerun.convert import Int4Checkpoint
from edgerun.formats.arch import tensor_shape

FIX = Path(__file__).parent / "fixtures" / "int4"
ALL = sorted(p.name for p in FIX.iterdir() if (p / "config.json").is_file())


def modules(ckpt: Int4Checkpoint):
    """(GGUF name, HF module, [N, K]) of every quantized linear."""
    from edgerun.formats.arch import hf_name
    for n in ckpt.tensor_names():
        if ckpt.is_quantized(n):
            yield n, hf_name(ckpt.cfg, n).rsplit(".", 1)[0], tensor_shape(ckpt.cfg, n)


def codes_value(w) -> np.ndarray:
    """(q - z) * s in float64 (exact: 5-bit integer times an fp16/bf16 scale)."""
    gi = np.arange(w.q.shape[1]) // w.g if w.g_idx is None else w.g_idx
    return (w.q.astype(np.float64) - w.z[:, gi]) * w.s[:, gi].astype(np.float64)


def to_bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> nearest bf16 (ties to even), returned as float32."""
    u = np.asarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32)


def test_fixtures_are_there():
    assert {"awq-gemm-llama", "awq-gemm-qwen2", "awq-gemv-llama", "awq-gemvfast-llama", "ct-sym-llama",
            "ct-asym-qwen2", "gptq-llama", "gptq-actorder-llama"} <= set(ALL)


@pytest.mark.parametrize("name", ALL)
def test_unpacking_equals_the_library_dequantization(name):
    ckpt = Int4Checkpoint(FIX / name)
    lib = np.load(FIX / name / "dequant.npz")
    seen = 0
    for _, module, (N, K) in modules(ckpt):
        w = ckpt._int4(module, (N, K))
        ref = lib[module].astype(np.float32)                                      # [N, K]
        exact = codes_value(w)
        method = ckpt.scheme.method
        if method == "awq" or name == "ct-sym-llama":
            # the library computes (q - z) * s in fp16: one rounding of the exact value
            np.testing.assert_array_equal(exact.astype(np.float16).astype(np.float32), ref)
        elif name == "ct-asym-qwen2":
            np.testing.assert_array_equal(to_bf16(exact.astype(np.float32)), ref)   # ... in bf16
        else:
            # auto-gptq dequantizes with float32 scales; the checkpoint stores them in fp16
            s = w.s[:, np.arange(K) // w.g if w.g_idx is None else w.g_idx]
            assert np.all(np.abs(exact - ref) <= 16 * np.abs(s) * 2.0 ** -11 + 1e-7)
        if ckpt.scheme.version == "gemv_fast":                                    # its fp16 offset -s*z
            np.testing.assert_array_equal(w.m, (-(w.s * w.z.astype(np.float32))).astype(np.float16).astype(np.float32))
        assert w.q.max() <= 15 and w.z.max() <= 15
        seen += 1
    assert seen == len(lib.files) == 7 * ckpt.cfg.n_layer


def test_symmetric_checkpoints_have_zero_point_eight():
    for name in ("ct-sym-llama", "gptq-llama"):
        ckpt = Int4Checkpoint(FIX / name)
        for _, module, shape in modules(ckpt):
            w = ckpt._int4(module, shape)
            assert w.symmetric and np.all(w.z == 8)


def test_act_order_is_detected_and_dequantized_through_g_idx():
    ckpt = Int4Checkpoint(FIX / "gptq-actorder-llama")
    assert ckpt.scheme.desc_act
    for n, module, shape in modules(ckpt):
        w = ckpt._int4(module, shape)
        assert not w.blockwise and not ckpt.blockwise(n)
        assert sorted(np.bincount(w.g_idx)) == [w.g] * (shape[1] // w.g)   # every group holds g inputs
    plain = Int4Checkpoint(FIX / "gptq-llama")
    assert all(plain.blockwise(n) for n, _, _ in modules(plain))


def test_llama_q_k_rows_are_permuted_like_llama_cpp():
    from edgerun.formats.arch import permute_qk
    ckpt = Int4Checkpoint(FIX / "awq-gemm-llama")
    w = ckpt.weight("blk.0.attn_q.weight")
    hf = ckpt._int4("model.layers.0.self_attn.q_proj", tensor_shape(ckpt.cfg, "blk.0.attn_q.weight"))
    np.testing.assert_array_equal(w.dequantize(), permute_qk(hf.dequantize(), ckpt.cfg.n_head))
