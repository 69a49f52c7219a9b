"""Shared pytest fixtures. tests/ is on sys.path (pytest rootdir conftest), so `import tinymodel` works."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tinymodel import write_tiny_model  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _llama_cpp_like_edgerun():
    """Tests that call llama_cpp.Llama directly load models the way edgerun does.

    On a llama.cpp build with AMX kernels, edgerun loads weights without the extra buffer types
    (`llama_lib.use_extra_buffers`: those kernels segfault on some VMs, taking pytest with them);
    the direct llama_cpp.Llama uses in tests get the same model parameters.
    """
    try:
        import llama_cpp.llama_cpp as llama_cpp          # the module llama_cpp.Llama reads its defaults from
    except ImportError:
        yield
        return
    from edgerun import llama_lib
    if llama_lib.use_extra_buffers():
        yield
        return
    orig = llama_cpp.llama_model_default_params

    def params():
        p = orig()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama_model_default_params = params
    try:
        yield
    finally:
        llama_cpp.llama_model_default_params = orig


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """make(**kwargs) -> Path of a tiny GGUF (write_tiny_model kwargs), cached per session by kwargs."""
    cache: dict = {}
    root = tmp_path_factory.mktemp("tiny_models")

    def make(**kw) -> Path:
        key = tuple(sorted(kw.items()))
        if key not in cache:
            cache[key] = write_tiny_model(root / f"m{len(cache)}.gguf", **kw)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> Path:
    """Tiny llama-arch F32 GGUF (d 64, 2 layers, 4/2 heads, gpt2 BPE vocab, ChatML template)."""
    return tiny_model_factory(arch="llama", wtype="f32", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_model_factory) -> Path:
    """Tiny qwen2-arch F32 GGUF with q/k/v biases and tied output."""
    return tiny_model_factory(arch="qwen2", wtype="f32", tied=True, seed=0)


@pytest.fixture(scope="session")
def peaked(tiny_model_factory):
    """A target whose next-token distributions are peaked enough for a chi-square test over pairs
    of tokens (output head x3), and a drafter that is a noisy copy of it (acceptance about 40%)."""
    import numpy as np

    from edgerun.reference.llama import ReferenceModel
    from edgerun.tokenizer import Tokenizer

    path = tiny_model_factory(arch="llama", wtype="f32", seed=0)
    tok = Tokenizer.from_gguf(path)
    base = ReferenceModel.from_gguf(path)

    def variant(noise: float) -> "ReferenceModel":
        t = dict(base.tensors)
        w = t["output.weight"] * 3.0
        w = w + noise * w.std() * np.random.default_rng(1).standard_normal(w.shape)
        t["output.weight"] = w
        return ReferenceModel.from_weights(base.cfg, t)

    return variant(0.0), variant(1.0), tok
