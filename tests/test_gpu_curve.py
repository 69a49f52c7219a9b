"""The GPU cost-curve tools (bench/gpu_curve.py, bench/predict_gpu.py) on this CPU: the random-weight models
keep the real pair's tensor table and load in llama.cpp, and the tuner-based prediction picks gamma 0 on the
CPU curve measured here and speculates on a flat (GPU-like) one."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench_module(name: str):
    """bench/NAME.py loaded from its file (bench/ is not put on sys.path: its onnx.py would shadow onnx)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


gpu_curve = _bench_module("gpu_curve")
predict_gpu = _bench_module("predict_gpu")

SHAPES = ROOT / "bench" / "gpu_shapes"


@pytest.mark.parametrize("name, n_blocks", [("qwen2.5-coder-1.5b-instruct", 28), ("qwen2.5-coder-0.5b-instruct", 24)])
def test_the_shape_tables_are_the_real_pairs(name, n_blocks):
    spec = json.loads((SHAPES / f"{name}.json").read_text())
    assert spec["kv"]["qwen2.block_count"]["value"] == n_blocks
    assert spec["kv"]["tokenizer.ggml.tokens"]["count"] == 151936
    nbytes = 0
    for t in spec["tensors"]:
        _, blk, size, _ = gpu_curve.GGML_TYPES[gpu_curve.TYPE_IDS[t["type"]]]
        nbytes += int(np.prod(t["ne"])) // blk * size
    # the registry files (docs: 1,117,320,768 and 491,400,064 bytes) less their ~6 MB headers (the vocabulary)
    real = {"qwen2.5-coder-1.5b-instruct": 1_117_320_768, "qwen2.5-coder-0.5b-instruct": 491_400_064}[name]
    assert 0 < real - nbytes < 8_000_000


def test_a_random_model_keeps_names_and_types_reads_back_and_loads(tmp_path):
    from edgerun import llama_lib

    spec = json.loads((SHAPES / "qwen2.5-coder-1.5b-instruct.json").read_text())
    small = gpu_curve.shrink(spec)
    out = gpu_curve.write_model(small, tmp_path / "r.gguf")
    back = gpu_curve.read_spec(out)
    assert [(t["name"], t["type"], t["ne"]) for t in back["tensors"]] == \
        [(t["name"], t["type"], t["ne"]) for t in small["tensors"]]
    assert {t["type"] for t in back["tensors"]} == {"Q4_K", "Q6_K", "F32"}
    be = gpu_curve._backend(str(out), 0, 1)
    try:
        logits = be.eval([300, 301, 302])
        assert logits.shape == (3, 1024) and np.isfinite(logits).all()      # the fp16 scales were made finite
    finally:
        be.close()
    assert llama_lib.Model.load(out).placement.n_layers == 3


def test_prediction_stays_off_on_the_cpu_curve_and_speculates_on_a_flat_one():
    code = predict_gpu.MARGIN_TABLE["code greedy"]
    cpu = predict_gpu.predict(predict_gpu.CURVES["zen3-cpu"]["ratios"], 0.31, code)
    assert cpu["speedup"] == pytest.approx(1.0, abs=0.02)
    flat = predict_gpu.predict(predict_gpu.CURVES["agx-orin"]["ratios"], 0.44, code)
    assert flat["speedup"] > 1.3 and all(c["gamma"] >= 2 for c in flat["classes"])
    # a free drafter on a flat curve drafts as far as the tuner may where acceptance is high
    free = predict_gpu.predict([1.0] * 9, 0.0, [(2.9, 1)])
    assert free["classes"][0]["gamma"] == predict_gpu.GAMMA_MAX


def test_per_position_acceptance_inverts_the_mean():
    a = predict_gpu.per_position(2.41)
    assert a + a ** 2 + a ** 3 == pytest.approx(2.41)
