"""Drafters (edgerun/speculative/drafters.py): prompt lookup, the model drafter's cache discipline and
p_min, and the vocabulary check that refuses a drafter of another model family."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from edgerun.config import SamplingArgs, SpeculativeArgs
from edgerun.errors import InvalidArgument, VocabMismatch
from edgerun.speculative.drafters import MARGINS, ModelDrafter, PromptLookupDrafter, make_drafter, margin_class
from edgerun.speculative.sampling import dense_rows
from tinymodel import tiny_vocab

GREEDY = SamplingArgs(temperature=0.0)
RNG = np.random.default_rng(0)


# ---------------------------------------------------------------- prompt lookup

def test_lookup_copies_what_followed_the_latest_match():
    d = PromptLookupDrafter(ngram_max=3, ngram_min=1)
    ctx = [5, 1, 2, 3, 9, 9, 7, 1, 2, 3, 4, 8, 0, 1, 2, 3]
    # last 3-gram (1, 2, 3) occurs at 1 and 7; the latest is followed by 4, 8, 0
    assert d.propose(ctx, 3, GREEDY, RNG) == ([4, 8, 0], None)
    assert d.propose(ctx, 1, GREEDY, RNG) == ([4], None)


def test_lookup_prefers_longer_ngrams():
    d = PromptLookupDrafter(ngram_max=2, ngram_min=1)
    ctx = [4, 3, 2, 8, 5, 3, 7, 4, 3]
    # bigram (4, 3) at 0 -> [2, 8]; the unigram 3 alone would pick its latest match at 5 -> [7, 4]
    assert d.propose(ctx, 2, GREEDY, RNG) == ([2, 8], None)
    assert PromptLookupDrafter(ngram_max=1).propose(ctx, 2, GREEDY, RNG) == ([7, 4], None)
    ctx = [1, 9, 2, 9, 5, 9]
    # no earlier (5, 9); unigram 9 latest earlier occurrence at 3 -> followed by 5, 9
    assert d.propose(ctx, 2, GREEDY, RNG) == ([5, 9], None)


def test_lookup_overlapping_copy_fills_gamma_on_periodic_text():
    d = PromptLookupDrafter(ngram_max=2, ngram_min=1)
    ctx = [1, 2, 1, 2, 1, 2]
    assert d.propose(ctx, 5, GREEDY, RNG) == ([1, 2, 1, 2, 1], None)
    assert d.propose([4, 4], 3, GREEDY, RNG) == ([4, 4, 4], None)


def test_lookup_without_a_match_drafts_nothing():
    d = PromptLookupDrafter()
    assert d.propose([1, 2, 3, 4], 4, GREEDY, RNG) == ([], None)
    assert d.propose([1], 4, GREEDY, RNG) == ([], None)
    assert d.propose([1, 1], 0, GREEDY, RNG) == ([], None)


def test_lookup_finds_long_range_matches():
    rng = np.random.default_rng(5)
    text = rng.integers(0, 1000, size=3000).tolist()
    ctx = text + text[:40]          # the context starts to repeat itself
    assert PromptLookupDrafter().propose(ctx, 6, GREEDY, RNG) == (text[40:46], None)


def test_lookup_hint_is_the_length_of_the_verbatim_match():
    d = PromptLookupDrafter(ngram_max=3, ngram_min=1)
    assert d.hint([1, 2, 3, 4]) is None and d.hint([1]) is None          # nothing to copy: no cycle asked
    assert d.hint([5, 9, 7, 9]) == 0                                      # only the last token recurs
    assert d.hint([5, 8, 9, 7, 8, 9]) == 1                                # 2 tokens agree
    body = list(range(100, 140))
    assert d.hint([1, *body, 2, *body[:6]]) == 3                          # 6 tokens: bucket 5-8
    assert d.hint([1, *body, 2, *body[:20]]) == 5                         # 20 tokens: bucket 17+
    assert d.hint([*body, *body]) == 5                                    # capped at 32, still the top class
    # propose() after hint() copies the same match; a changed context is matched afresh
    ctx = [1, *body, 2, *body[:6]]
    d.hint(ctx)
    assert d.propose(ctx, 3, GREEDY, RNG) == (body[6:9], None)
    ctx.append(77)
    assert d.propose(ctx, 3, GREEDY, RNG) == ([], None)
    ctx[-1] = body[6]
    assert d.propose(ctx, 2, GREEDY, RNG) == (body[7:9], None)


def _lookup_brute(ctx, gamma, nmax=3, nmin=1):
    L = len(ctx)
    for n in range(min(nmax, L - 1), nmin - 1, -1):
        hits = [s for s in range(L - n) if ctx[s:s + n] == ctx[L - n:]]
        if hits:
            st = hits[-1] + n
            out = list(ctx[st:st + gamma])
            while len(out) < gamma:
                out.append(out[len(out) - (L - st)])
            return out
    return []


def test_lookup_incremental_index_equals_a_full_scan():
    """The index follows a growing context (as in the decode loop) and starts afresh on an edited one."""
    rng = np.random.default_rng(0)
    d = PromptLookupDrafter()
    for _ in range(60):
        ctx: list[int] = [int(rng.integers(0, 5))]
        vocab = int(rng.integers(2, 16))
        for _ in range(40):
            ctx.extend(rng.integers(0, vocab, size=int(rng.integers(1, 4))).tolist())
            g = int(rng.integers(1, 6))
            assert d.propose(ctx, g, GREEDY, RNG)[0] == _lookup_brute(ctx, g)
        edited = list(ctx)
        edited[len(edited) // 2] = 99
        assert d.propose(edited, 3, GREEDY, RNG)[0] == _lookup_brute(edited, 3)
        ctx[-1] = 98                           # the same list edited in place
        assert d.propose(ctx, 3, GREEDY, RNG)[0] == _lookup_brute(ctx, 3)


def test_model_drafter_hint_is_the_targets_margin():
    """The class of a model drafter's cycle: how far the target's last top logit stood above the next one."""
    assert ModelDrafter.n_classes == len(MARGINS) + 1
    row = np.zeros(1000, dtype=np.float32)
    assert margin_class(None) == 1                                  # before the first cycle
    for gap, want in ((0.0, 0), (0.5, 0), (1.5, 1), (4.0, 2), (7.0, 3), (50.0, 3)):
        r = row.copy()
        r[17] = gap
        assert margin_class(r) == want, gap
    r = row.copy()
    r[:2] = -np.inf
    r[5] = 2.0
    assert margin_class(r) == 1                                     # masked entries (a grammar) are ignored
    r = row.copy()
    r[[0, -1]] = 9.0
    assert margin_class(r) == 0                                     # a tie for the top (first and last ids)
    assert margin_class(np.full(8, -np.inf, dtype=np.float32)) == len(MARGINS)    # everything masked
    rng = np.random.default_rng(0)
    for _ in range(300):          # against the definition: the gap between the two largest entries
        r = (rng.standard_normal(int(rng.integers(1, 40))) * rng.uniform(0.2, 6)).astype(np.float32)
        if rng.random() < 0.3:
            r[rng.integers(0, len(r), size=len(r) // 2)] = -np.inf
        top = np.sort(r)[::-1]
        gap = top[0] - top[1] if len(r) > 1 and np.isfinite(top[0]) else np.inf
        assert margin_class(r) == int(np.searchsorted(MARGINS, gap, side="right")), r


def test_lookup_bad_arguments():
    with pytest.raises(InvalidArgument):
        PromptLookupDrafter(ngram_max=1, ngram_min=2)
    with pytest.raises(InvalidArgument):
        PromptLookupDrafter(ngram_min=0)


def test_factory_model_free_choices():
    assert make_drafter("none", target=None) is None
    assert make_drafter(None, target=None) is None
    d = make_drafter("lookup", target=None, spec_args=SpeculativeArgs(lookup_ngram_max=4, lookup_ngram_min=2))
    assert isinstance(d, PromptLookupDrafter) and (d.ngram_max, d.ngram_min) == (4, 2)


# ---------------------------------------------------------------- model drafter (reference backend)

def _ref(path):
    from edgerun.backends.reference import ReferenceBackend

    return ReferenceBackend(path)


def test_model_drafter_keeps_its_cache_in_step(tiny_model_factory):
    target = _ref(tiny_model_factory(arch="llama", wtype="f32", seed=0))
    drafter = ModelDrafter(_ref(tiny_model_factory(arch="llama", wtype="f32", seed=1)), target)
    ctx = target.tokenizer.tokenize("the cat is in the net")
    toks, q = drafter.propose(ctx, 4, GREEDY, RNG)
    assert len(toks) == 4 and q is None                        # greedy: a point mass, no distributions
    assert drafter.backend.tokens == ctx + toks[:-1]          # the last draft is never evaluated
    # a context that diverges from what the drafter cached: it rolls back to the common prefix
    other = ctx[:3] + [ctx[5], 7, 9]
    fresh = ModelDrafter(_ref(tiny_model_factory(arch="llama", wtype="f32", seed=1)), target)
    sampling = SamplingArgs(temperature=0.9, top_k=20, top_p=0.9, min_p=0.0)
    a = drafter.propose(other, 3, sampling, np.random.default_rng(4))
    b = fresh.propose(other, 3, sampling, np.random.default_rng(4))
    assert a[0] == b[0]
    qa = dense_rows(a[1])
    np.testing.assert_allclose(qa, dense_rows(b[1]))
    assert np.allclose(qa.sum(axis=1), 1.0) and all(qa[i, t] > 0 for i, t in enumerate(a[0]))
    # the same context again (all of it cached): the last token is re-evaluated for its logits
    assert drafter.propose(other, 3, sampling, np.random.default_rng(4))[0] == a[0]


def test_p_min_stops_drafting_when_the_drafter_is_unsure(tiny_model_factory):
    """The tiny random model spreads its probability thin (top token ~5%): p_min 0.5 drafts nothing."""
    target = _ref(tiny_model_factory(arch="llama", wtype="f32", seed=0))
    ctx = target.tokenizer.tokenize("the cat")
    unsure = ModelDrafter(_ref(tiny_model_factory(arch="llama", wtype="f32", seed=1)), target, p_min=0.5)
    assert unsure.propose(ctx, 4, GREEDY, RNG) == ([], None)
    sure = ModelDrafter(_ref(tiny_model_factory(arch="llama", wtype="f32", seed=1)), target, p_min=0.001)
    assert len(sure.propose(ctx, 4, GREEDY, RNG)[0]) == 4
    with pytest.raises(InvalidArgument):
        ModelDrafter(sure.backend, target, p_min=1.0)


def test_larger_drafter_warns(tiny_model_factory, caplog):
    target = _ref(tiny_model_factory(arch="llama", wtype="f32", seed=0))
    big = _ref(tiny_model_factory(arch="llama", wtype="f32", seed=1, n_embd=128, n_ff=256))
    with caplog.at_level(logging.WARNING, logger="edgerun.speculative.drafters"):
        ModelDrafter(big, target)
    assert any("larger than target" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="edgerun.speculative.drafters"):
        ModelDrafter(target, big)
    assert not caplog.records


# ---------------------------------------------------------------- vocabularies (llama.cpp, real files)

def _write_with_vocab(monkeypatch, path, edit, **kw):
    """A tiny GGUF whose vocabulary is tinymodel's passed through edit(tokens, types)."""
    import tinymodel

    original = tinymodel.tiny_vocab

    def patched():
        tokens, types, merges = original()
        tokens, types = edit(list(tokens), list(types))
        return tokens, types, merges

    with monkeypatch.context() as m:
        m.setattr(tinymodel, "tiny_vocab", patched)
        return tinymodel.write_tiny_model(path, **kw)


