"""`edgerun convert` and `--model DIR`: transcripts, every bad input -> one `error:` line, exit 2, no output file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import load_file, save_file

from edgerun.cli import main

FIX = Path(__file__).parent / "fixtures" / "int4"


@pytest.fixture
def runner():
    return CliRunner()


def copy(name: str, tmp_path: Path) -> Path:
    d = tmp_path / name
    shutil.copytree(FIX / name, d)
    return d


def edit_config(d: Path, fn) -> None:
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def edit_tensors(d: Path, fn) -> None:
    f = d / "model.safetensors"
    t = load_file(f)
    fn(t)
    save_file(t, f)


def edit_raw_tensors(d: Path, fn) -> None:
    """Like edit_tensors for files numpy's safetensors cannot load (bf16): {name: (dtype, array)} edited, written
    back in the safetensors layout (8-byte header length, JSON header, data)."""
    from edgerun.formats.hf import SafetensorsFiles
    f = d / "model.safetensors"
    st = SafetensorsFiles([f])
    t = {n: (e.dtype, np.array(st.raw(n))) for n, e in st.index.items()}
    del st
    fn(t)
    names = {np.dtype(np.int8): "I8", np.dtype(np.int32): "I32"}
    header, blobs, off = {}, [], 0
    for n, (dt, a) in t.items():
        dt = names.get(a.dtype, dt)
        b = np.ascontiguousarray(a).tobytes()
        header[n] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    f.write_bytes(len(h).to_bytes(8, "little") + h + b"".join(blobs))


def refused(runner, src: Path, out: Path, message: str, *args) -> None:
    r = runner.invoke(main, ["convert", str(src), str(out), *args])
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("error: ") and message in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output
    assert not out.exists() and not list(out.parent.glob(f".{out.name}*"))       # nothing half-written


def test_convert_cli_reports_storage_and_exactness(runner, tmp_path):
    out = tmp_path / "m.gguf"
    r = runner.invoke(main, ["convert", str(FIX / "awq-gemm-qwen2"), str(out)])
    assert r.exit_code == 0, r.output
    assert "awq/gemm g128 asymmetric; 14 q4_1" in r.output and "blocks bit-exact" in r.output
    r = runner.invoke(main, ["convert", str(FIX / "awq-gemm-qwen2"), str(tmp_path / "e.gguf"), "--exact", "--json"])
    rep = json.loads(r.output)
    assert rep["storage"] == {"q5_0": 14} and rep["exact_share"] == 1.0 and rep["max_rel_err"] == 0.0


def test_act_order_converts_with_a_warning_naming_the_tensors(runner, tmp_path, caplog):
    out = tmp_path / "m.gguf"
    with caplog.at_level("WARNING", logger="edgerun.convert"):
        r = runner.invoke(main, ["convert", str(FIX / "gptq-actorder-llama"), str(out)])
    assert r.exit_code == 0 and out.is_file() and "error" not in r.stderr
    warn = [rec for rec in caplog.records if rec.levelname == "WARNING"]
    assert len(warn) == 1 and "act-order" in warn[0].message and "blk.0.ffn_down.weight" in warn[0].message


def test_no_quantization_config(runner, tmp_path):
    d = copy("awq-gemm-llama", tmp_path)
    edit_config(d, lambda c: c.pop("quantization_config"))
    refused(runner, d, tmp_path / "o.gguf", "no quantization_config")


@pytest.mark.parametrize("name,change,message", [
    ("awq-gemm-llama", {"version": "marlin"}, "AWQ version 'marlin' is not supported"),
    ("awq-gemm-llama", {"backend": "llm-awq"}, "llm-awq backend"),
    ("awq-gemm-llama", {"bits": 3}, "3-bit weights are not supported"),
    ("gptq-llama", {"bits": 8}, "8-bit weights are not supported"),
    ("gptq-llama", {"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ("awq-gemm-llama", {"quant_method": "hqq"}, "quant_method 'hqq' is not supported"),
    ("ct-sym-llama", {"format": "float-quantized"}, "format 'float-quantized' is not supported"),
])
def test_unsupported_schemes(runner, tmp_path, name, change, message):
    d = copy(name, tmp_path)
    edit_config(d, lambda c: c["quantization_config"].update(change))
    refused(runner, d, tmp_path / "o.gguf", message)


def test_unsupported_architecture(runner, tmp_path):
    d = copy("awq-gemm-llama", tmp_path)
    edit_config(d, lambda c: c.update(architectures=["MistralForCausalLM"], model_type="mistral"))
    refused(runner, d, tmp_path / "o.gguf", "unsupported architecture")


def test_missing_tensor(runner, tmp_path):
    d = copy("awq-gemm-llama", tmp_path)
    edit_tensors(d, lambda t: t.pop("model.layers.1.mlp.down_proj.qzeros"))
    refused(runner, d, tmp_path / "o.gguf", "missing tensors ['model.layers.1.mlp.down_proj.qzeros']")


def test_mis_shaped_tensor(runner, tmp_path):
    d = copy("awq-gemm-llama", tmp_path)
    edit_tensors(d, lambda t: t.update({"model.layers.0.mlp.up_proj.scales": t["model.layers.0.mlp.up_proj.scales"][:1]}))
    refused(runner, d, tmp_path / "o.gguf", "do not match qweight")


def test_truncated_safetensors(runner, tmp_path):
    d = copy("ct-sym-llama", tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    refused(runner, d, tmp_path / "o.gguf", "truncated safetensors file")


@pytest.mark.parametrize("bad", [np.nan, 0.0])
def test_nan_or_zero_scales(runner, tmp_path, bad):
    d = copy("gptq-llama", tmp_path)

    def poison(t):
        s = t["model.layers.0.self_attn.o_proj.scales"].copy()
        s[0, 3] = bad
        t["model.layers.0.self_attn.o_proj.scales"] = s
    edit_tensors(d, poison)
    refused(runner, d, tmp_path / "o.gguf", "NaN, infinite or zero scales")


@pytest.mark.parametrize("name", ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight"])
def test_nan_in_a_float16_tensor(runner, tmp_path, name):
    """F16 tensors are copied to the GGUF as stored (no float32 copy): still checked for NaN."""
    d = copy("awq-gemm-llama", tmp_path)

    def poison(t):
        assert t[name].dtype == np.float16
        w = t[name].copy()
        w.reshape(-1)[-1] = np.nan
        t[name] = w
    edit_tensors(d, poison)
    refused(runner, d, tmp_path / "o.gguf", f"tensor {name} has NaN/inf values")


def test_codes_out_of_range(runner, tmp_path):
    """GPTQ v1 stores z - 1: a stored 15 would be z = 16."""
    d = copy("gptq-llama", tmp_path)

    def poison(t):
        z = t["model.layers.0.mlp.gate_proj.qzeros"].copy()
        z[0, 0] = np.int32(-1)                            # all nibbles 15
        t["model.layers.0.mlp.gate_proj.qzeros"] = z
    edit_tensors(d, poison)
    refused(runner, d, tmp_path / "o.gguf", "z = 16")


def test_zero_point_out_of_range_for_unpacked_compressed_tensors(runner, tmp_path):
    d = copy("ct-asym-qwen2", tmp_path)

    def unpack_zp(t):                                       # the older unpacked int8 [N, G] layout, one value bad
        from edgerun.convert.unpack import nibbles
        name = "model.layers.0.self_attn.q_proj.weight_zero_point"
        n = t["model.layers.0.self_attn.q_proj.weight_scale"][1].shape[0]
        zp = t[name][1]
        zs = nibbles(zp.T).reshape(zp.shape[1], -1)[:, :n].T.astype(np.int8) - 8
        zs[1, 1] = 9
        t[name] = ("I8", zs)
    edit_raw_tensors(d, unpack_zp)
    refused(runner, d, tmp_path / "o.gguf", "weight_zero_point values outside -8..7")


def test_missing_tokenizer(runner, tmp_path):
    d = copy("awq-gemm-llama", tmp_path)
    (d / "tokenizer.json").unlink()
    refused(runner, d, tmp_path / "o.gguf", "no GPT-2 style BPE tokenizer")


def test_tokenizer_not_byte_level_bpe(runner, tmp_path):
    d = copy("awq-gemm-llama", tmp_path)
    tj = json.loads((d / "tokenizer.json").read_text())
    tj["model"] = {"type": "WordPiece", "vocab": {"a": 0}, "unk_token": "a"}
    tj["pre_tokenizer"] = {"type": "Whitespace"}
    tj["decoder"] = None
    (d / "tokenizer.json").write_text(json.dumps(tj))
    refused(runner, d, tmp_path / "o.gguf", "is not GPT-2 byte-level BPE")


def test_failed_conversion_leaves_an_existing_output_alone(runner, tmp_path):
    out = tmp_path / "o.gguf"
    out.write_bytes(b"keep me")
    d = copy("gptq-llama", tmp_path)
    edit_tensors(d, lambda t: t.update({"model.layers.0.mlp.up_proj.scales": np.full_like(
        t["model.layers.0.mlp.up_proj.scales"], np.nan)}))
    r = runner.invoke(main, ["convert", str(d), str(out)])
    assert r.exit_code == 2 and out.read_bytes() == b"keep me"


# ----------------------------------------------------------------------------- --model DIR

def test_model_dir_converts_once_into_the_cache(runner, tmp_path, monkeypatch):
    from edgerun.resolve import resolve_model

    monkeypatch.setenv("EDGERUN_HOME", str(tmp_path / "home"))
    d = copy("awq-gemm-qwen2", tmp_path)
    p1 = resolve_model(str(d))
    assert p1.parent == tmp_path / "home" / "models" / "converted" and p1.suffix == ".gguf"
    m1 = p1.stat().st_mtime_ns
    p2 = resolve_model(str(d))
    assert p2 == p1 and p2.stat().st_mtime_ns == m1                          # second load: no conversion
    r = runner.invoke(main, ["list", "--json"])
    rows = [x for x in json.loads(r.output) if x["kind"] == "converted"]
    assert len(rows) == 1 and rows[0]["path"] == str(p1) and rows[0]["quant"].startswith("Q4_1 (from awq/gemm")
    # a changed checkpoint is a different model: converted again under its new hash
    edit_tensors(d, lambda t: t.update({"model.norm.weight": t["model.norm.weight"] * np.float16(2)}))
    p3 = resolve_model(str(d))
    assert p3 != p1 and p3.is_file() and p1.is_file()


def test_generate_with_model_dir_is_the_same_first_and_second_time(runner, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGERUN_HOME", str(tmp_path / "home"))
    d = copy("awq-gemm-llama", tmp_path)
    args = ["generate", "The", "--model", str(d), "--draft", "none", "-n", "12", "-t", "0", "--threads", "1", "--json"]
    r1 = runner.invoke(main, args)
    assert r1.exit_code == 0, r1.output
    r2 = runner.invoke(main, args)
    t1, t2 = json.loads(r1.output), json.loads(r2.output)
    assert t1["text"] == t2["text"] and t1["n_tokens"] == 12


def test_model_dir_that_is_not_a_checkpoint(runner, tmp_path):
    (tmp_path / "empty").mkdir()
    r = runner.invoke(main, ["generate", "x", "--model", str(tmp_path / "empty")])
    assert r.exit_code == 2 and "INT4 checkpoint directory" in r.stderr


def test_unpacked_int8_zero_points_convert_like_packed_ones(tmp_path):
    """Older compressed-tensors checkpoints store weight_zero_point unpacked (int8 [N, G]): same model."""
    from edgerun.convert import convert
    from edgerun.convert.unpack import nibbles

    d = copy("ct-asym-qwen2", tmp_path)

    def unpack_all(t):
        for name in [n for n in t if n.endswith("weight_zero_point")]:
            n = t[name.replace("zero_point", "scale")][1].shape[0]
            zp = t[name][1]
            t[name] = ("I8", nibbles(zp.T).reshape(zp.shape[1], -1)[:, :n].T.astype(np.int8) - 8)
    edit_raw_tensors(d, unpack_all)
    a, b = convert(FIX / "ct-asym-qwen2", tmp_path / "a.gguf"), convert(d, tmp_path / "b.gguf")
    assert a.n_exact == b.n_exact and a.storage == b.storage
    import gguf
    ra, rb = gguf.GGUFReader(tmp_path / "a.gguf"), gguf.GGUFReader(tmp_path / "b.gguf")
    for ta, tb in zip(ra.tensors, rb.tensors):
        assert ta.name == tb.name and np.array_equal(np.asarray(ta.data), np.asarray(tb.data))
