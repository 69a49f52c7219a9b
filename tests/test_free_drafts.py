"""Grammar-forced runs in the decode loop (docs/free_drafts.md), on the numpy reference backend.

- Unit: forced_token() is the mask's only token (an end where only ends are allowed), None where the
  mask allows a choice, even where llguidance's ff_tokens proposes a token.
- Golden: greedy output with forced runs == the token-by-token path (forced_runs=False), token for token
  and finish reason, for a JSON schema, a Lark and a regex grammar and the tool-call grammar, plain and
  with a model drafter and prompt lookup; fewer target calls; each forced run after a sampled token is
  evaluated in the one call of the next cycle.
- Limits: max_tokens, stop strings and a stream closed inside a forced run give what the token-by-token
  path gives; afterwards the constraint holds the committed tokens and the cache a prefix of them.
- Statistics: the joint law of a grammar with forced runs at the start, between and after sampled
  positions, sampled through the loop (plain, model drafter, lookup), passes a chi-square test against the
  masked target law enumerated exactly, at temperature 1 and at 0.7 + top-p 0.9. Two known-wrong variants
  fail it: a backend that returns the run's first row instead of its last (logits at the wrong position),
  and taking llguidance's ff_tokens as forced where the mask allows more than one token.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgerun.backends.reference import ReferenceBackend
from edgerun.config import SamplingArgs
from edgerun.constrain.grammar import Grammar, GrammarConstraint
from edgerun.constrain.tools import parse_tool_choice, parse_tools, tool_grammar
from edgerun.errors import InvalidArgument
from edgerun.generate import GenStats, generate
from edgerun.speculative.drafters import ModelDrafter, PromptLookupDrafter
from edgerun.speculative.gamma import FixedGamma
from edgerun.speculative.sampling import probs
from test_constrain import END, SETTINGS, exact_law
from test_verify import P_FAIL, P_PASS, chisquare_pooled

GREEDY = SamplingArgs(temperature=0.0)
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "kind": {"type": "string", "enum": ["cat", "dog", "bird"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    "n": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}},
    "required": ["name", "kind", "tags", "n", "ok"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}}


@pytest.fixture(scope="module")
def ref(tiny_model_factory):
    target = ReferenceBackend(tiny_model_factory(arch="llama", wtype="f32", seed=0))
    bad = ReferenceBackend(tiny_model_factory(arch="llama", wtype="f32", seed=1))
    return target, bad


def grammars() -> dict[str, Grammar]:
    tools = parse_tools([WEATHER])
    return {"json_schema": Grammar.json_schema(SCHEMA),
            "lark": Grammar.lark('start: "the " WORD (" " WORD)* "."\nWORD: /[a-z]{1,6}/'),
            "regex": Grammar.regex(r"kx(in|is|at|an)qv( (the|a) [a-z]{2,5}){2,4}!"),
            "tools": tool_grammar(tools, parse_tool_choice("required", tools))}


def run(target, prompt, constraint, sampling=GREEDY, drafter=None, gamma=0, rng=None, max_tokens=100,
        forced=True, stop=()):
    stats = GenStats()
    steps = list(generate(target, prompt, sampling, max_tokens=max_tokens, drafter=drafter, stop=stop,
                          policy=FixedGamma(gamma), rng=rng or np.random.default_rng(0), stats=stats,
                          constraint=constraint, forced_runs=forced))
    return steps, stats


def toks(steps) -> list[int]:
    return [s.token for s in steps]


def is_prefix(a, b) -> bool:
    return list(b[:len(a)]) == list(a)


# ---------------------------------------------------------------- the constraint's forced token

def test_forced_token_is_the_only_allowed_token(ref):
    target, _ = ref
    tok = target.tokenizer
    k, x, a, t, h, he = (tok.tokenize(s, add_bos=False)[0] for s in ("k", "x", "a", "t", "h", "he"))
    assert tok.tokenize("he", add_bos=False) == [he]                 # one token of the tiny vocabulary
    c = GrammarConstraint(Grammar.regex(r"kx[ab]"), tok, target.n_vocab)
    assert c.forced_token() == k
    c.consume(k)
    assert c.forced_token() == x
    c.consume(x)
    assert c.forced_token() is None and np.count_nonzero(c.mask()) == 2
    c.consume(a)
    end = c.forced_token()                       # complete: only ends are allowed, the generation ends
    assert end is not None and tok.is_eog(end)
    # 'the cat' is forced as bytes: llguidance's mask allows only their canonical tokens, one at a time
    c = GrammarConstraint(Grammar.regex(r"the cat[cd]"), tok, target.n_vocab)
    assert c.forced_token() == t and c.ff_tokens()[:2] == [t, he]
    c.consume(t)
    assert not c.mask()[h] and c.forced_token() == he


@pytest.mark.parametrize("kind", ["json_schema", "regex", "tools"])
def test_ff_tokens_propose_only_where_the_mask_forces(ref, kind):
    """On random walks through the grammars: wherever llguidance 1.9.1 proposes ff_tokens, the first one is
    the forced token (its mask already allows only the canonical spelling of forced bytes); so an ff token
    never needs to be a draft here. Were it proposed where the mask allows more, it could enter only as a
    point-mass draft (docs/free_drafts.md); bench/free_drafts.py counts such positions on real vocabularies."""
    target, _ = ref
    tok = target.tokenizer
    c = GrammarConstraint(grammars()[kind], tok, target.n_vocab)
    rng = np.random.default_rng(0)
    proposed = 0
    for _ in range(20):
        c.reset()
        for _ in range(40):
            allowed = [int(i) for i in np.flatnonzero(c.mask()) if not tok.is_eog(int(i))]
            if not allowed:
                break
            ff = c.ff_tokens()
            if ff:
                proposed += 1
                assert ff[0] == c.forced_token()
            c.consume(int(rng.choice(allowed)))
    assert proposed > 20


# ---------------------------------------------------------------- golden runs

@pytest.mark.parametrize("kind", list(grammars()))
def test_greedy_forced_runs_equal_the_token_by_token_path(ref, kind):
    target, bad = ref
    tok = target.tokenizer
    c = GrammarConstraint(grammars()[kind], tok, target.n_vocab)
    for text in ("Hello there, the world", "the net is in the net is in the"):
        prompt = tok.tokenize(text)
        e0 = target.n_evals
        old, st_old = run(target, prompt, c, forced=False)
        e1 = target.n_evals
        new, st = run(target, prompt, c)
        e2 = target.n_evals
        assert toks(new) == toks(old) and st.finish_reason == st_old.finish_reason
        assert "".join(s.text for s in new) == "".join(s.text for s in old)
        assert st.n_forced > 0 and st_old.n_forced == 0 and sum(s.forced for s in new) == st.n_forced
        assert e2 - e1 < e1 - e0                         # the forced tokens cost no call of their own
        assert e2 - e1 <= st.n_cycles + 1                # one call per cycle (+ the prefill)
        if kind == "json_schema" and st.finish_reason == "eos":
            assert set(json.loads(tok.detokenize(toks(new)).decode())) == set(SCHEMA["properties"])
        for drafter in (ModelDrafter(bad, target), PromptLookupDrafter()):
            for gamma in (1, 4):
                spec, st_s = run(target, prompt, c, drafter=drafter, gamma=gamma)
                assert toks(spec) == toks(old), (text, drafter.name, gamma)
                assert 0 < st_s.n_forced <= st.n_forced       # a draft may hold forced tokens too


def test_a_forced_run_is_evaluated_with_the_token_before_it_in_one_call(ref):
    """Counting backend: after a sampled token followed by a run of k forced tokens, the next call
    evaluates 1 + k positions and asks for one row of logits."""
    target, _ = ref
    tok = target.tokenizer
    calls = []
    real = target.eval

    def spy(tokens, n_logits=None):
        calls.append((len(tokens), n_logits))
        return real(tokens, n_logits)

    target.eval = spy
    try:
        c = GrammarConstraint(Grammar.regex(r"kx(in|is|at|an)qvz[0-9]"), tok, target.n_vocab)
        prompt = tok.tokenize("Hello")
        steps, st = run(target, prompt, c)
    finally:
        del target.eval
    # prefill (no logits), [pending, k, x] -> 1 row, [i?, ...] ..., [sampled, q, v, z] -> 1 row
    assert calls[0][1] == 0
    assert (3, 1) in calls and (4, 1) in calls
    assert st.n_forced_runs >= 2 and [s.forced for s in steps][:2] == [True, True]


# ---------------------------------------------------------------- limits, stop strings, rollback

def test_max_tokens_inside_a_forced_run(ref):
    target, _ = ref
    tok = target.tokenizer
    c = GrammarConstraint(Grammar.json_schema(SCHEMA), tok, target.n_vocab)
    prompt = tok.tokenize("Hello there")
    full, _ = run(target, prompt, c, max_tokens=40, forced=False)
    for m in range(0, 25):
        new, st = run(target, prompt, c, max_tokens=m)
        assert toks(new) == toks(full)[:m] and st.finish_reason == "length"
        assert c.tokens == toks(new)
        assert is_prefix(target.tokens, prompt + toks(new)[:-1] if new else prompt[:-1])


def test_stop_strings_inside_a_forced_run(ref):
    target, _ = ref
    tok = target.tokenizer
    c = GrammarConstraint(Grammar.json_schema(SCHEMA), tok, target.n_vocab)
    prompt = tok.tokenize("Hello there")
    full = toks(run(target, prompt, c, forced=False)[0])
    for stop in (['"kind'], ['nd": "'], ['"tags": ['], ['ok'], ["}"]):
        old, st_old = run(target, prompt, c, forced=False, stop=stop)
        text_old = "".join(s.text for s in old)
        new, st = run(target, prompt, c, stop=stop)
        assert "".join(s.text for s in new) == text_old and st.finish_reason == st_old.finish_reason, stop
        assert st.finish_reason == "stop" and stop[0] not in text_old
        # the constraint holds the committed tokens (those released, and any held back for the stop check)
        assert is_prefix(toks(new), c.tokens) and is_prefix(c.tokens, full)
        assert is_prefix(target.tokens, prompt + c.tokens)


def test_closing_the_stream_inside_a_forced_run(ref):
    target, bad = ref
    tok = target.tokenizer
    c = GrammarConstraint(Grammar.json_schema(SCHEMA), tok, target.n_vocab)
    prompt = tok.tokenize("Hello there")
    full, _ = run(target, prompt, c, forced=False)
    for drafter, gamma in ((None, 0), (ModelDrafter(bad, target), 3)):
        for k in range(1, 20):
            stream = generate(target, prompt, GREEDY, max_tokens=60, drafter=drafter, policy=FixedGamma(gamma),
                              rng=np.random.default_rng(0), constraint=c)
            taken = [next(stream).token for _ in range(k)]
            stream.close()
            assert taken == toks(full)[:k]
            assert c.tokens == taken and is_prefix(target.tokens, (prompt + taken)[:-1])
            again, _ = run(target, prompt, c, drafter=drafter, gamma=gamma)     # the cache is reused from here
            assert toks(again) == toks(full)


# ---------------------------------------------------------------- statistics

N_SAMPLES = 1200


@pytest.fixture(scope="module")
def peaked_setup(peaked):
    """The peaked target of conftest.py and its noisy copy; a grammar forced at its start ('kx'), sampled
    at two positions out of three of the target's likelier letters, forced in between ('qv') and at its end."""
    T, D, tok = peaked
    prompt = tok.tokenize("Hello there")
    p0 = probs(T.forward(prompt + tok.tokenize("kx", add_bos=False), T.new_cache())[-1], SETTINGS["t1"])
    single = [i for i in range(tok.n_vocab) if len(tok.token_bytes(i)) == 1 and tok.token_bytes(i).isalpha()
              and tok.token_bytes(i) not in b"kxqvhe"]
    # three letters of similar probability (ranks 3-5): no one of them takes top-p 0.9's whole nucleus
    fav = "".join(tok.token_bytes(i).decode() for i in sorted(single, key=lambda i: -p0[i])[2:5])
    return T, D, tok, prompt, Grammar.regex(f"kx[{fav}]qv[{fav}]"), fav