def _renamed_special(tokens, types):
    tokens[tokens.index("<|im_start|>")] = "<|begin|>"
    return tokens, types


def _extra_real_token(tokens, types):
    return tokens + ["<|tool|>"], types + [3]


def _padded(tokens, types):
    n = len(tokens)
    return tokens + [f"[PAD{i}]" for i in range(n, n + 8)], types + [5] * 8    # 5 = UNUSED


def _llama(path):
    from edgerun.backends.llamacpp import LlamaCppBackend
    from edgerun.config import BackendArgs

    return LlamaCppBackend(path, BackendArgs(n_ctx=128, n_threads=1))


_TOKENS = tiny_vocab()[0]


@pytest.mark.parametrize("edit, expect", [
    (_renamed_special, [f"token {_TOKENS.index('<|im_start|>')} is '<|begin|>'", "'<|im_start|>'"]),
    (_extra_real_token, [f"token {len(_TOKENS)} '<|tool|>'", "not padding"]),
])
def test_mismatched_vocabulary_is_refused(tiny_model_factory, tmp_path, monkeypatch, edit, expect):
    pytest.importorskip("llama_cpp")
    target = _llama(tiny_model_factory(arch="llama", wtype="q8_0", seed=0))
    other = _llama(_write_with_vocab(monkeypatch, tmp_path / "other.gguf", edit, wtype="q8_0", seed=1))
    with pytest.raises(VocabMismatch) as e:
        ModelDrafter(other, target)
    msg = str(e.value)
    assert target.name in msg and other.name in msg
    for piece in expect:
        assert piece in msg


