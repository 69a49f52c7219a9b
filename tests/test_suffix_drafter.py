"""Suffix lookup (edgerun/spec/suffix.py): the suffix automaton's match against brute force, and the drafter
through the decode loop on the reference backend.

- The automaton, extended token by token over random texts of small alphabets (many repeats): after every
  token its match length is the longest suffix that also ends earlier (brute force), and the continuation
  it points at follows a real earlier occurrence of that suffix.
- The drafter: greedy speculative == greedy plain for several prompts and gammas, plain and under a grammar
  (with forced runs); on a text that repeats an earlier one it drafts the continuation of the longest match;
  a context that is not an extension rebuilds the automaton.
"""

from __future__ import annotations

import numpy as np
import pytest

from edgerun.backends.reference import ReferenceBackend
from edgerun.config import SamplingArgs
from edgerun.constrain.grammar import Grammar, GrammarConstraint
from edgerun.generate import GenStats, generate
from edgerun.speculative.drafters import make_drafter
from edgerun.speculative.gamma import FixedGamma
from edgerun.speculative.suffix import SuffixAutomaton, SuffixDrafter

GREEDY = SamplingArgs(temperature=0.0)


def brute_match(toks: list[int]) -> int:
    """Length of the longest suffix of toks that also ends at an earlier position."""
    n = len(toks)
    best = 0
    for k in range(1, n):
        suffix = toks[n - k:]
        if any(toks[e - k + 1:e + 1] == suffix for e in range(k - 1, n - 1)):
            best = k
        else:
            break
    return best


@pytest.mark.parametrize("alphabet", [2, 3, 5])
def test_the_automaton_finds_the_longest_earlier_match(alphabet):
    rng = np.random.default_rng(alphabet)
    for _ in range(20):
        sa = SuffixAutomaton()
        toks: list[int] = []
        for t in rng.integers(0, alphabet, 60):
            sa.extend(int(t))
            toks.append(int(t))
            k, end = sa.match()
            assert k == brute_match(toks)
            if k:
                assert end < len(toks) - 1 and toks[end - k + 1:end + 1] == toks[len(toks) - k:]
            else:
                assert end == -1


def test_the_states_stay_linear():
    sa = SuffixAutomaton()
    for t in np.random.default_rng(0).integers(0, 4, 2000):
        sa.extend(int(t))
    assert len(sa.next) <= 2 * 2000                      # at most 2n - 1 states


@pytest.fixture(scope="module")
def target(tiny_model_factory):
    return ReferenceBackend(tiny_model_factory(arch="llama", wtype="f32", seed=0))


def run(target, prompt, drafter=None, gamma=0, constraint=None, max_tokens=32):
    stats = GenStats()
    toks = [s.token for s in generate(target, prompt, GREEDY, max_tokens=max_tokens, drafter=drafter,
                                      policy=FixedGamma(gamma), rng=np.random.default_rng(0), stats=stats,
                                      constraint=constraint)]
    return toks, stats


def test_greedy_suffix_speculation_equals_plain(target):
    tok = target.tokenizer
    d = make_drafter("suffix", target)
    assert isinstance(d, SuffixDrafter)
    grammar = GrammarConstraint(Grammar.regex(r"kx(in|is|at|an)( (the|a) [a-z]{2,5}){2,4}!"), tok, target.n_vocab)
    for text in ("Hello there, the world", "the net is in the net is in the", "a b a b a b a b"):
        prompt = tok.tokenize(text)
        plain, _ = run(target, prompt)
        for gamma in (1, 3, 6):
            spec, st = run(target, prompt, d, gamma)
            assert spec == plain, (text, gamma)
        plain_c, _ = run(target, prompt, constraint=grammar)
        spec_c, _ = run(target, prompt, d, 4, constraint=grammar)
        assert spec_c == plain_c


def test_a_repeated_text_is_drafted_from_its_longest_match(target):
    """A prompt that ends with a text seen earlier: the draft is what followed the earlier occurrence of the
    longest match, where a shorter key would have pointed elsewhere (the latest 'the' here)."""
    tok = target.tokenizer
    key = tok.tokenize("the net is in", add_bos=False)
    seen = key + tok.tokenize(" the box", add_bos=False)
    prompt = tok.tokenize("x") + seen + tok.tokenize(" and the cat;", add_bos=False) + key
    d = SuffixDrafter()
    k, _ = d._match(prompt)
    assert k == len(key)
    assert 9 <= k <= 16 and d.hint(prompt) == 4                  # the 9-16 class
    draft, q = d.propose(prompt, 3, GREEDY, np.random.default_rng(0))
    assert q is None and draft == seen[k:k + 3]
    plain, _ = run(target, prompt)
    assert run(target, prompt, d, 3)[0] == plain


def test_a_new_context_rebuilds_the_automaton():
    d = SuffixDrafter()
    a = [1, 2, 3, 1, 2]
    assert d.propose(a, 2, GREEDY, np.random.default_rng(0))[0] == [3, 1]
    b = [7, 8, 9, 7]                                  # another request: nothing of a may be drafted
    assert d.propose(b, 3, GREEDY, np.random.default_rng(0))[0] == [8, 9, 7]
    assert d.hint([5, 6], None) is None


def test_a_copy_resumes_past_an_edit():
    """A file returned with one name changed: after the edit the longest match is one common token, whose recent
    occurrence drafts what followed it elsewhere; the copy's source a token past the break goes on verbatim, and the resumed-copy classes (6: one token matched since the edit, 7: two or
    more) draft it. The known-wrong draft (the longest match's) is checked to be wrong here."""
    src = [t for i in range(60) for t in (100 + i, 7)]            # distinct names, each followed by a common token
    ctx = [1] + src + [2] + src[:40]                                 # the answer copied the file up to name 120...
    d = SuffixDrafter()
    assert d.hint(ctx) == 5                                          # a 17+ match: the copy being followed
    ctx += [999]                                                     # ...which it renames
    assert d.hint(ctx) is None                                       # nothing holds the new name
    ctx += [7]
    k, end = d._sa.match() if d.hint(ctx) is not None else (0, -1)
    assert k == 1 and ctx[end + 1] != 121                            # the longest match drafts something else
    assert d.hint(ctx) == 6
    draft, q = d.propose(ctx, 6, GREEDY, np.random.default_rng(0))
    assert q is None and draft == [121, 7, 122, 7, 123, 7]
    ctx += [121]
    assert d.hint(ctx) == 7 and d.propose(ctx, 3, GREEDY, np.random.default_rng(0))[0] == [7, 122, 7]
    ctx += src[43:43 + 9]                                            # a long match again: its own class
    assert d.hint(ctx) == 4


def test_a_copy_resumes_only_near_its_break():
    """No resumption without a long copy, or once RESUME_AFTER tokens have passed since it broke."""
    from edgerun.speculative.suffix import RESUME_AFTER
    src = [t for i in range(60) for t in (100 + i, 7)]
    d = SuffixDrafter()
    short = [1] + src + [2] + src[:4] + [999, 7]                     # a 4-token match broke: nothing to resume
    assert d.hint(short) == 0
    far = [1] + src + [2] + src[:40] + [999] + [500 + i for i in range(RESUME_AFTER)] + [7]
    assert d.hint(far) == 0
    near = [1] + src + [2] + src[:40] + [999] + [500 + i for i in range(RESUME_AFTER - 2)] + [7]
    assert d.hint(near) == 6
