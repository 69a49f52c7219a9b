"""Speculative decoding is exact, end to end through the decode loop (edgerun/generate.py).

- Golden runs on the numpy reference backend: greedy speculative == greedy plain, token for token,
  for several prompts, gamma 1..8 and three drafters (the target itself, a different random model
  with the same vocabulary, prompt lookup); verification is one target call per cycle.
- Rollback: after rejections (and after a stream closed early) the target's next logits equal those
  of a fresh run over the committed tokens; the drafter's lazily synced cache gives what a fresh
  drafter gives.
- Statistics: the joint distribution of the first two generated tokens, sampled through the decode
  loop with a drafter, passes a chi-square test against the exact target distribution (enumerated
  with the reference forward) at temperature 1 and at temperature 0.7 + top-p 0.9; plain sampling
  too; the wrong residual (resampling from p) fails the same test.
- llama.cpp with flash attention and Q8_0/Q4_0 weights: the model as its own drafter accepts 100%
  and equals plain greedy; rollback gives the logits of a fresh run.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import edgerun.generate as gen
from edgerun.backends.reference import ReferenceBackend
from edgerun.config import BackendArgs, SamplingArgs
from edgerun.generate import GenStats, generate
from edgerun.reference.llama import ReferenceModel
from edgerun.speculative.drafters import ModelDrafter, PromptLookupDrafter
from edgerun.speculative.gamma import FixedGamma
from edgerun.speculative.sampling import dense_rows, probs
from edgerun.speculative.verify import verify
from test_verify import P_FAIL, P_PASS, chisquare_pooled, wrong_residual

GREEDY = SamplingArgs(temperature=0.0)
PROMPTS = [
    "Hello there, the world",
    "<|im_start|>user\nwhat is it?<|im_end|>\n<|im_start|>assistant\n",
    "the net is in the net is in the",
    "a",
]
N_TOKENS = 24


def run(target, prompt, sampling=GREEDY, drafter=None, gamma=0, rng=None, max_tokens=N_TOKENS, **kw):
    stats = GenStats()
    toks = [s.token for s in generate(target, prompt, sampling, max_tokens=max_tokens, drafter=drafter,
                                      policy=FixedGamma(gamma), rng=rng or np.random.default_rng(0),
                                      stats=stats, **kw)]
    return toks, stats


@pytest.fixture(scope="module")
def ref(tiny_model_factory):
    """Target, a copy of it as drafter, and a bad drafter (other random weights, same vocabulary)."""
    target = ReferenceBackend(tiny_model_factory(arch="llama", wtype="f32", seed=0))
    same = ReferenceBackend(tiny_model_factory(arch="llama", wtype="f32", seed=0))
    bad = ReferenceBackend(tiny_model_factory(arch="llama", wtype="f32", seed=1))
    return target, same, bad


# ---------------------------------------------------------------- golden runs (reference backend)

def test_greedy_speculative_equals_plain(ref):
    target, same, bad = ref
    drafters = {"same": ModelDrafter(same, target), "bad": ModelDrafter(bad, target),
                "lookup": PromptLookupDrafter()}
    accepted = {name: 0 for name in drafters}
    for text in PROMPTS:
        prompt = target.tokenizer.tokenize(text)
        plain, _ = run(target, prompt)
        assert len(plain) > 3
        for name, d in drafters.items():
            for gamma in range(1, 9):
                evals = target.n_evals
                spec, st = run(target, prompt, drafter=d, gamma=gamma)
                assert spec == plain, (text, name, gamma)
                assert target.n_evals - evals <= st.n_cycles + 1      # one target call per cycle (+ prefill)
                accepted[name] += st.n_accepted
                if name == "same":
                    assert st.acceptance_rate == 1.0
                    assert st.n_cycles <= -(-len(plain) // (gamma + 1)) + 1
    assert accepted["bad"] < accepted["same"] / 4          # the bad drafter really is bad...
    assert accepted["bad"] > 0 and accepted["lookup"] > 0    # ...and its drafts do get verified


def test_greedy_qwen2_arch(tiny_model_factory):
    target = ReferenceBackend(tiny_model_factory(arch="qwen2", wtype="f32", tied=True, seed=0))
    bad = ModelDrafter(ReferenceBackend(tiny_model_factory(arch="qwen2", wtype="f32", tied=True, seed=2)), target)
    prompt = target.tokenizer.tokenize(PROMPTS[0])
    plain, _ = run(target, prompt)
    for gamma in (1, 3, 8):
        assert run(target, prompt, drafter=bad, gamma=gamma)[0] == plain


# ---------------------------------------------------------------- rollback

def _fresh_next_logits(path_or_model, committed, tokenizer=None):
    fresh = ReferenceBackend(path_or_model, tokenizer=tokenizer)
    return fresh.eval(committed)[-1]


@pytest.mark.parametrize("sampling", [GREEDY, SamplingArgs(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)],
                         ids=["greedy", "t1"])
def test_rollback_after_rejections(ref, tiny_model_factory, sampling):
    target, _, bad = ref
    drafter = ModelDrafter(bad, target)
    prompt = target.tokenizer.tokenize(PROMPTS[0])
    toks, st = run(target, prompt, sampling, drafter=drafter, gamma=4, rng=np.random.default_rng(3),
                   is_eog=lambda t: False)
    assert st.n_drafted > st.n_accepted                  # there were rejections to roll back
    committed = prompt + toks
    assert target.tokens == committed[:-1]
    got = target.eval([committed[-1]])[-1]
    want = _fresh_next_logits(tiny_model_factory(arch="llama", wtype="f32", seed=0), committed)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    target.truncate(len(committed) - 1)
    # the drafter's cache is synced lazily: its next proposal equals a fresh drafter's
    fresh = ModelDrafter(ReferenceBackend(tiny_model_factory(arch="llama", wtype="f32", seed=1)), target)
    a_tok, a_q = drafter.propose(committed, 5, sampling, np.random.default_rng(9))
    b_tok, b_q = fresh.propose(committed, 5, sampling, np.random.default_rng(9))
    assert a_tok == b_tok
    if a_q is None or b_q is None:                       # greedy: point masses
        assert a_q is None and b_q is None
    else:
        np.testing.assert_allclose(dense_rows(a_q), dense_rows(b_q), atol=1e-6)


def test_closing_the_stream_leaves_caches_consistent(ref, tiny_model_factory):
    target, _, bad = ref
    drafter = ModelDrafter(bad, target)
    prompt = target.tokenizer.tokenize(PROMPTS[1])
    for n_take in (1, 2, 5):
        stream = generate(target, prompt, GREEDY, max_tokens=N_TOKENS, drafter=drafter,
                          policy=FixedGamma(6), rng=np.random.default_rng(0), is_eog=lambda t: False)
        taken = [next(stream).token for _ in range(n_take)]
        stream.close()
        committed = prompt + taken
        assert target.tokens == committed[:-1]
        got = target.eval([committed[-1]])[-1]
        np.testing.assert_allclose(got, _fresh_next_logits(tiny_model_factory(arch="llama", wtype="f32", seed=0),
                                                           committed), rtol=0, atol=1e-5)
    # and generation after a cancelled stream still equals plain greedy
    plain, _ = run(target, prompt)
    assert run(target, prompt, drafter=drafter, gamma=3)[0] == plain


# ---------------------------------------------------------------- statistics (reference backend)

SETTINGS = {
    "t1": SamplingArgs(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    "t0.7-top_p0.9": SamplingArgs(temperature=0.7, top_k=0, top_p=0.9, min_p=0.0),
}
N_SAMPLES = 1000


def exact_pairs(model: ReferenceModel, prompt: list[int], sampling: SamplingArgs) -> np.ndarray:
    """P(t1, t2 | prompt) [V * V], flattened t1-major, computed exactly with the reference forward."""
    V = model.n_vocab
    cache = model.new_cache()
    p1 = probs(model.forward(prompt, cache)[-1], sampling, prompt)
    joint = np.zeros((V, V))
    for t1 in np.flatnonzero(p1):
        cache.truncate(len(prompt))
        ctx = prompt + [int(t1)]
        joint[t1] = p1[t1] * probs(model.forward([int(t1)], cache)[-1], sampling, ctx)
    return joint.reshape(-1)


def sample_pairs(target, drafter, prompt, sampling, n, seed, gamma=2):
    rng = np.random.default_rng(seed)
    V = target.n_vocab
    cells = np.empty(n, dtype=np.int64)
    for s in range(n):
        toks, _ = run(target, prompt, sampling, drafter=drafter, gamma=gamma, rng=rng, max_tokens=3,
                      is_eog=lambda t: False)
        cells[s] = toks[0] * V + toks[1]
    return np.bincount(cells, minlength=V * V)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("mode", ["speculative", "plain"])
def test_sampled_tokens_follow_the_target(peaked, setting, mode):
    t_model, d_model, tok = peaked
    sampling = SETTINGS[setting]
    target = ReferenceBackend(t_model, tokenizer=tok)
    drafter = ModelDrafter(ReferenceBackend(d_model, tokenizer=tok), target) if mode == "speculative" else None
    prompt = tok.tokenize("Hello there")
    counts = sample_pairs(target, drafter, prompt, sampling, N_SAMPLES if drafter else N_SAMPLES // 2, seed=5)
    assert chisquare_pooled(counts, exact_pairs(t_model, prompt, sampling)) > P_PASS


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_wrong_residual_fails_end_to_end(peaked, setting, monkeypatch):
    """Control: the same test rejects a decode loop whose sampler resamples from p after a rejection."""
    t_model, d_model, tok = peaked
    sampling = SETTINGS[setting]
    monkeypatch.setattr(gen, "verify", functools.partial(verify, resample=wrong_residual))
    target = ReferenceBackend(t_model, tokenizer=tok)
    drafter = ModelDrafter(ReferenceBackend(d_model, tokenizer=tok), target)
    prompt = tok.tokenize("Hello there")
    counts = sample_pairs(target, drafter, prompt, sampling, N_SAMPLES, seed=5)
    assert chisquare_pooled(counts, exact_pairs(t_model, prompt, sampling)) < P_FAIL


# ---------------------------------------------------------------- llama.cpp

def _llama(path, **kw):
    from edgerun.backends.llamacpp import LlamaCppBackend

    return LlamaCppBackend(path, BackendArgs(n_ctx=256, n_threads=1, flash_attn=True, **kw))


@pytest.mark.parametrize("wtype", ["q8_0", "q4_0"])
def test_llamacpp_self_draft_is_exact(tiny_model_factory, wtype):
    pytest.importorskip("llama_cpp")
    path = tiny_model_factory(arch="llama", wtype=wtype, seed=0)
    target = _llama(path)
    drafter = ModelDrafter(_llama(path), target)
    try:
        for text in PROMPTS[:3]:
            prompt = target.tokenizer.tokenize(text)
            plain, _ = run(target, prompt)
            for gamma in (1, 2, 4, 8):
                spec, st = run(target, prompt, drafter=drafter, gamma=gamma)
                assert spec == plain, (text, gamma)
                assert st.acceptance_rate == 1.0, (text, gamma, st.accept_histogram)
    finally:
        target.close()
        drafter.close()


def test_llamacpp_rollback_matches_fresh_run(tiny_model_factory):
    pytest.importorskip("llama_cpp")
    path = tiny_model_factory(arch="llama", wtype="q8_0", seed=0)
    target = _llama(path)
    drafter = ModelDrafter(_llama(tiny_model_factory(arch="llama", wtype="q8_0", seed=1)), target)
    fresh = _llama(path)
    try:
        prompt = target.tokenizer.tokenize(PROMPTS[0])
        toks, st = run(target, prompt, SETTINGS["t1"], drafter=drafter, gamma=4, rng=np.random.default_rng(3),
                       is_eog=lambda t: False, max_tokens=40)
        assert st.n_drafted > st.n_accepted
        committed = prompt + toks
        assert target.tokens == committed[:-1]
        got = target.eval([committed[-1]])[-1]
        want = fresh.eval(committed)[-1]
        np.testing.assert_array_equal(got, want)
    finally:
        for b in (target, drafter, fresh):
            b.close()
