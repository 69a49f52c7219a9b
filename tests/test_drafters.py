"""Drafters (edgerun/spec/drafters.py): prompt lookup, the model drafter's cache discipline and
p_min, and the vocabulary check that refuses a drafter of another model family."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from edgerun.config import SamplingArgs, SpeculativeArgs
from edgerun.errors import InvalidArgument, VocabMismatch
from edgerun.spec.drafters import ModelDrafter, PromptLookupDrafter, make_drafter

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
