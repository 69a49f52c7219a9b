"""edgerun convert: GGUF blocks that keep the published codes, ONNX MatMulNBits, logits vs the numpy reference.

Fixtures: tests/fixtures/int4/ (written by AutoAWQ, compressed-tensors, auto-gptq; see make_int4_checkpoints.py).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from edgerun.convert import Int4Checkpoint, convert
from edgerun.formats.arch import hf_name, permute_qk
from edgerun.formats.gguf import read_edgerun_metadata
from edgerun.quant.blocks import encode_codes

FIX = Path(__file__).parent / "fixtures" / "int4"
ALL = sorted(p.name for p in FIX.iterdir() if (p / "config.json").is_file())
BLOCKWISE = [n for n in ALL if n != "gptq-actorder-llama"]
T = gguf.GGMLQuantizationType


def exact_value(w) -> np.ndarray:
    """(q - z) * s in float64, per element (GGUF layout)."""
    gi = np.arange(w.q.shape[1]) // w.g if w.g_idx is None else w.g_idx
    return (w.q.astype(np.float64) - w.z[:, gi]) * w.s[:, gi].astype(np.float64)


def per_element_scale(w) -> np.ndarray:
    gi = np.arange(w.q.shape[1]) // w.g if w.g_idx is None else w.g_idx
    return np.abs(w.s[:, gi]).astype(np.float64)


def read_tensors(path: Path) -> dict[str, tuple]:
    r = gguf.GGUFReader(path)
    return {t.name: (t.tensor_type, np.asarray(t.data), tuple(int(x) for x in reversed(t.shape))) for t in r.tensors}


# ----------------------------------------------------------------------------- GGUF blocks

def test_encode_codes_matches_gguf_quants_for_q4_0_q4_1_q5_0():
    rng = np.random.default_rng(0)
    rows, K = 3, 64
    d = rng.uniform(0.01, 0.1, (rows, K // 32)).astype(np.float16)
    m = rng.uniform(-1, 0, (rows, K // 32)).astype(np.float16)
    df, mf = np.repeat(d.astype(np.float32), 32, 1), np.repeat(m.astype(np.float32), 32, 1)
    q4 = rng.integers(0, 16, (rows, K)).astype(np.uint8)
    q5 = rng.integers(0, 32, (rows, K)).astype(np.uint8)
    for fmt, q, want in (("q4_0", q4, (q4.astype(np.float32) - 8) * df), ("q4_1", q4, q4 * df + mf),
                         ("q5_0", q5, (q5.astype(np.float32) - 16) * df)):
        raw = encode_codes(fmt, q, d, m if fmt == "q4_1" else None)
        got = gguf.quants.dequantize(raw, getattr(T, fmt.upper())).reshape(rows, K)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", BLOCKWISE)
@pytest.mark.parametrize("exact", [False, True])
def test_gguf_blocks_keep_the_published_weights(name, exact, tmp_path):
    ckpt = Int4Checkpoint(FIX / name)
    out = tmp_path / "m.gguf"
    rep = convert(FIX / name, out, exact=exact)
    tensors = read_tensors(out)
    n_blocks = n_exact = 0
    for n in ckpt.tensor_names():
        ttype, raw, shape = tensors[n]
        if not ckpt.is_quantized(n):
            assert ttype in (T.F16, T.F32)
            np.testing.assert_array_equal(np.asarray(raw, np.float32).reshape(shape),
                                          ckpt.weight(n).astype(np.float16 if ttype == T.F16 else np.float32))
            continue
        w = ckpt.weight(n)
        want = exact_value(w)
        got = gguf.quants.dequantize(raw, ttype).astype(np.float64).reshape(shape)   # llama.cpp's reference
        sym = ckpt.scheme.groups[0].symmetric
        expect = T.Q4_0 if sym else (T.Q5_0 if exact and w.m is None else T.Q4_1)
        assert ttype == expect, (n, ttype)
        if ttype in (T.Q4_0, T.Q5_0):
            np.testing.assert_array_equal(got, want)                            # bit-exact
        elif w.m is not None:                                                   # GEMV_fast: its own q*s + m
            np.testing.assert_array_equal(got, w.dequantize().astype(np.float64))
        else:
            rel = np.abs(got - want) / per_element_scale(w)
            assert rel.max() <= 0.0073                                          # half an fp16 ulp of m = -z*s
            blocks = (np.abs(got - want).reshape(shape[0], -1, 32).max(-1) == 0)
            n_blocks += blocks.size
            n_exact += int(blocks.sum())
    if n_blocks:
        assert rep.n_blocks == n_blocks and rep.n_exact == n_exact             # the report says what is in the file
        assert 0 < rep.exact_share < 1 or rep.exact_share == 1
    else:
        assert rep.exact_share == 1.0 and rep.max_rel_err == 0
    meta = read_edgerun_metadata(out)
    assert meta["edgerun.quant.method"] == "import"
    assert meta["edgerun.import.source_format"] == ckpt.scheme.label
    assert meta["edgerun.import.group_size"] == ckpt.scheme.groups[0].group_size
    assert meta["edgerun.import.zero_point"] == ("symmetric" if ckpt.scheme.groups[0].symmetric else "asymmetric")
    assert meta["edgerun.source.sha256"] == ckpt.sha256()
    assert "blk.0.attn_q.weight=" + rep.tensors[0]["stored"] in meta["edgerun.import.storage"]


def test_q4_1_mirrored_encoding_is_used_where_it_is_exact(tmp_path):
    """AutoAWQ's asymmetric fixture has blocks whose -z*s is not an fp16 value but (15 - z)*s is."""
    ckpt = Int4Checkpoint(FIX / "awq-gemm-qwen2")
    out = tmp_path / "m.gguf"
    convert(FIX / "awq-gemm-qwen2", out)
    ttype, raw, shape = read_tensors(out)["blk.0.ffn_up.weight"]
    w = ckpt.weight("blk.0.ffn_up.weight")
    d = raw.reshape(shape[0], -1, 20)[..., :2].copy().view(np.float16)[..., 0]      # [N, nb]
    s = np.repeat(w.s, w.g // 32, axis=1)
    assert (d < 0).any() and (d > 0).any()                                         # both encodings occur
    np.testing.assert_array_equal(np.abs(d.astype(np.float32)), s)
    z = np.repeat(w.z, w.g // 32, axis=1).astype(np.float64)
    plain_exact = (-z * s).astype(np.float16).astype(np.float64) == -z * s
    mirror_exact = ((15 - z) * s).astype(np.float16).astype(np.float64) == (15 - z) * s
    assert ((d < 0) <= (mirror_exact & ~plain_exact) | ~plain_exact).all()
    assert (mirror_exact & ~plain_exact).any()


def test_act_order_gptq_is_stored_f16_with_a_warning(tmp_path, caplog):
    out = tmp_path / "m.gguf"
    with caplog.at_level("WARNING"):
        rep = convert(FIX / "gptq-actorder-llama", out)
    assert rep.storage == {"f16": 7} and len(rep.f16_tensors) == 7
    assert "blk.0.attn_q.weight" in caplog.text and "act-order" in caplog.text
    ckpt = Int4Checkpoint(FIX / "gptq-actorder-llama")
    ttype, raw, shape = read_tensors(out)["blk.0.ffn_down.weight"]
    assert ttype == T.F16
    np.testing.assert_array_equal(raw.reshape(shape), ckpt.weight("blk.0.ffn_down.weight").dequantize().astype(np.float16))


# ----------------------------------------------------------------------------- ONNX

def _matmulnbits_probe(nb, K: int, N: int) -> np.ndarray:
    """Run one MatMulNBits (fp32 activations) on the identity: returns W^T [K, N] as onnxruntime computes it."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(nb.packed, "B"), numpy_helper.from_array(nb.scales, "S"),
             numpy_helper.from_array(nb.zeros, "Z")]
    node = helper.make_node("MatMulNBits", ["X", "B", "S", "Z"], ["Y"], domain="com.microsoft", K=K, N=N, bits=4,
                            block_size=nb.block, accuracy_level=1)
    g = helper.make_graph([node], "probe", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [K, K])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [K, N])], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 8
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"X": np.eye(K, dtype=np.float32)})[0]


@pytest.mark.parametrize("name", [n for n in BLOCKWISE if n != "awq-gemvfast-llama"])
def test_matmulnbits_reproduces_q_minus_z_times_s_exactly(name):
    pytest.importorskip("onnxruntime")
    from edgerun.convert.onnx_view import int4_to_nbits
    from edgerun.onnx.weights import nbits_dequantize

    ckpt = Int4Checkpoint(FIX / name)
    for n in ("blk.0.attn_v.weight", "blk.0.ffn_down.weight"):
        w = ckpt.weight(n)
        N, K = w.q.shape
        nb = int4_to_nbits(w, "probe")
        assert nb.block == w.g and nb.zeros is not None
        want = exact_value(w).astype(np.float32)                          # exact in float32
        np.testing.assert_array_equal(nbits_dequantize(nb), want)
        np.testing.assert_array_equal(_matmulnbits_probe(nb, K, N).T, want)


def test_onnx_export_of_a_checkpoint_is_lossless_for_its_linears(tmp_path):
    pytest.importorskip("onnxruntime")
    from edgerun.onnx.layout import read_config

    out = tmp_path / "onnx"
    rep = convert(FIX / "awq-gemm-qwen2", out, accuracy_level=1)
    cfg = read_config(out)
    assert rep.kind == "onnx" and cfg.metadata["edgerun.import.source_format"] == "awq/gemm"
    lin = {k: v for k, v in cfg.conversions.items() if k.startswith("blk.")}
    assert len(lin) == 14 and all(v == "awq/gemm->int4 g128 (lossless)" for v in lin.values())


# ----------------------------------------------------------------------------- logits

def reference_weights(name: str, embed=None) -> tuple:
    """(cfg, GGUF-named float tensors) with every quantized linear taken from the library's dequantization."""
    ckpt = Int4Checkpoint(FIX / name)
    lib = np.load(FIX / name / "dequant.npz")
    cfg = ckpt.cfg
    t = {}
    for n in ckpt.tensor_names():
        if ckpt.is_quantized(n):
            a = lib[hf_name(cfg, n).rsplit(".", 1)[0]].astype(np.float32)
            if cfg.spec.permute_qk and (".attn_q." in n or ".attn_k." in n):
                a = permute_qk(a, cfg.n_head if ".attn_q." in n else cfg.n_head_kv)
            t[n] = a
        else:
            t[n] = ckpt.weight(n)
    if embed is not None:
        t["token_embd.weight"] = embed(t["token_embd.weight"])
        if "output.weight" in t:
            t["output.weight"] = embed(t["output.weight"])
    return cfg, t


TOKENS = [5, 77, 200, 31, 9, 150, 300, 42, 8, 260, 111, 17]


def _llamacpp_logits(path: Path) -> np.ndarray:
    from edgerun.backends.llamacpp import LlamaCppBackend
    from edgerun.config import BackendArgs

    be = LlamaCppBackend(path, BackendArgs(n_ctx=64, n_threads=1))
    try:
        return be.eval(TOKENS)
    finally:
        be.close()


def _err(a: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(max, mean) |a - ref| relative to the reference logits' standard deviation."""
    d = np.abs(a - ref) / ref.std()
    return float(d.max()), float(d.mean())


@pytest.mark.parametrize("name,exact", [("awq-gemm-llama", False), ("awq-gemm-llama", True), ("awq-gemm-qwen2", True),
                                        ("ct-sym-llama", False), ("ct-asym-qwen2", False), ("gptq-llama", False)])
def test_imported_gguf_logits_match_the_reference_on_the_library_weights(name, exact, tmp_path):
    from edgerun.reference.llama import ReferenceModel

    cfg, t = reference_weights(name)
    ref = ReferenceModel.from_weights(cfg, t).forward(TOKENS)
    out = tmp_path / "m.gguf"
    convert(FIX / name, out, exact=exact)
    # 1. the file's weights (dequantized by gguf.quants) give the library's logits: the library rounds its
    #    dequantized weights to fp16 (bf16 for the compressed-tensors asym fixture), the file keeps them exact
    in_file = ReferenceModel.from_gguf(out).forward(TOKENS)
    assert _err(in_file, ref)[0] < (3e-2 if name == "ct-asym-qwen2" else 5e-3)
    # 2. llama.cpp runs the file like the reference does (its dot products quantize activations to 8 bits)
    got = _llamacpp_logits(out)
    mx, mean = _err(got, in_file)
    assert mx < 0.15 and mean < 0.02, (mx, mean)
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_logit_comparison_can_fail(tmp_path):
    """Control: the same bounds reject a llama import whose Q/K rows were not permuted for llama.cpp."""
    from edgerun.formats.arch import unpermute_qk
    from edgerun.reference.llama import ReferenceModel

    cfg, t = reference_weights("awq-gemm-llama")
    for n in list(t):
        if ".attn_q." in n or ".attn_k." in n:
            t[n] = unpermute_qk(t[n], cfg.n_head if ".attn_q." in n else cfg.n_head_kv)
    wrong = ReferenceModel.from_weights(cfg, t).forward(TOKENS)
    out = tmp_path / "m.gguf"
    convert(FIX / "awq-gemm-llama", out, exact=True)
    mx, mean = _err(_llamacpp_logits(out), wrong)
    assert mx > 0.15 or mean > 0.02


def test_imported_onnx_logits_match_the_reference(tmp_path):
    pytest.importorskip("onnxruntime")
    from edgerun.backends.onnxrt import OnnxBackend
    from edgerun.config import BackendArgs
    from edgerun.quant.blocks import fake_quant
    from edgerun.reference.llama import ReferenceModel

    name = "awq-gemm-qwen2"
    ckpt = Int4Checkpoint(FIX / name)
    # the checkpoint's exact weights (q - z) * s; the exporter stores the float embedding / head as Q8_0
    # (noted in edgerun.json), and so does this reference
    t = {n: ckpt.tensor(n) for n in ckpt.tensor_names()}
    for n in ("token_embd.weight", "output.weight"):
        t[n] = fake_quant("q8_0", t[n])
    ref = ReferenceModel.from_weights(ckpt.cfg, t).forward(TOKENS)
    _, tl = reference_weights(name, embed=lambda a: fake_quant("q8_0", a))
    lib = ReferenceModel.from_weights(ckpt.cfg, tl).forward(TOKENS)
    assert _err(lib, ref)[0] < 5e-3                       # the library's fp16-rounded weights: the same model
    out = tmp_path / "onnx"
    convert(FIX / name, out, accuracy_level=1, n_ctx=64)  # fp32 activations: the exact product
    be = OnnxBackend(out, BackendArgs(n_ctx=64, n_threads=1))
    try:
        got = be.eval(TOKENS)
    finally:
        be.close()
    assert _err(got, ref)[0] < 1e-4
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_onnx_of_act_order_gptq_is_requantized_and_says_so(tmp_path):
    pytest.importorskip("onnxruntime")
    from edgerun.onnx.layout import read_config

    out = tmp_path / "onnx"
    convert(FIX / "gptq-actorder-llama", out)
    conv = read_config(out).conversions
    assert conv["blk.0.attn_q.weight"] == "float->Q4_0->int4 (requantized)"


def test_public_api_is_callable(tmp_path):
    import edgerun
    import edgerun.convert.converted  # noqa: F401  (importing a submodule keeps edgerun.convert callable)

    rep = edgerun.convert(FIX / "ct-sym-llama", tmp_path / "m.gguf")
    assert rep.storage == {"q4_0": 7} and (tmp_path / "m.gguf").is_file()


# ----------------------------------------------------------------------------- tokenizer


def test_pre_tokenizer_is_read_from_tokenizer_json(caplog):
    from edgerun.formats.hf import pre_tokenizer_type

    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    assert pre_tokenizer_type({"pre_tokenizer": byte_level}, "default") == "gpt-2"
    smol = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level]}
    assert pre_tokenizer_type({"pre_tokenizer": smol}, "default") == "smollm"
    qwen = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}"
                                               r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"}, "behavior": "Isolated"},
        {**byte_level, "use_regex": False}]}
    assert pre_tokenizer_type({"pre_tokenizer": qwen}, "default") == "qwen2"
    llama3 = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"},
         "behavior": "Isolated"}, {**byte_level, "use_regex": False}]}
    assert pre_tokenizer_type({"pre_tokenizer": llama3}, "default") == "llama-bpe"
    with caplog.at_level("WARNING"):
        assert pre_tokenizer_type({"pre_tokenizer": {"type": "Whitespace"}}, "qwen2") == "qwen2"
    assert "not one edgerun recognises" in caplog.text


def test_imported_smollm_tokenizer_splits_digits_like_its_own(tmp_path):
    """A SmolLM-style tokenizer.json (single digits, then byte-level) gets llama.cpp's 'smollm' pre-tokenizer:
    every digit of a number is its own token, as the checkpoint's tokenizer splits it."""
    import json
    import shutil

    from edgerun.backends.llamacpp import LlamaCppBackend
    from edgerun.config import BackendArgs

    src = tmp_path / "ckpt"
    shutil.copytree(FIX / "awq-gemm-llama", src)
    tj = json.loads((src / "tokenizer.json").read_text())
    tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                                 tj["pre_tokenizer"]]}
    (src / "tokenizer.json").write_text(json.dumps(tj))
    out = tmp_path / "m.gguf"
    convert(src, out)
    assert gguf.GGUFReader(out).get_field("tokenizer.ggml.pre").contents() == "smollm"
    be = LlamaCppBackend(out, BackendArgs(n_ctx=64, n_threads=1))
    try:
        ids = be.tokenizer.tokenize("x 20241231", special=False, add_bos=False)
        assert [be.tokenizer.token_bytes(i) for i in ids][-8:] == [c.encode() for c in "20241231"]
    finally:
        be.close()
