"""The numpy reference forward reproduces llama.cpp's logits on the same float weights."""

import numpy as np
import pytest

from edgerun.formats.gguf import GGUFSource
from edgerun.formats.hf import HFSource
from edgerun.reference.llama import ReferenceModel
from tinymodel import write_tiny_model

TEXT = "Hello there, the world is in the net.\n<|im_start|>user\nwhat is it?<|im_end|>"


def _llamacpp_logits(path, text):
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(path), n_ctx=256, n_batch=256, verbose=False, logits_all=True,
                          n_threads=1, flash_attn=True)
    try:
        toks = llm.tokenize(text.encode(), add_bos=False, special=True)
        llm.eval(toks)
        return toks, np.array(llm.scores[: len(toks)], dtype=np.float64)
    finally:
        llm.close()


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True)])
def test_reference_matches_llamacpp_f32(tmp_path, arch, tied):
    p = write_tiny_model(tmp_path / "m.gguf", arch=arch, wtype="f32", tied=tied, seed=3)
    toks, lc = _llamacpp_logits(p, TEXT)
    assert len(toks) > 20
    lr = ReferenceModel.from_gguf(p).forward(toks)
    # llama.cpp keeps K/V in f16: agreement to ~1e-3 relative to the logits' size
    assert np.abs(lc - lr).max() < 2e-3 * np.abs(lr).max()
    assert (lc.argmax(-1) == lr.argmax(-1)).mean() > 0.95


def test_wrong_permutation_is_detected(tmp_path):
    """Control: the comparison above can fail (llama weights read with qwen2's RoPE style differ)."""
    p = write_tiny_model(tmp_path / "m.gguf", arch="llama", wtype="f32", seed=3)
    toks, lc = _llamacpp_logits(p, TEXT)
    m = ReferenceModel.from_gguf(p)
    object.__setattr__(m.cfg, "arch", "qwen2")        # neox RoPE on llama-permuted rows: wrong model
    assert np.abs(lc - m.forward(toks)).max() > 0.05


def test_cache_incremental_and_truncate(tmp_path):
    p = write_tiny_model(tmp_path / "m.gguf", arch="qwen2", wtype="q8_0", seed=4)
    m = ReferenceModel.from_gguf(p)
    toks = list(range(5, 40))
    full = m.forward(toks)
    c = m.new_cache()
    parts = [m.forward(toks[:7], c), m.forward(toks[7:8], c), m.forward(toks[8:], c)]
    assert c.n_past == len(toks)
    np.testing.assert_allclose(np.concatenate(parts), full, atol=1e-12)
    c.truncate(10)
    np.testing.assert_allclose(m.forward(toks[10:], c), full[10:], atol=1e-12)
    with pytest.raises(Exception):
        c.truncate(1000)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_checkpoint_reads_as_the_same_model(tmp_path, arch):
    p = write_tiny_model(tmp_path / "m.gguf", arch=arch, wtype="f32", seed=5, hf_dir=tmp_path / "hf")
    g, h = GGUFSource(p), HFSource(tmp_path / "hf")
    assert g.cfg == h.cfg
    for n in g.tensor_names():
        np.testing.assert_array_equal(g.tensor(n), h.tensor(n), err_msg=n)


def test_top1_agreement_counts_differences_and_near_ties():
    from edgerun.eval.agreement import top1_agreement

    rng = np.random.default_rng(0)
    b = rng.normal(size=(50, 40))
    a = b + rng.normal(scale=1e-3, size=b.shape)
    r = top1_agreement(a, b)
    assert r["top1_agreement"] == 1.0 and r["n_differ"] == 0 and r["max_abs_diff"] < 0.01
    top = b[7].argmax()
    a[7, (top + 1) % 40] = b[7, top] + 5.0              # one clear disagreement
    b[9, (b[9].argmax() + 1) % 40] = b[9].max() - 1e-6   # one near-tie in b, flipped in a
    a[9] = b[9]
    a[9, (b[9].argmax() + 1) % 40] += 1e-5
    r = top1_agreement(a, b)
    assert r["n_differ"] == 2 and r["top1_agreement"] == 48 / 50
    assert r["near_ties_excluded"] >= 1 and r["top1_excluding_near_ties"] > r["top1_agreement"]
