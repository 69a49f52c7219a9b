"""`edgerun quantize` and `edgerun eval ppl` transcripts: good runs, and bad inputs -> exit 2, one line, no file."""

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from edgerun.cli import main
from tinymodel import tiny_weights, write_hf_checkpoint


@pytest.fixture(scope="module")
def src(tiny_model_factory):
    return tiny_model_factory(arch="llama", n_embd=64, n_ff=128, seed=11)


def run(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r


def assert_clean_error(r, out, *needles):
    assert r.exit_code == 2, r.output
    last = r.stderr.rstrip("\n").split("\n")[-1]          # after any progress line
    assert last.startswith("error: ") and "\r" not in last, r.stderr
    assert "Traceback" not in r.output
    for n in needles:
        assert n in last, r.stderr
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith("." + out.name)]


def test_quantize_rtn_and_awq(src, tmp_path):
    r = run("quantize", src, tmp_path / "a.gguf", "--method", "rtn")
    assert r.exit_code == 0, r.output
    assert "wrote" in r.stdout and (tmp_path / "a.gguf").exists()
    r = run("quantize", src, tmp_path / "b.gguf", "--format", "q4_1", "--calib-tokens", "256", "--grid", "5",
            "--embed-type", "f16", "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["method"] == "awq" and rep["format"] == "q4_1" and rep["calib_tokens"] == 256
    assert len(rep["groups"]) == 8 and 0 <= rep["error_reduction"] <= 1


def test_unsupported_format(src, tmp_path):
    assert_clean_error(run("quantize", src, tmp_path / "o.gguf", "--format", "q3_k"), tmp_path / "o.gguf", "q3_k")


def test_q4_k_needs_rtn_and_rows_of_256(src, tmp_path):
    out = tmp_path / "o.gguf"
    assert_clean_error(run("quantize", src, out, "--format", "q4_k"), out, "q4_k", "round-to-nearest")
    # the tiny model is 64 wide: not a whole Q4_K super-block
    assert_clean_error(run("quantize", src, out, "--format", "q4_k", "--method", "rtn"), out, "256", "q4_0")


def test_unsupported_architecture(tmp_path):
    import gguf
    p = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(p), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    out = tmp_path / "o.gguf"
    assert_clean_error(run("quantize", p, out), out, "unsupported architecture", "gpt2")


def test_missing_config_keys(tmp_path):
    cfg, hf = tiny_weights("qwen2", seed=1)
    del cfg["hidden_size"]
    write_hf_checkpoint(tmp_path / "hf", cfg, hf)
    out = tmp_path / "o.gguf"
    assert_clean_error(run("quantize", tmp_path / "hf", out), out, "missing config keys", "hidden_size")


def test_nan_weights(tmp_path):
    cfg, hf = tiny_weights("llama", seed=1)
    hf["model.layers.1.mlp.up_proj.weight"][3, 5] = np.nan
    write_hf_checkpoint(tmp_path / "hf", cfg, hf)
    out = tmp_path / "o.gguf"
    assert_clean_error(run("quantize", tmp_path / "hf", out, "--calib-tokens", "128"), out, "NaN",
                       "blk.1.ffn_up.weight")


def test_calibration_text_too_short(src, tmp_path):
    (tmp_path / "short.txt").write_text("a short calibration text.\n" * 10)
    out = tmp_path / "o.gguf"
    assert_clean_error(run("quantize", src, out, "--calib", tmp_path / "short.txt"), out, "too short")


def test_missing_source(tmp_path):
    out = tmp_path / "o.gguf"
    r = run("quantize", tmp_path / "nope.gguf", out)
    assert_clean_error(r, out)


def test_eval_ppl_matches_reference(src, tmp_path):
    """PPL through llama.cpp equals the numpy reference's on the same windows (second half scored)."""
    from edgerun.eval.texts import pydoc_text
    from edgerun.reference.llama import ReferenceModel
    from edgerun.tokenizer import Tokenizer
    text = pydoc_text()[:6000]
    (tmp_path / "t.txt").write_text(text)
    r = run("eval", "ppl", src, "--text", tmp_path / "t.txt", "--ctx", "128", "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    toks = Tokenizer.from_gguf(src).tokenize(text, special=False, add_bos=False)
    n_win = len(toks) // 128
    assert res["n_windows"] == n_win and res["n_scored"] == n_win * 63
    m = ReferenceModel.from_gguf(src)
    nll = []
    for w in range(n_win):
        win = toks[w * 128:(w + 1) * 128]
        lg = m.forward(win)[64:127]
        lse = np.logaddexp.reduce(lg, axis=1)
        nll.extend(lse - lg[np.arange(63), win[65:]])
    assert math.isclose(res["ppl"], math.exp(np.mean(nll)), rel_tol=5e-3)
    per_window = np.asarray(nll).reshape(n_win, 63).mean(axis=1)
    np.testing.assert_allclose(res["window_nll"], per_window, rtol=5e-3, atol=5e-3)
    r = run("eval", "ppl", src, "--text", tmp_path / "t.txt", "--ctx", "128")
    assert r.exit_code == 0 and "PPL" in r.stdout


def test_paired_ratio():
    """Paired PPL ratio over windows: exact for a constant shift, an interval that covers a noisy one,
    and a clear error when the two results did not score the same windows."""
    from edgerun.errors import InvalidArgument
    from edgerun.eval.perplexity import paired_ratio
    rng = np.random.default_rng(0)
    base = rng.uniform(2.0, 4.0, 16)                     # windows differ a lot in difficulty
    r, lo, hi = paired_ratio(base + 0.01, base)
    assert math.isclose(r, math.exp(0.01), rel_tol=1e-12) and math.isclose(lo, r) and math.isclose(hi, r)
    covered = 0
    for _ in range(200):                                 # ~95% of intervals cover the true ratio
        a = base + 0.01 + rng.normal(0, 0.02, 16)
        _, lo, hi = paired_ratio(a, base)
        covered += lo <= math.exp(0.01) <= hi
    assert 180 <= covered <= 200
    with pytest.raises(InvalidArgument, match="same windows"):
        paired_ratio(base, base[:8])


def test_t_quantile_beyond_the_table():
    """More than 31 windows: the t quantile keeps shrinking towards 1.96, not jumping to it."""
    from edgerun.eval.perplexity import t975
    exact = {1: 12.706, 10: 2.228, 30: 2.042, 31: 2.0395, 40: 2.0211, 47: 2.0117, 60: 2.0003, 120: 1.9799}
    for dof, t in exact.items():
        assert abs(t975(dof) - t) < 1e-3, (dof, t975(dof))
    assert all(t975(v) > t975(v + 1) > 1.96 for v in range(1, 500))


def test_eval_ppl_text_shorter_than_window(src, tmp_path):
    (tmp_path / "t.txt").write_text("tiny")
    r = run("eval", "ppl", src, "--text", tmp_path / "t.txt", "--ctx", "128")
    assert r.exit_code == 2 and r.stderr.startswith("error: ")


def test_eval_ppl_vs(src, tmp_path):
    """--vs scores a second model on the same windows and reports the paired PPL ratio."""
    from edgerun.eval.texts import pydoc_text
    (tmp_path / "t.txt").write_text(pydoc_text()[:6000])
    q = tmp_path / "rtn.gguf"
    assert run("quantize", src, q, "--method", "rtn").exit_code == 0
    r = run("eval", "ppl", q, "--text", tmp_path / "t.txt", "--ctx", "128", "--vs", src, "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    a, b, ratio = res["model"], res["vs"], res["ratio"]
    assert a["n_windows"] == b["n_windows"] >= 2
    assert math.isclose(ratio["ppl_ratio"], a["ppl"] / b["ppl"], rel_tol=1e-9)
    assert ratio["lo95"] <= ratio["ppl_ratio"] <= ratio["hi95"]
    assert a["ppl"] != b["ppl"]                           # the quantized model really differs
    r = run("eval", "ppl", src, "--text", tmp_path / "t.txt", "--ctx", "128", "--vs", src)
    assert r.exit_code == 0 and "= 1.0000 (95% 1.0000 .. 1.0000, paired over" in r.stdout, r.output
    assert a["tokens_sha256"] == b["tokens_sha256"] and len(a["tokens_sha256"]) == 64
    r = run("eval", "ppl", src, "--text", tmp_path / "t.txt", "--ctx", "128", "--vs", tmp_path / "missing.gguf")
    assert r.exit_code == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.output


def test_paired_comparison_refuses_different_tokens():
    """compare() pairs only results that scored the same token ids (same tokenizer, ctx, windows)."""
    import dataclasses

    from edgerun.errors import InvalidArgument
    from edgerun.eval.perplexity import PerplexityResult, compare
    a = PerplexityResult(model="a.gguf", text="t", ctx=128, ppl=math.exp(2.0), nll=2.0, nll_stderr=0.1, n_windows=3,
                         n_scored=189, n_text_tokens=400, seconds=1.0, window_nll=(2.0, 2.1, 1.9), tokens_sha256="ab")
    b = dataclasses.replace(a, model="b.gguf", window_nll=(2.1, 2.2, 2.0))
    ratio, lo, hi = compare(a, b)
    assert math.isclose(ratio, math.exp(-0.1)) and lo <= ratio <= hi
    with pytest.raises(InvalidArgument, match="tokenize the text differently"):
        compare(a, dataclasses.replace(b, tokens_sha256="cd", n_text_tokens=380))
    with pytest.raises(InvalidArgument, match="same windows"):
        compare(a, dataclasses.replace(b, n_windows=2, window_nll=(2.1, 2.2)))


def test_an_existing_out_that_is_not_a_regular_file_is_refused_and_left_alone(src, tmp_path):
    """Issue 20, defect 7: a device node / FIFO / symlink at OUT is never replaced by the atomic rename."""
    import os
    import stat

    fifo = tmp_path / "node.gguf"
    os.mkfifo(fifo)
    r = run("quantize", src, fifo, "--method", "rtn")
    assert r.exit_code == 2 and r.output.startswith("error: ") and "not a regular file" in r.output, r.output
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    target = tmp_path / "real.txt"
    target.write_text("keep me")
    link = tmp_path / "link.gguf"
    link.symlink_to(target)
    r = run("quantize", src, link, "--method", "rtn")
    assert r.exit_code == 2 and "symbolic link" in r.output
    assert link.is_symlink() and target.read_text() == "keep me"


def test_a_dead_writers_temporary_is_removed_and_a_live_ones_kept(src, tmp_path):
    """Issue 20: a SIGKILLed quantize left a .part of tens of MB that nothing cleaned."""
    import os

    out = tmp_path / "o.gguf"
    dead = tmp_path / f".o.gguf.{2 ** 22 + 12345}.abcd.part"          # no such pid (above pid_max's default)
    live = tmp_path / f".o.gguf.{os.getppid()}.efgh.part"             # a live process (our parent) owns it
    dead.write_bytes(b"x" * 1000)
    live.write_bytes(b"y")
    r = run("quantize", src, out, "--method", "rtn")
    assert r.exit_code == 0, r.output
    assert not dead.exists() and live.exists() and out.is_file()


def test_sigterm_mid_quantize_leaves_no_temporary(tiny_model_factory, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    slow = tiny_model_factory(arch="llama", n_layer=24, n_embd=128, n_ff=256, seed=5)   # several seconds of AWQ
    out = tmp_path / "t.gguf"
    cmd = [sys.executable, "-c", "from edgerun.cli import main; main()", "quantize", str(slow), str(out),
           "--calib-tokens", "4096", "--grid", "40"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while not list(tmp_path.glob(".t.gguf.*.part")) and p.poll() is None and time.time() - t0 < 120:
        time.sleep(0.05)
    assert p.poll() is None, "quantize finished before it could be interrupted"
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, p.stderr.read()[-2000:]
    assert not out.exists() and not list(tmp_path.glob(".t.gguf*"))
