"""The decode loop: stop strings, EOS, max_tokens, cancellation rollback, prompt-cache reuse."""

import numpy as np
import pytest

from edgerun.backends.llamacpp import LlamaCppBackend
from edgerun.config import BackendArgs, SamplingArgs
from edgerun.errors import ContextOverflow
from edgerun.generate import GenStats, Step, _TextReleaser, generate

GREEDY = SamplingArgs(temperature=0)


@pytest.fixture(scope="module")
def target(tiny_llama):
    b = LlamaCppBackend(tiny_llama, BackendArgs(n_ctx=256, n_threads=2))
    yield b
    b.close()


def run(target, prompt, **kw):
    stats = GenStats()
    steps = list(generate(target, prompt, kw.pop("sampling", GREEDY), stats=stats, **kw))
    return steps, stats


def prompt_of(target, text="the cat is in the"):
    return target.tokenizer.tokenize(text, add_bos=False)


def test_releaser_holds_back_possible_stop_prefix():
    pieces = {1: b"Hel", 2: b"lo ", 3: b"EN", 4: b"D!", 5: b"E", 6: b"x"}
    r = _TextReleaser(pieces.__getitem__, ["END"])
    meta = (False, 0, 0, 0.0, 0.0)
    assert [s.text for s in r.push(1, *meta)[0]] == ["Hel"]
    assert [s.text for s in r.push(2, *meta)[0]] == ["lo "]
    assert r.push(3, *meta) == ([], False)                      # "EN" may begin "END"
    steps, hit = r.push(4, *meta)
    assert hit and steps == []                                  # the stop string itself is not released
    r2 = _TextReleaser(pieces.__getitem__, ["END"])
    assert r2.push(5, *meta) == ([], False)
    steps, hit = r2.push(6, *meta)                              # "Ex": not a stop after all: released
    assert not hit and "".join(s.text for s in steps) == "Ex"


def test_releaser_cuts_a_piece_before_the_stop_and_keeps_its_step():
    pieces = {1: b"He", 2: b"yEN", 3: b"D"}
    r = _TextReleaser(pieces.__getitem__, ["END"])
    steps, hit = r.push(1, True, 2, 1, 0.5, 0.25)
    assert not hit and steps == [Step(1, "He", True, 2, 1, 0.5, 0.25)]
    assert r.push(2, False, 2, 1, 0.0, 0.0) == ([], False)     # "yEN" may begin "END": held back
    steps, hit = r.push(3, False, 0, 0, 0.1, 0.2)
    assert hit and steps == [Step(2, "y", False, 2, 1, 0.0, 0.0)]   # cut before the stop, metadata kept


def test_releaser_splits_multibyte_utf8():
    pieces = {1: "é".encode()[:1], 2: "é".encode()[1:] + b"a"}
    r = _TextReleaser(pieces.__getitem__, [])
    meta = (False, 0, 0, 0.0, 0.0)
    assert r.push(1, *meta)[0][0].text == ""
    assert r.push(2, *meta)[0][0].text == "éa"


def test_max_tokens_and_stats(target):
    steps, stats = run(target, prompt_of(target), max_tokens=12)
    assert len(steps) == 12 and stats.n_tokens == 12 and stats.finish_reason == "length"
    assert stats.n_cycles == 12 and stats.n_drafted == 0
    assert target.n_past == len(prompt_of(target)) + 12 - 1     # committed minus the pending token


def test_stop_string_cuts_text(target):
    steps, _ = run(target, prompt_of(target), max_tokens=30)
    text = "".join(s.text for s in steps)
    stop = text[10:14]
    assert stop.strip(), f"need a visible stop string, got {text!r}"
    first = text.find(stop)
    steps2, stats2 = run(target, prompt_of(target), max_tokens=30, stop=[stop])
    assert "".join(s.text for s in steps2) == text[:first]
    assert stats2.finish_reason == "stop"


def test_eos_ends_generation(target):
    steps, _ = run(target, prompt_of(target), max_tokens=20)
    eos_token = steps[5].token
    steps2, stats2 = run(target, prompt_of(target), max_tokens=20, is_eog=lambda t: t == eos_token)
    first = next(i for i, s in enumerate(steps) if s.token == eos_token)
    assert [s.token for s in steps2] == [s.token for s in steps[:first]]
    assert stats2.finish_reason == "eos"


def test_closing_the_stream_rolls_back_and_next_logits_match_fresh(target):
    prompt = prompt_of(target)
    gen = generate(target, prompt, GREEDY, max_tokens=50)
    got = [next(gen).token for _ in range(4)]
    gen.close()
    committed = prompt + got
    assert target.tokens == committed[:-1]
    nxt = target.eval([committed[-1]])[-1]
    target.truncate(0)
    fresh = target.eval(committed)[-1]
    np.testing.assert_allclose(nxt, fresh, rtol=1e-4, atol=1e-4)


def test_prefix_is_reused_and_results_are_identical(target):
    prompt = prompt_of(target, "the water is in the")
    a, _ = run(target, prompt, max_tokens=8)
    b, stats = run(target, prompt + [a[0].token], max_tokens=7)   # cache already holds most of it
    assert [s.token for s in b] == [s.token for s in a[1:]]
    assert stats.t_prefill_s >= 0


def test_seeded_sampling_is_reproducible(target):
    s = SamplingArgs(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    a, _ = run(target, prompt_of(target), max_tokens=15, sampling=s, rng=np.random.default_rng(7))
    b, _ = run(target, prompt_of(target), max_tokens=15, sampling=s, rng=np.random.default_rng(7))
    c, _ = run(target, prompt_of(target), max_tokens=15, sampling=s, rng=np.random.default_rng(8))
    assert [x.token for x in a] == [x.token for x in b]
    assert [x.token for x in a] != [x.token for x in c]


def test_prompt_longer_than_context(target):
    with pytest.raises(ContextOverflow, match="context holds"):
        run(target, [10] * (target.n_ctx + 5), max_tokens=1)


def test_generation_stops_when_context_is_full(target):
    prompt = [10 + i % 100 for i in range(target.n_ctx - 5)]
    steps, stats = run(target, prompt, max_tokens=50)
    assert stats.finish_reason == "length" and len(steps) <= 6


def test_acceptance_statistics():
    st = GenStats()
    for gamma, acc in ((4, 2), (4, 4), (2, 0), (0, 0)):
        st.record_cycle(gamma, acc, 0.01, 0.02)
    assert st.n_drafted == 10 and st.n_accepted == 6 and st.n_rejected == 2
    assert st.acceptance_rate == 0.6 and st.alpha == 0.75
    assert st.accept_histogram == [1, 0, 1, 0, 1]
    assert st.n_cycles == 4 and st.gamma_mean == 2.5
    assert st.mean_accepted_per_cycle == 2.0


def test_a_reused_stats_object_does_not_stop_the_next_generation(target):
    st = GenStats()
    list(generate(target, prompt_of(target), GREEDY, max_tokens=3, stats=st))
    assert st.finish_reason == "length"
    steps = list(generate(target, prompt_of(target), GREEDY, max_tokens=5, stats=st))
    assert len(steps) == 5