def sample_law(target, drafter, prompt, sampling, grammar, n, seed, keys, gamma=2, forced=True):
    rng = np.random.default_rng(seed)
    c = GrammarConstraint(grammar, target.tokenizer, target.n_vocab)
    index = {k: i for i, k in enumerate(keys)}
    counts = np.zeros(len(keys) + 1, dtype=np.int64)              # last cell: a sequence outside the law
    n_forced = 0
    for _ in range(n):
        steps, st = run(target, prompt, c, sampling, drafter=drafter, gamma=gamma, rng=rng, max_tokens=8,
                        forced=forced)
        key = tuple(toks(steps)) + ((END,) if st.finish_reason == "eos" else ())
        counts[index.get(key, len(keys))] += 1
        n_forced += st.n_forced
    return counts, n_forced


def _law(peaked_setup, setting):
    T, D, tok, prompt, grammar, _ = peaked_setup
    sampling = SETTINGS[setting]
    law = exact_law(T, tok, prompt, sampling, grammar)
    keys = sorted(law)
    expected = np.array([law[k] for k in keys] + [0.0])
    assert abs(expected.sum() - 1.0) < 1e-9 and len(keys) >= 4
    return sampling, keys, expected


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("mode", ["plain", "model", "lookup"])
def test_forced_runs_follow_the_masked_target(peaked_setup, setting, mode):
    T, D, tok, prompt, grammar, fav = peaked_setup
    sampling, keys, expected = _law(peaked_setup, setting)
    target = ReferenceBackend(T, tokenizer=tok)
    drafter = {"plain": None, "model": ModelDrafter(ReferenceBackend(D, tokenizer=tok), target),
               "lookup": PromptLookupDrafter()}[mode]
    if mode == "lookup":      # a prompt whose lookup proposes after the forced 'qv' (allowed and forbidden letters)
        prompt = tok.tokenize(f"Hello qv{fav[0]}q there")
        law = exact_law(T, tok, prompt, sampling, grammar)
        keys = sorted(law)
        expected = np.array([law[k] for k in keys] + [0.0])
    counts, n_forced = sample_law(target, drafter, prompt, sampling, grammar,
                                  N_SAMPLES if drafter else N_SAMPLES // 2, seed=5, keys=keys)
    assert counts[-1] == 0                      # nothing outside the grammar
    # k, x forced in every sample, and q, v unless a draft already held them
    assert n_forced >= (2 if drafter else 4) * counts.sum()
    assert chisquare_pooled(counts, expected) > P_PASS


class _LastRowIsTheFirst:
    """The known-wrong backend: asked for the last row of several positions, it returns the first one's."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def eval(self, tokens, n_logits=None):
        if n_logits == 1 and len(tokens) > 1:
            return self.inner.eval(tokens)[:1]
        return self.inner.eval(tokens, n_logits)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_logits_at_the_wrong_position_fail_the_same_test(peaked_setup, setting):
    T, _, tok, prompt, grammar, _ = peaked_setup
    sampling, keys, expected = _law(peaked_setup, setting)
    target = _LastRowIsTheFirst(ReferenceBackend(T, tokenizer=tok))
    counts, _ = sample_law(target, None, prompt, sampling, grammar, N_SAMPLES // 2, seed=5, keys=keys)
    # inside the grammar (masked), but the law is wrong: with top-p, sequences outside its support even
    assert counts[-1] > 0 or chisquare_pooled(counts, expected) < P_FAIL


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_choice_taken_as_forced_fails_the_same_test(peaked_setup, setting, monkeypatch):
    """The known-wrong criterion: a token the grammar proposes (here the first allowed one) appended unsampled
    while the mask allows others, as taking ff tokens for forced would where a choice of spellings exists."""
    T, _, tok, prompt, grammar, _ = peaked_setup
    sampling, keys, expected = _law(peaked_setup, setting)
    target = ReferenceBackend(T, tokenizer=tok)
    real = GrammarConstraint.forced_token

    def proposal_forced(self):
        allowed = np.flatnonzero(self.mask())
        return int(allowed[0]) if 1 < len(allowed) <= 3 else real(self)

    monkeypatch.setattr(GrammarConstraint, "forced_token", proposal_forced)
    wrong, n_forced = sample_law(target, None, prompt, sampling, grammar, N_SAMPLES // 2, seed=5, keys=keys)
    assert n_forced > 0 and wrong[-1] == 0
    assert chisquare_pooled(wrong, expected) < P_FAIL


def test_an_end_the_loop_does_not_end_on_is_not_forced(ref):
    """With an is_eog that leaves out the grammar's ends, a complete grammar's only tokens are not taken as a
    forced end (the loop samples as before: here it runs to max_tokens on the end it does not stop at)."""
    target, _ = ref
    tok = target.tokenizer
    c = GrammarConstraint(Grammar.regex(r"kx"), tok, target.n_vocab)
    prompt = tok.tokenize("Hello")
    steps = list(generate(target, prompt, GREEDY, max_tokens=2, constraint=c, is_eog=lambda t: False))
    assert [s.forced for s in steps] == [True, True]
    with pytest.raises(InvalidArgument):    # the third: an end sampled as before, which the grammar does not consume
        list(generate(target, prompt, GREEDY, max_tokens=3, constraint=c, is_eog=lambda t: False))
