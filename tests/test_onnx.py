"""ONNX path: export (lossless Q4_0/Q8_0 -> MatMulNBits), the onnxruntime backend against the numpy
reference and llama.cpp, rollback, speculative decoding over ONNX and across backends, bad input."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

import gguf  # noqa: E402

from edgerun.backends import open_backend# noqa: E402
from edgerun.backends.llamacpp import LlamaCppBackend# noqa: E402
from edgerun.backends.onnxrt import OnnxBackend, select_providers  # noqa: E402
from edgerun.backends.reference import ReferenceBackend# noqa: E402
from edgerun.config import BackendArgs, SamplingArgs# noqa: E402
from edgerun.errors import ContextOverflow, InvalidArgument, ModelFormatError, ModelNotFound# noqa: E402
from edgerun.generate import GenStats, generate# noqa: E402
from edgerun.onnx.layout import CONFIG_FILE, DATA_FILE, GENAI_CONFIG_FILE, GENAI_MODEL_FILE, MODEL_FILE, TOKENIZER_FILE, read_config
from edgerun.onnx.weights import NBits, nbits_dequantize, q8_0_to_nbits
from edgerun.onnx.export import export_onnx
from edgerun.speculative.drafters import ModelDrafter# noqa: E402
from edgerun.speculative.gamma import FixedGamma# noqa: E402
from edgerun.tokenizer import Tokenizer# noqa: E402

GREEDY = SamplingArgs(temperature=0)
ARGS = BackendArgs(n_ctx=256, n_threads=2, n_batch=16)
TEXT = "the cat is in the water, and the river is on the other side of the hill where she sat"


@pytest.fixture(scope="module")
def exports(tiny_model_factory, tmp_path_factory):
    """make(accuracy_level=4, **tiny_model_kwargs) -> (gguf path, export dir), cached per module."""
    root = tmp_path_factory.mktemp("onnx")
    cache: dict = {}

    def make(accuracy_level: int = 4, **kw):
        kw = {"wtype": "q4_0", **kw}
        key = (accuracy_level, tuple(sorted(kw.items())))
        if key not in cache:
            src = tiny_model_factory(**kw)
            cache[key] = (src, export_onnx(src, root / f"e{len(cache)}", n_ctx=256, accuracy_level=accuracy_level))
        return cache[key]

    return make


def tokens_of(backend, text=TEXT):
    return backend.tokenizer.tokenize(text, add_bos=False)


# ------------------------------------------------------------------------------------- export

def test_q8_0_to_matmulnbits_is_lossless():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 96)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    packed, scales = q8_0_to_nbits(raw)
    assert packed.shape == (48, 3, 32) and packed.dtype == np.uint8 and scales.shape == (48, 3)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).reshape(48, 96)
    np.testing.assert_array_equal(nbits_dequantize(NBits(8, packed, scales, "")), want)


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True)])
def test_export_layout_and_lossless_weights(exports, arch, tied):
    src, out = exports(arch=arch, tied=tied)
    for f in (MODEL_FILE, DATA_FILE, CONFIG_FILE, TOKENIZER_FILE, GENAI_CONFIG_FILE, GENAI_MODEL_FILE):
        assert (out / f).is_file(), f
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]   # no temp dirs left
    cfg = read_config(out)
    assert cfg.model.arch == arch and cfg.model.n_layer == 2 and cfg.model.n_head == 4 and cfg.model.n_head_kv == 2
    assert cfg.rope_style == ("norm" if arch == "llama" else "neox")
    # every weight came over without loss: Q4_0 -> int4 (block linears, embedding and head of the tiny model)
    assert cfg.lossless and set(cfg.conversions.values()) == {"Q4_0->int4 (lossless)"}
    assert ("output.weight" in cfg.conversions) == (not tied)
    # the vocabulary-only tokenizer GGUF tokenizes exactly like the source
    a, b = Tokenizer.from_gguf(src), Tokenizer.from_gguf(out / TOKENIZER_FILE)
    assert b.vocab_fingerprint == a.vocab_fingerprint == cfg.vocab_fingerprint
    assert b.tokenize(TEXT) == a.tokenize(TEXT) and b.chat_template == a.chat_template
    assert gguf.GGUFReader(out / TOKENIZER_FILE).tensors == []
    genai = json.loads((out / GENAI_CONFIG_FILE).read_text())
    dec = genai["model"]["decoder"]
    assert dec["filename"] == GENAI_MODEL_FILE and dec["num_key_value_heads"] == 2
    assert dec["inputs"]["past_key_names"] == "past_key_values.%d.key"


def test_export_graph_uses_the_contrib_ops(exports):
    import onnx

    _, out = exports(arch="llama")
    m = onnx.load(str(out / MODEL_FILE), load_external_data=False)
    ops = [n.op_type for n in m.graph.node]
    assert ops.count("MatMulNBits") == 2 * 4 + 1        # per layer: fused QKV, output, gate|up, down; + head
    assert ops.count("GroupQueryAttention") == 2 and "GatherBlockQuantized" in ops
    mm = [n for n in m.graph.node if n.op_type == "MatMulNBits"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in mm[0].attribute}
    assert attrs["bits"] == 4 and attrs["block_size"] == 32 and attrs["accuracy_level"] == 4
    assert len(mm[0].input) == 3                         # no zero points
    names = [i.name for i in m.graph.input]
    assert names[:4] == ["input_ids", "attention_mask", "past_key_values.0.key", "past_key_values.0.value"]
    assert [o.name for o in m.graph.output][:3] == ["logits", "present.0.key", "present.0.value"]


def test_export_requantizes_float_weights_and_says_so(tiny_model_factory, tmp_path, caplog):
    src = tiny_model_factory(arch="llama", wtype="f32")
    with caplog.at_level(logging.WARNING, logger="edgerun.onnx"):
        out = export_onnx(src, tmp_path / "e", n_ctx=64)
    cfg = read_config(out)
    assert not cfg.lossless
    assert cfg.conversions["blk.0.attn_q.weight"] == "F32->Q4_0->int4 (requantized)"
    assert cfg.conversions["token_embd.weight"] == "F32->Q8_0->int8 (requantized)"
    assert any("re-quantized" in r.getMessage() for r in caplog.records)


def test_export_refuses_to_overwrite_unless_forced(exports, tiny_model_factory, tmp_path):
    src = tiny_model_factory(arch="llama", wtype="q4_0")
    out = export_onnx(src, tmp_path / "e", n_ctx=64)
    with pytest.raises(InvalidArgument, match="already exists"):
        export_onnx(src, out, n_ctx=64)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("mine")
    with pytest.raises(InvalidArgument, match="already exists"):
        export_onnx(src, tmp_path / "other", n_ctx=64, force=True)     # not an export: never replaced
    assert (tmp_path / "other" / "keep.txt").read_text() == "mine"
    export_onnx(src, out, n_ctx=128, force=True)
    assert read_config(out).n_ctx == 128
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e", "other"]
    with pytest.raises(ModelNotFound):
        export_onnx(tmp_path / "missing.gguf", tmp_path / "x")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelFormatError):
        export_onnx(bad, tmp_path / "y")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


# ------------------------------------------------------------------------------------- parity

@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True)])
def test_fp32_graph_matches_numpy_reference(exports, arch, tied):
    """accuracy_level 1 computes with the exact dequantized weights: the numpy oracle to float32 precision."""
    src, out = exports(accuracy_level=1, arch=arch, tied=tied)
    onnx_b = OnnxBackend(out, ARGS)
    ref = ReferenceBackend(src)
    toks = tokens_of(onnx_b)
    assert len(toks) > ARGS.n_batch                      # prefill is chunked
    a, r = onnx_b.eval(toks), ref.eval(toks)
    np.testing.assert_allclose(a, r, atol=1e-4 * np.abs(r).max(), rtol=0)
    # and decoding one token at a time with the cache gives the same
    a2 = onnx_b.eval([7]), ref.eval([7])
    np.testing.assert_allclose(a2[0], a2[1], atol=1e-4 * np.abs(r).max(), rtol=0)
    onnx_b.close()


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True)])
def test_int8_activation_graph_matches_llamacpp_and_reference(exports, arch, tied):
    """accuracy_level 4 (int8 activations, like llama.cpp's Q8_0 activations): same argmax as both."""
    src, out = exports(arch=arch, tied=tied)
    onnx_b = OnnxBackend(out, ARGS)
    lcpp = LlamaCppBackend(src, ARGS)
    ref = ReferenceBackend(src)
    toks = tokens_of(onnx_b)
    a, l, r = onnx_b.eval(toks), lcpp.eval(toks), ref.eval(toks)
    scale = np.abs(r).max()
    assert np.abs(a - r).max() < 0.05 * scale
    assert np.abs(a - l).max() < 0.05 * scale
    assert (a.argmax(1) == r.argmax(1)).mean() >= 0.95
    assert (a.argmax(1) == l.argmax(1)).mean() >= 0.95
    onnx_b.close()
    lcpp.close()


def test_logit_selection_and_context_limits(exports):
    _, out = exports(arch="llama")
    b = OnnxBackend(out, BackendArgs(n_ctx=64, n_threads=2, n_batch=8))
    toks = tokens_of(b)[:30]
    full = b.eval(toks)
    assert full.shape == (30, b.n_vocab) and full.dtype == np.float32 and b.n_past == 30
    b.truncate(0)
    np.testing.assert_array_equal(b.eval(toks, n_logits=3), full[-3:])
    b.truncate(0)
    none = b.eval(toks, n_logits=0)
    assert none.shape == (0, b.n_vocab) and b.n_past == 30
    with pytest.raises(ContextOverflow):
        b.eval([5] * 40)
    assert b.n_past == 30
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        b.eval([b.n_vocab])
    with pytest.raises(InvalidArgument):
        b.truncate(-1)
    assert b.eval([]).shape == (0, b.n_vocab)
    b.close()


def test_step_inputs_bound_once_follow_every_step(exports):
    """input_ids/num_logits_to_keep stay bound between steps of one length (values written in place):
    a walk of mixed lengths, logit counts and rollbacks matches the numpy reference at every step."""
    src, out = exports(accuracy_level=1, arch="llama")
    b, ref = OnnxBackend(out, ARGS), ReferenceBackend(src)
    toks = tokens_of(b) * 3
    assert len(toks) >= 40
    scale = np.abs(ref.eval(toks[:4])).max()
    b.eval(toks[:4], n_logits=0)
    returned = []
    for n, k, back in [(1, None, 0), (1, None, 0), (1, 1, 0), (3, None, 0), (3, 1, 2), (1, 0, 0), (1, None, 1),
                       (2, 2, 0), (1, None, 0), (20, 5, 0), (1, None, 0)]:
        chunk = toks[b.n_past:b.n_past + n]
        got, want = b.eval(chunk, n_logits=k), ref.eval(chunk, n_logits=k)
        assert got.shape == want.shape and b.n_past == ref.n_past
        np.testing.assert_allclose(got, want, atol=1e-4 * scale, rtol=0)
        returned.append((got, got.copy()))
        b.truncate(b.n_past - back)
        ref.truncate(ref.n_past - back)
    for got, snapshot in returned:                # each eval returned its own array: later steps left it alone
        np.testing.assert_array_equal(got, snapshot)
    b.close()


def test_truncate_and_reeval_equals_fresh_run(exports):
    _, out = exports(arch="qwen2", tied=True)
    toks = tokens_of(OnnxBackend(out, ARGS))
    fresh = OnnxBackend(out, ARGS)
    f1 = fresh.eval(toks[:9])
    f2 = fresh.eval(toks[9:])
    b = OnnxBackend(out, ARGS)
    b.eval(toks[:9], n_logits=0)
    b.eval([3, 4, 5, 6, 7, 8])                    # wander off (overwrites cache rows 9..14) ...
    b.truncate(9)                                 # ... and roll back
    assert b.n_past == 9 and b.tokens == toks[:9]
    np.testing.assert_array_equal(b.eval(toks[9:]), f2)     # identical computation: identical bits
    b.truncate(0)
    np.testing.assert_array_equal(b.eval(toks[:9]), f1)
    # a different chunking only moves float32 rounding
    b.truncate(0)
    whole = b.eval(toks)
    np.testing.assert_allclose(whole, np.concatenate([f1, f2]), atol=0.05 * np.abs(whole).max())


def test_n_ctx_is_capped_at_the_exported_context(exports, caplog):
    _, out = exports(arch="llama")
    with caplog.at_level(logging.INFO, logger="edgerun.backends.onnxrt"):
        b = OnnxBackend(out, BackendArgs(n_ctx=4096, n_threads=1))
    assert b.n_ctx == 256 and any("exported for" in r.getMessage() for r in caplog.records)
    b.close()


# ------------------------------------------------------------------------------------- speculative decoding

def _generate(target, prompt, drafter=None, gamma=0, n=24):
    stats = GenStats()
    steps = list(generate(target, prompt, GREEDY, max_tokens=n, drafter=drafter, policy=FixedGamma(gamma),
                          rng=np.random.default_rng(0), stats=stats))
    return [s.token for s in steps], stats


def test_greedy_speculative_equals_greedy_plain_on_onnx(exports):
    _, out = exports(arch="llama", seed=0)
    _, out_d = exports(arch="llama", seed=1)           # another model of the same vocabulary as drafter
    target = OnnxBackend(out, ARGS)
    prompt = tokens_of(target, "the cat is in the")
    plain, _ = _generate(target, prompt)
    drafter = ModelDrafter(OnnxBackend(out_d, ARGS), target)
    spec, stats = _generate(target, prompt, drafter, gamma=4)
    assert spec == plain
    assert stats.n_drafted > 0
    self_drafter = ModelDrafter(OnnxBackend(out, ARGS), target)   # the target as its own drafter
    spec2, stats2 = _generate(target, prompt, self_drafter, gamma=3)
    assert spec2 == plain and stats2.acceptance_rate > 0.8


def test_target_and_drafter_on_different_backends(exports):
    src, out = exports(arch="qwen2", tied=True)
    src_d, out_d = exports(arch="qwen2", tied=True, seed=3)
    prompt = Tokenizer.from_gguf(src).tokenize("the river is", add_bos=False)
    # ONNX target, llama.cpp drafter
    t_onnx = OnnxBackend(out, ARGS)
    plain_onnx, _ = _generate(t_onnx, prompt)
    spec, st = _generate(t_onnx, prompt, ModelDrafter(LlamaCppBackend(src_d, ARGS), t_onnx), gamma=3)
    assert spec == plain_onnx and st.n_drafted > 0
    # llama.cpp target, ONNX drafter
    t_l = LlamaCppBackend(src, ARGS)
    plain_l, _ = _generate(t_l, prompt)
    spec, st = _generate(t_l, prompt, ModelDrafter(OnnxBackend(out_d, ARGS), t_l), gamma=3)
    assert spec == plain_l and st.n_drafted > 0


def test_export_dir_works_wherever_a_model_is_accepted(exports):
    import edgerun

    _, out = exports(arch="llama")
    b = open_backend(out, ARGS)
    assert isinstance(b, OnnxBackend)
    b.close()
    rt = edgerun.load(str(out), draft=str(out), n_ctx=128, n_threads=2, gamma=2, pull=False)
    try:
        c = rt.generate("the cat", max_tokens=8, temperature=0)
        assert c.n_tokens == 8 or c.finish_reason in ("eos", "stop")
        assert c.stats.n_drafted > 0
    finally:
        rt.close()


# ------------------------------------------------------------------------------------- bad input

def _copy(out: Path, dst: Path) -> Path:
    shutil.copytree(out, dst)
    return dst


def test_missing_or_mismatched_config(exports, tmp_path):
    _, out = exports(arch="llama")
    d = _copy(out, tmp_path / "noconf")
    (d / CONFIG_FILE).unlink()
    with pytest.raises(ModelFormatError, match="has no edgerun.json"):
        OnnxBackend(d, ARGS)

    d = _copy(out, tmp_path / "badjson")
    (d / CONFIG_FILE).write_text("{not json")
    with pytest.raises(ModelFormatError, match="not valid JSON"):
        OnnxBackend(d, ARGS)

    for key, value, msg in (("vocab_fingerprint", "0" * 64, "does not match"),
                            ("format_version", 99, "format_version"),
                            ("n_head_kv", 4, "past_key_values.0.key has shape"),
                            ("n_head_kv", 3, "must be a multiple of n_head_kv"),
                            ("n_layer", 3, "lacks"),
                            ("surprise", 1, "unknown keys")):
        d = _copy(out, tmp_path / f"bad_{key}_{value}")
        conf = json.loads((d / CONFIG_FILE).read_text())
        conf[key] = value
        (d / CONFIG_FILE).write_text(json.dumps(conf))
        with pytest.raises(ModelFormatError, match=msg):
            OnnxBackend(d, ARGS)

    d = _copy(out, tmp_path / "notok")
    (d / TOKENIZER_FILE).unlink()
    with pytest.raises(ModelFormatError, match="lacks tokenizer.gguf"):
        OnnxBackend(d, ARGS)
    with pytest.raises(ModelNotFound):
        OnnxBackend(tmp_path / "nowhere", ARGS)


def test_graph_without_the_expected_inputs(exports, tmp_path):
    import onnx
    from onnx import TensorProto, helper

    _, out = exports(arch="llama")
    d = _copy(out, tmp_path / "wronggraph")
    g = helper.make_graph([helper.make_node("Identity", ["x"], ["logits"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 4])])
    onnx.save_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
                    str(d / MODEL_FILE))
    with pytest.raises(ModelFormatError, match="input_ids"):
        OnnxBackend(d, ARGS)
    (d / MODEL_FILE).write_bytes(b"garbage")
    with pytest.raises(ModelFormatError, match="cannot load"):
        OnnxBackend(d, ARGS)


