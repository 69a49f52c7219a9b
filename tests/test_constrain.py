"""Grammar-constrained decoding (edgerun/constrain/) through the one decode loop, exact under speculation.

- Unit: the llguidance constraint's mask, consume, rollback; JSON Schema / Lark / regex compile
  errors are InvalidArgument naming what failed; padding rows are never allowed.
- Golden (numpy reference backend): greedy constrained speculative == greedy constrained plain, token
  for token, with a model drafter and prompt lookup; every output matches the grammar.
- Rollback: at every cycle the constraint holds exactly the committed tokens (a drafter wrapper
  checks it each time it is asked to draft); a loop that skips the rollback is caught.
- Statistics: a grammar that allows four single letters at each of two positions, where the
  drafter's unmasked favourite is forbidden: the joint law of the generated tokens, sampled through
  the loop with a model drafter and with lookup, passes a chi-square test against the masked target
  law enumerated exactly, at temperature 1 and at 0.7 + top-p 0.9; the known-wrong variant (draft
  unconstrained, cut at the first forbidden token, sample from p) fails it.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from edgerun.backends.reference import ReferenceBackend
from edgerun.config import SamplingArgs
from edgerun.constrain.grammar import Grammar, GrammarConstraint, grammar_from_options
from edgerun.constrain.tools import ToolCallStream, ToolChoice, parse_tool_calls, parse_tool_choice, parse_tools, \
    special_tag_ids, tool_grammar
from edgerun.errors import InvalidArgument
from edgerun.generate import GenStats, generate
from edgerun.reference.llama import ReferenceModel
from edgerun.speculative.drafters import ModelDrafter, PromptLookupDrafter
from edgerun.speculative.gamma import FixedGamma
from edgerun.speculative.sampling import probs
from test_verify import P_FAIL, P_PASS, chisquare_pooled

GREEDY = SamplingArgs(temperature=0.0)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["name", "n", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def ref(tiny_model_factory):
    target = ReferenceBackend(tiny_model_factory(arch="llama", wtype="f32", seed=0))
    bad = ReferenceBackend(tiny_model_factory(arch="llama", wtype="f32", seed=1))
    return target, bad


def run(target, prompt, constraint, sampling=GREEDY, drafter=None, gamma=0, rng=None, max_tokens=40):
    stats = GenStats()
    toks = [s.token for s in generate(target, prompt, sampling, max_tokens=max_tokens, drafter=drafter,
                                      policy=FixedGamma(gamma), rng=rng or np.random.default_rng(0),
                                      stats=stats, constraint=constraint)]
    return toks, stats


# ---------------------------------------------------------------- the constraint itself

def test_mask_consume_rollback(ref):
    target, _ = ref
    tok = target.tokenizer
    c = GrammarConstraint(Grammar.regex(r"ab(c|d)"), tok, target.n_vocab)
    assert c.mask().shape == (target.n_vocab,)
    a, b, cc = (tok.tokenize(x, add_bos=False)[0] for x in "abc")
    assert c.mask()[a] and not c.mask()[b]
    c.consume(a)
    c.consume(b)
    assert not c.is_accepting()
    with pytest.raises(InvalidArgument, match="not allowed"):
        c.consume(a)
    c.consume(cc)
    assert c.is_accepting()
    eog = np.flatnonzero(c.mask())
    assert len(eog) and all(tok.is_eog(int(t)) for t in eog)       # complete: only an end is allowed
    assert not c.continuing_mask().any()
    c.rollback(2)
    assert c.tokens == [a] and c.mask()[b] and not c.mask()[a]
    np.testing.assert_array_equal(c.mask_at(0), c.mask_at(0))
    c.truncate(0)
    assert c.tokens == [] and c.mask()[a]


@pytest.mark.parametrize("kw, match", [
    (dict(json_schema={"type": "objekt"}), "JSON schema does not compile.*objekt"),
    (dict(json_schema="{not json"), "not valid JSON"),
    (dict(json_schema=[1, 2]), "must be a JSON object"),
    (dict(grammar="start: foo"), "Lark grammar does not compile.*foo"),
    (dict(grammar="(yes|no"), "regex does not compile.*unclosed"),
    (dict(grammar=""), "non-empty"),
    (dict(response_format={"type": "xml"}), "unknown; expected 'text', 'json_object' or 'json_schema'"),
    (dict(response_format={"type": "json_schema"}), "needs a 'json_schema' object"),
    (dict(json_schema={}, grammar="a"), "at most one"),
])
def test_bad_grammars_are_invalid_arguments(ref, kw, match):
    target, _ = ref
    with pytest.raises(InvalidArgument, match=match):
        g = grammar_from_options(**kw)
        GrammarConstraint(g, target.tokenizer, target.n_vocab)


def test_padding_rows_are_never_allowed(ref):
    """A mask wider than the vocabulary (Qwen2.5 pads its rows) forbids the extra rows."""
    target, _ = ref
    c = GrammarConstraint(Grammar.regex(r"(.|\n)*"), target.tokenizer, target.n_vocab + 20)
    m = c.mask()
    assert m.shape == (target.n_vocab + 20,) and not m[target.n_vocab:].any() and m[: target.n_vocab].sum() > 200


# ---------------------------------------------------------------- reading tool calls back

TOOLS = parse_tools([{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}, {"type": "function", "function": {"name": "f"}}])
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris {x}"}}\n</tool_call>'


@pytest.mark.parametrize("text, content, calls", [
    (CALL, None, [("get_weather", {"city": 'Pa"ris {x}'})]),
    ("Let me check.\n" + CALL + "\n" + CALL.replace("get_weather", "f").replace('{"city": "Pa\\"ris {x}"}', "{}"),
     "Let me check.", [("get_weather", {"city": 'Pa"ris {x}'}), ("f", {})]),
    ('```json\n{"name": "f", "arguments": {}}\n```', None, [("f", {})]),
    ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', None, [("get_weather", {"city": "Oslo"})]),
    ('{"name": "unknown", "arguments": {}}', '{"name": "unknown", "arguments": {}}', []),
    ("No call here <tool_ca", "No call here <tool_ca", []),
    (CALL + '\n<tool_call>\n{"name": "f", "argu', None, [("get_weather", {"city": 'Pa"ris {x}'})]),   # cut short
])
def test_tool_calls_read_whole_and_streamed(text, content, calls):
    got_content, got = parse_tool_calls(text, TOOLS)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    for size in (1, 3, 7, len(text)):          # streamed in pieces of every size: the same calls, in order
        reader = ToolCallStream(TOOLS)
        events = [e for i in range(0, len(text), size) for e in reader.feed(text[i:i + size])]
        events += list(reader.finish())
        complete = [c for c in reader.calls if _is_json(c["function"]["arguments"])]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in complete] == calls
        streamed = "".join(e[1] for e in events if e[0] == "content")
        assert streamed.strip() == (content or "") or (not calls and streamed == text)
        for i, c in enumerate(reader.calls):       # argument fragments add up to the call's arguments
            assert "".join(e[2] for e in events if e[0] == "arguments" and e[1] == i) == c["function"]["arguments"]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


def test_tool_definitions_are_checked():
    with pytest.raises(InvalidArgument, match="must be a list"):
        parse_tools({"name": "f"})
    with pytest.raises(InvalidArgument, match="two tools are named 'f'"):
        parse_tools([{"type": "function", "function": {"name": "f"}}] * 2)
    with pytest.raises(InvalidArgument, match="not among the tools"):
        parse_tool_choice({"type": "function", "function": {"name": "g"}}, TOOLS)
    with pytest.raises(InvalidArgument, match="tool_choice must be"):
        parse_tool_choice("always", TOOLS)


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_tool_grammar_on_a_text_trigger(ref, mode):
    """The tiny vocabulary has no <tool_call> token: the lazy text trigger is used; a call matches."""
    target, _ = ref
    tok = target.tokenizer
    g = tool_grammar(TOOLS, ToolChoice(mode), parallel=True, special_ids=special_tag_ids(tok))
    c = GrammarConstraint(g, tok, target.n_vocab)
    text = ("I will look. " if mode == "auto" else "") + CALL
    for t in tok.tokenize(text, add_bos=False):
        c.consume(t)
    assert c.is_accepting()
    if mode == "required":
        c.reset()
        with pytest.raises(InvalidArgument, match="not allowed"):
            for t in tok.tokenize("I will look.", add_bos=False):
                c.consume(t)


# ---------------------------------------------------------------- golden runs

@pytest.mark.parametrize("kind", ["json_schema", "lark", "regex"])
def test_greedy_constrained_speculative_equals_plain(ref, kind):
    target, bad = ref
    tok = target.tokenizer
    grammar = {"json_schema": Grammar.json_schema(SCHEMA),
               "lark": Grammar.lark('start: "the " WORD (" " WORD)* "."\nWORD: /[a-z]{1,6}/'),
               "regex": Grammar.regex(r"(in|is|at|an)( (the|a) [a-z]{2,5}){2,4}!")}[kind]
    c = GrammarConstraint(grammar, tok, target.n_vocab)
    for text in ("Hello there, the world", "the net is in the net is in the"):
        prompt = tok.tokenize(text)
        plain, st = run(target, prompt, c)
        out = tok.detokenize(plain).decode()
        if kind == "json_schema":
            assert st.finish_reason in ("eos", "length")
            if st.finish_reason == "eos":
                assert set(json.loads(out)) == {"name", "n", "ok"}
        elif kind == "regex" and st.finish_reason == "eos":
            assert re.fullmatch(r"(in|is|at|an)( (the|a) [a-z]{2,5}){2,4}!", out)
        assert c.tokens == plain[: len(c.tokens)]
        for drafter in (ModelDrafter(bad, target), PromptLookupDrafter()):
            for gamma in (1, 3, 6):
                spec, _ = run(target, prompt, c, drafter=drafter, gamma=gamma)
                assert spec == plain, (text, drafter.name, gamma)


def test_json_schema_output_validates_when_sampled(ref):
    jsonschema = pytest.importorskip("jsonschema")
    target, bad = ref
    c = GrammarConstraint(Grammar.json_schema(SCHEMA), target.tokenizer, target.n_vocab)
    prompt = target.tokenizer.tokenize("Hello")
    done = 0
    for seed in range(12):
        toks, st = run(target, prompt, c, SamplingArgs(temperature=1.0), drafter=ModelDrafter(bad, target),
                       gamma=3, rng=np.random.default_rng(seed), max_tokens=60)
        if st.finish_reason == "eos":
            jsonschema.validate(json.loads(target.tokenizer.detokenize(toks).decode()), SCHEMA)
            done += 1
    assert done >= 6


class _Checking:
    """Wraps a drafter: each time the loop asks for a draft, the constraint must hold exactly the
    generated tokens committed so far."""

    def __init__(self, inner, prompt_len: int, constraint) -> None:
        self.inner, self.prompt_len, self.c = inner, prompt_len, constraint
        self.name, self.vocab_fingerprint, self.weight_bytes, self.n_classes = inner.name, None, 0, 1
        self.checked = 0

    def hint(self, context, logits=None):
        return self.inner.hint(context, logits)

    def lag(self, context):
        return self.inner.lag(context)

    def propose(self, context, gamma, sampling, rng, constraint=None):
        assert self.c.tokens == list(context[self.prompt_len:])
        self.checked += 1
        return self.inner.propose(context, gamma, sampling, rng, constraint)

    def reset(self):
        self.inner.reset()

    def close(self):
        pass


@pytest.mark.parametrize("sampling", [GREEDY, SamplingArgs(temperature=1.0)], ids=["greedy", "t1"])
def test_constraint_holds_the_committed_tokens_after_every_cycle(ref, sampling):
    target, bad = ref
    c = GrammarConstraint(Grammar.json_schema(SCHEMA), target.tokenizer, target.n_vocab)
    prompt = target.tokenizer.tokenize("Hello there")
    d = _Checking(ModelDrafter(bad, target), len(prompt), c)
    toks, st = run(target, prompt, c, sampling, drafter=d, gamma=4, rng=np.random.default_rng(2))
    assert st.n_drafted > st.n_accepted and d.checked >= st.n_cycles - 1    # rejections were rolled back
    assert c.tokens == [t for t in toks if not target.tokenizer.is_eog(t)]


def test_skipping_the_rollback_is_caught(ref, monkeypatch):
    """Control: with the constraint's rollback disabled, the loop fails (here: the next token is not
    allowed in the stale grammar state, or the check above trips)."""
    target, bad = ref
    c = GrammarConstraint(Grammar.json_schema(SCHEMA), target.tokenizer, target.n_vocab)
    prompt = target.tokenizer.tokenize("Hello there")
    d = _Checking(ModelDrafter(bad, target), len(prompt), c)
    real = GrammarConstraint.rollback

    def no_rollback(self, n):
        if n < len(self.tokens):            # the loop's rollback of rejected drafts: skipped
            return
        real(self, n)

    monkeypatch.setattr(GrammarConstraint, "rollback", no_rollback)
    with pytest.raises((AssertionError, InvalidArgument)):
        run(target, prompt, c, SamplingArgs(temperature=1.0), drafter=d, gamma=4, rng=np.random.default_rng(2))


def test_closing_the_stream_rolls_the_constraint_back(ref):
    target, bad = ref
    c = GrammarConstraint(Grammar.json_schema(SCHEMA), target.tokenizer, target.n_vocab)
    prompt = target.tokenizer.tokenize("Hello there")
    stream = generate(target, prompt, GREEDY, max_tokens=30, drafter=ModelDrafter(bad, target),
                      policy=FixedGamma(6), rng=np.random.default_rng(0), constraint=c)
    taken = [next(stream).token for _ in range(3)]
    stream.close()
    # the cache: a prefix of the committed tokens but the last (grammar-forced ones may not be evaluated yet)
    assert c.tokens == taken and target.tokens == (prompt + taken)[:len(target.tokens)]
    assert len(target.tokens) >= len(prompt) - 1 and len(target.tokens) < len(prompt + taken)


# ---------------------------------------------------------------- statistics

SETTINGS = {
    "t1": SamplingArgs(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    "t0.7-top_p0.9": SamplingArgs(temperature=0.7, top_k=0, top_p=0.9, min_p=0.0),
}
N_SAMPLES = 1200
END = -1


@pytest.fixture(scope="module")
def letters(peaked):
    """The peaked target of conftest.py (output head x3) and its noisy copy as drafter, and a
    grammar of two letters out of four, chosen so that the drafter's unmasked favourite is forbidden
    while a good share of its mass stays on allowed letters (whose masked shape differs from the
    target's)."""
    T, D, tok = peaked
    prompt = tok.tokenize("Hello there")
    q0 = probs(D.forward(prompt, D.new_cache())[-1], SETTINGS["t1"])
    p0 = probs(T.forward(prompt, T.new_cache())[-1], SETTINGS["t1"])
    single = [i for i in range(tok.n_vocab) if len(tok.token_bytes(i)) == 1 and tok.token_bytes(i).isalpha()]
    by_q = sorted(single, key=lambda i: -q0[i])
    assert int(np.argmax(q0)) == by_q[0]
    # the favourite by_q[0] is left out; two of the drafter's next favourites, two of the target's
    picked = by_q[1:3] + [i for i in sorted(single, key=lambda i: -p0[i]) if i not in by_q[:3]][:2]
    chars = "".join(tok.token_bytes(i).decode() for i in picked)
    return T, D, tok, prompt, Grammar.regex(f"[{chars}]{{2}}"), chars


def exact_law(model: ReferenceModel, tok, prompt, sampling, grammar) -> dict[tuple, float]:
    """P(generated sequence) under the masked target, enumerated with the reference forward."""
    law: dict[tuple, float] = {}

    def walk(prefix: list[int], p_prefix: float, c: GrammarConstraint) -> None:
        cache = model.new_cache()
        logits = model.forward(prompt + prefix, cache)[-1]
        logits = np.where(c.mask(), logits, -np.inf)
        p = probs(logits, sampling, prompt + prefix)
        for t in np.flatnonzero(p):
            t = int(t)
            if tok.is_eog(t):
                law[tuple(prefix) + (END,)] = law.get(tuple(prefix) + (END,), 0.0) + p_prefix * p[t]
                continue
            c.consume(t)
            walk(prefix + [t], p_prefix * p[t], c)
            c.rollback(1)

    walk([], 1.0, GrammarConstraint(grammar, tok, model.n_vocab))
    return law


class _Truncating:
    """The known-wrong variant: draft without the grammar, cut at the first forbidden token."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name, self.vocab_fingerprint, self.weight_bytes, self.n_classes = "truncating", None, 0, 1

    def hint(self, context, logits=None):
        return 0

    def lag(self, context):
        return self.inner.lag(context)

    def propose(self, context, gamma, sampling, rng, constraint=None):
        toks, q = self.inner.propose(context, gamma, sampling, rng)          # unconstrained q
        keep = 0
        for x in toks:
            if not constraint.continuing_mask()[x]:
                break
            constraint.consume(x)
            keep += 1
        return toks[:keep], (q[:keep] if keep else None)

    def reset(self):
        self.inner.reset()

    def close(self):
        pass


def sample_law(target, drafter, prompt, sampling, grammar, n, seed, keys, gamma=2) -> np.ndarray:
    rng = np.random.default_rng(seed)
    c = GrammarConstraint(grammar, target.tokenizer, target.n_vocab)
    index = {k: i for i, k in enumerate(keys)}
    counts = np.zeros(len(keys) + 1, dtype=np.int64)              # last cell: a sequence outside the law
    for _ in range(n):
        toks, st = run(target, prompt, c, sampling, drafter=drafter, gamma=gamma, rng=rng, max_tokens=3)
        key = tuple(toks) + ((END,) if st.finish_reason == "eos" else ())
        counts[index.get(key, len(keys))] += 1
    return counts


def _law_setup(letters, setting):
    T, D, tok, prompt, grammar, _ = letters
    sampling = SETTINGS[setting]
    law = exact_law(T, tok, prompt, sampling, grammar)
    keys = sorted(law)
    expected = np.array([law[k] for k in keys] + [0.0])
    assert abs(expected.sum() - 1.0) < 1e-9 and len(keys) >= 4
    target = ReferenceBackend(T, tokenizer=tok)
    drafter = ModelDrafter(ReferenceBackend(D, tokenizer=tok), target)
    return target, drafter, prompt, sampling, grammar, keys, expected


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("mode", ["model", "lookup", "plain"])
def test_constrained_sampling_follows_the_masked_target(letters, setting, mode):
    target, drafter, prompt, sampling, grammar, keys, expected = _law_setup(letters, setting)
    chars = letters[5]
    if mode == "lookup":         # a prompt whose lookups propose allowed and forbidden letters
        prompt = letters[2].tokenize(f"Hello there{chars[:2]}q Hello there")     # lookup drafts chars[:2] + 'q'

        T = letters[0]
        law = exact_law(T, letters[2], prompt, sampling, grammar)
        keys = sorted(law)
        expected = np.array([law[k] for k in keys] + [0.0])
        drafter = PromptLookupDrafter()
    elif mode == "plain":
        drafter = None
    counts = sample_law(target, drafter, prompt, sampling, grammar, N_SAMPLES if drafter else N_SAMPLES // 2,
                        seed=11, keys=keys)
    assert counts[-1] == 0                      # nothing outside the grammar
    assert chisquare_pooled(counts, expected) > P_PASS


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_truncating_the_draft_fails_the_same_test(letters, setting):
    target, drafter, prompt, sampling, grammar, keys, expected = _law_setup(letters, setting)
    # twice the samples: at 1200 the rejection sat near P_FAIL (p 1.5e-6 on one seed), too close to rely on
    counts = sample_law(target, _Truncating(drafter), prompt, sampling, grammar, 2 * N_SAMPLES, seed=11, keys=keys)
    assert chisquare_pooled(counts, expected) < P_FAIL