def test_padding_entries_are_accepted_and_masked(tiny_model_factory, tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp")
    from edgerun.generate import generate
    from edgerun.speculative.gamma import FixedGamma

    plain_path = tiny_model_factory(arch="llama", wtype="q8_0", seed=0)
    padded_path = _write_with_vocab(monkeypatch, tmp_path / "padded.gguf", _padded, wtype="q8_0", seed=0)
    plain_be, padded_be = _llama(plain_path), _llama(padded_path)
    assert padded_be.n_vocab == plain_be.n_vocab + 8
    assert padded_be.vocab_fingerprint != plain_be.vocab_fingerprint
    for target, draft in ((plain_be, _llama(padded_path)), (padded_be, _llama(plain_path))):
        d = ModelDrafter(draft, target)
        assert d.n_shared == plain_be.n_vocab
        prompt = target.tokenizer.tokenize("the cat is in the")
        toks, q = d.propose(prompt, 3, SamplingArgs(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
                            np.random.default_rng(0))
        q = dense_rows(q)
        assert q.shape == (3, target.n_vocab)                 # q speaks the target's ids
        assert not q[:, d.n_shared:].any()                    # padding is never drafted
        np.testing.assert_allclose(q.sum(axis=1), 1.0)
        target.truncate(0)
        plain = [s.token for s in generate(target, prompt, GREEDY, max_tokens=12)]
        spec = [s.token for s in generate(target, prompt, GREEDY, max_tokens=12, drafter=d,
                                          policy=FixedGamma(3))]
        assert spec == plain


def test_cli_refuses_a_drafter_of_another_vocabulary(tiny_model_factory, tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp")
    from click.testing import CliRunner

    from edgerun.cli import main

    target = tiny_model_factory(arch="llama", wtype="q8_0", seed=0)
    other = _write_with_vocab(monkeypatch, tmp_path / "other.gguf", _renamed_special, wtype="q8_0", seed=1)
    r = CliRunner().invoke(main, ["generate", "hi", "--model", str(target), "--draft", str(other),
                                  "--profile", "generic-x86_64-cpu", "--threads", "1", "--ctx", "128"])
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("error: ") and "different vocabularies" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output