def test_unavailable_execution_provider_falls_back_with_a_log_line(exports, caplog):
    assert select_providers(["cuda", "CPUExecutionProvider"], available=["CPUExecutionProvider"]) == \
        ["CPUExecutionProvider"]
    assert select_providers(["TensorrtExecutionProvider", "CUDAExecutionProvider"],
                            available=["CUDAExecutionProvider", "CPUExecutionProvider"]) == \
        ["CUDAExecutionProvider", "CPUExecutionProvider"]
    _, out = exports(arch="llama")
    with caplog.at_level(logging.WARNING, logger="edgerun.backends.onnxrt"):
        b = OnnxBackend(out, BackendArgs(n_ctx=64, n_threads=1,
                                         providers=("CoreMLExecutionProvider", "CPUExecutionProvider")))
    msgs = [r.getMessage() for r in caplog.records]
    assert any("'CoreMLExecutionProvider' is not available" in m for m in msgs)
    assert b.providers == ["CPUExecutionProvider"]
    assert b.eval(tokens_of(b)[:4]).shape == (4, b.n_vocab)
    b.close()


def test_cli_export_then_generate_from_the_directory(tiny_model_factory, tmp_path):
    from click.testing import CliRunner

    from edgerun.cli import main

    src = tiny_model_factory(arch="llama", wtype="q4_0")
    out = tmp_path / "cli_export"
    r = CliRunner().invoke(main, ["export", "onnx", str(src), str(out), "--ctx", "128"])
    assert r.exit_code == 0, r.output
    assert "all weights converted without loss" in r.output and read_config(out).n_ctx == 128
    r = CliRunner().invoke(main, ["export", "onnx", str(src), str(out)])
    assert r.exit_code == 2 and "error:" in r.output and "already exists" in r.output
    r = CliRunner().invoke(main, ["generate", "the cat", "--model", str(out), "--draft", str(out), "--gamma", "2",
                                  "-n", "6", "-t", "0", "--ctx", "64", "--threads", "1", "--json", "--no-pull"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output.strip().splitlines()[-1])
    assert res["n_tokens"] >= 1 and res["n_drafted"] > 0
    r = CliRunner().invoke(main, ["generate", "x", "--model", str(tmp_path), "--no-pull"])
    assert r.exit_code == 2 and "model.onnx" in r.output
