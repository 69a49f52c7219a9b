"""Grammars as llguidance compiles them, and the Constraint they become for one model's vocabulary.

llguidance (MIT, no dependencies, wheels for linux x86-64/aarch64 and macOS arm64) computes the
token mask of a JSON Schema, Lark or regex grammar in tens of microseconds at a 150k vocabulary and
rolls back in microseconds: what speculative decoding needs. Its errors put the matcher in an error
state instead of raising; this module turns them into GrammarError, an InvalidArgument (a 400 from
the server), both before any token is generated and while generating. Grammars come from requests:
limits.py bounds them before llguidance sees them, and `parser_limits` bounds llguidance's work.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import BackendError, GrammarError, InvalidArgument
from ..util import jsontext
from . import sandbox
from .limits import LIMITS, check_lark, check_regex, check_schema, check_text

log = logging.getLogger(__name__)

# JSON is generated on one line with the usual separators: flexible whitespace lets a small model
# loop on newlines forever, and '", "' / '": "' are the spellings models were trained on.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_LARK_START = re.compile(r"^\s*start\s*:", re.MULTILINE)
MAX_GRAMMAR_CHARS = LIMITS.max_chars
_ATTR_CONTROL, _ATTR_USER_DEFINED = 1 << 3, 1 << 4      # llama_token_attr bits (llama.h)


def _llguidance():
    try:
        import llguidance
    except ImportError as e:            # pragma: no cover - it is a default dependency
        raise BackendError(f"structured output needs the llguidance package ({e}); "
                           "install it with `pip install llguidance`") from None
    return llguidance


def _first_lines(msg: str, n: int = 4, limit: int = 400) -> str:
    text = " | ".join(line.strip() for line in msg.strip().splitlines()[:n] if line.strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class Grammar:
    """A grammar in llguidance's input form. kind: 'json_schema' | 'lark' | 'regex' | 'tools'."""

    kind: str
    source: str          # what llguidance's LLMatcher takes (a Lark text or its JSON grammar list)
    what: str            # for messages: "the JSON schema", "the Lark grammar", ...

    @staticmethod
    def json_schema(schema: Any) -> "Grammar":
        if isinstance(schema, str):
            try:
                schema = jsontext.loads(schema, "the JSON schema")
            except json.JSONDecodeError as e:
                raise InvalidArgument(f"the JSON schema is not valid JSON: {e.msg} at line {e.lineno} "
                                      f"column {e.colno}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidArgument(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
        check_schema(schema)
        llg = _llguidance()
        try:
            source = llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except (ValueError, TypeError, RecursionError) as e:
            raise InvalidArgument(f"the JSON schema is not valid: {_first_lines(str(e))}") from None
        return Grammar("json_schema", source, "the JSON schema")

    @staticmethod
    def lark(text: str) -> "Grammar":
        _check_text(text, "Lark grammar")
        check_lark(text)
        return Grammar("lark", _llguidance().LLMatcher.grammar_from_lark(text), "the Lark grammar")

    @staticmethod
    def regex(pattern: str) -> "Grammar":
        _check_text(pattern, "regex")
        check_regex(pattern)
        return Grammar("regex", _llguidance().LLMatcher.grammar_from_regex(pattern), "the regex")

    @staticmethod
    def from_text(text: str) -> "Grammar":
        """A Lark grammar if the text defines a `start:` rule, else a regular expression."""
        if not isinstance(text, str):
            raise InvalidArgument(f"a grammar must be a string (Lark or regex), got {type(text).__name__}")
        return Grammar.lark(text) if _LARK_START.search(text) else Grammar.regex(text)


def parser_limits():
    """llguidance's own limits, below its defaults where those let one grammar hold the worker for seconds:
    lexer fuel (~50k/ms to build, ~14k/ms per mask), Earley items per mask step (~20k/ms), lexer states
    and grammar size. A grammar that hits one fails with llguidance's message, which names the limit."""
    return _llguidance().LLParserLimits(initial_lexer_fuel=1_000_000, step_lexer_fuel=400_000,
                                        step_max_items=50_000, max_lexer_states=50_000,
                                        max_grammar_size=200_000, max_items_in_row=2_000)


def _check_text(text: Any, what: str) -> None:
    if not isinstance(text, str) or not text.strip():
        raise InvalidArgument(f"the {what} must be a non-empty string, got {text!r:.60}")
    check_text(text, what)


def grammar_from_options(*, json_schema: Any = None, grammar: str | None = None,
                         response_format: Any = None) -> Grammar | None:
    """The one grammar the generation options ask for (None: unconstrained)."""
    given = [n for n, v in (("json_schema", json_schema), ("grammar", grammar),
                            ("response_format", response_format)) if v is not None]
    if len(given) > 1:
        raise InvalidArgument(f"give at most one of json_schema, grammar and response_format, got {given}")
    if json_schema is not None:
        return Grammar.json_schema(json_schema)
    if grammar is not None:
        return Grammar.from_text(grammar)
    if response_format is not None:
        return grammar_from_response_format(response_format)
    return None


def grammar_from_response_format(rf: Any) -> Grammar | None:
    """OpenAI's response_format: {'type': 'text'} | {'type': 'json_object'} |
    {'type': 'json_schema', 'json_schema': {'name', 'schema', 'strict'}}."""
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise InvalidArgument(f"response_format must be an object with a string 'type', got {rf!r:.60}")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_schema({"type": "object"})
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise InvalidArgument("response_format of type 'json_schema' needs a 'json_schema' object "
                                  "({'name': ..., 'schema': {...}})")
        if "schema" not in js:
            raise InvalidArgument("response_format.json_schema needs a 'schema'")
        return Grammar.json_schema(js["schema"])
    raise InvalidArgument(f"response_format type {kind!r} is unknown; expected 'text', 'json_object' or 'json_schema'")


# ---------------------------------------------------------------------------------- vocabulary

_tokenizers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _Vocab:
    """llguidance's view of one tokenizer (built once per tokenizer: ~1-3 s at 150k tokens)."""

    def __init__(self, tokenizer, n_vocab: int) -> None:
        import ctypes

        from .. import llama_lib
        from ..tokenizer import is_padding

        llg = _llguidance()
        n_tok = tokenizer.n_vocab
        self.eog = [i for i in range(n_tok) if tokenizer.is_eog(i)]
        texts, types = tokenizer.token_texts(), tokenizer.token_types()
        # llguidance's byte view of each token: control tokens (and user-defined "<...>" ones, such as
        # Qwen2.5's <tool_call>) are special, written as 0xff + their text; padding rows are empty
        pieces = [tokenizer.special_bytes(i) for i in range(n_tok)] + [b""] * max(0, n_vocab - n_tok)
        for i in range(n_tok):
            p = pieces[i]
            if types[i] & _ATTR_CONTROL or (types[i] & _ATTR_USER_DEFINED and p.startswith(b"<") and p.endswith(b">")):
                pieces[i] = b"\xff" + p
        fptr = ctypes.cast(llama_lib.lib().llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
        self.llt = llg.LLTokenizer.from_llamacpp(tokens=pieces, vocab_ptr=tokenizer._vocab, tokenize_fptr=fptr,
                                                 eos_token=self.eog or tokenizer.eos_id, slices=None)
        allowed = np.zeros(n_vocab, dtype=bool)         # real tokens; padding rows are never allowed
        allowed[:n_tok] = [not is_padding(t, a) for t, a in zip(texts, types)]
        allowed[self.eog] = True
        self.allowed = allowed
        self.n_vocab = n_vocab
        # what the grammar sandbox runs for a grammar over this vocabulary (one object: it keys its zygote)
        self.trial = lambda source, what: _trial(Grammar("grammar", source, what), self)


_vocab_lock = threading.Lock()       # the server's request threads and its worker may both ask first


def _vocab(tokenizer, n_vocab: int) -> _Vocab:
    with _vocab_lock:
        per = _tokenizers.setdefault(tokenizer, {})
        if n_vocab not in per:
            per[n_vocab] = _Vocab(tokenizer, n_vocab)
        return per[n_vocab]


def special_token_name(tokenizer, text: str) -> bool:
    """Whether `text` is one token that llguidance treats as special (e.g. Qwen2.5's <tool_call>)."""
    ids = tokenizer.tokenize(text, special=True, add_bos=False)
    if len(ids) != 1:
        return False
    return bool(_vocab(tokenizer, tokenizer.n_vocab).llt.is_special_token(ids[0]))


# ---------------------------------------------------------------------------------- the constraint

class GrammarConstraint:
    """The Constraint of one grammar over one vocabulary (llguidance's LLMatcher behind it).

    Masks are cached per consumed position, so a drafted position's mask, computed while drafting,
    is the one the target's verification uses."""

    def __init__(self, grammar: Grammar, tokenizer, n_vocab: int | None = None) -> None:
        n_vocab = n_vocab or tokenizer.n_vocab
        self._v = _vocab(tokenizer, n_vocab)
        self.grammar = grammar
        sandbox.vet(grammar.source, grammar.what, self._v.trial)
        self._m = _matcher(grammar, self._v)
        self.n_vocab = n_vocab
        self.tokens: list[int] = []
        self._masks: list[np.ndarray | None] = [None]      # [k]: mask after tokens[:k]
        self._eog = frozenset(self._v.eog)
        self.mask()             # the first mask now: a grammar that cannot compute one fails before any token

    def _check(self) -> None:
        if self._m.is_error():
            raise GrammarError(f"{self.grammar.what} failed while generating (a limit on grammars from requests, "
                               f"or a bug): {_first_lines(self._m.get_error())}")

    def mask(self) -> np.ndarray:
        m = self._masks[-1]
        if m is None:
            self._check()
            bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
            m = np.unpackbits(bits, bitorder="little")[: self.n_vocab].astype(bool) & self._v.allowed
            if not m.any():
                raise GrammarError(f"{self.grammar.what} allows no token after {len(self.tokens)} tokens")
            self._masks[-1] = m
        return m

    def continuing_mask(self) -> np.ndarray:
        """mask() without the end-of-generation tokens: what a drafter may propose."""
        m = self.mask().copy()
        m[self._v.eog] = False
        return m

    def mask_at(self, k: int) -> np.ndarray:
        if not 0 <= k <= len(self.tokens):
            raise InvalidArgument(f"mask_at({k}): {len(self.tokens)} tokens are consumed")
        if k == len(self.tokens):
            return self.mask()
        m = self._masks[k]
        if m is None:            # never happens in the loop: consume() caches the mask it checked against
            n = len(self.tokens) - k
            tail = self.tokens[k:]
            self.rollback(n)
            m = self.mask()
            for t in tail:
                self.consume(t)
        return m

    def consume(self, token: int) -> None:
        token = int(token)
        if not (0 <= token < self.n_vocab and self.mask()[token]):
            raise InvalidArgument(f"token {token} is not allowed by {self.grammar.what} here")
        if token in self._eog:
            raise InvalidArgument(f"token {token} ends generation; it is not consumed into {self.grammar.what}")
        if not self._m.consume_token(token):
            self._check()
        self.tokens.append(token)
        self._masks.append(None)

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        if n > len(self.tokens):
            raise InvalidArgument(f"rollback({n}): only {len(self.tokens)} tokens are consumed")
        if not self._m.rollback(n):
            self._check()
        del self.tokens[-n:]
        del self._masks[-n:]

    def truncate(self, n: int) -> None:
        self.rollback(len(self.tokens) - max(0, n))

    def is_accepting(self) -> bool:
        return bool(self._m.is_accepting())

    def is_stopped(self) -> bool:
        return bool(self._m.is_stopped())

    def reset(self) -> None:
        self._m.reset()
        self.tokens, self._masks = [], [None]

    # -- forced tokens (docs/free_drafts.md) ------------------------------------------------------
    def forced_token(self) -> int | None:
        """The token the grammar forces next, or None. Forced: the mask allows exactly that one token, so it
        has probability 1 under the masked target whatever the model's logits (any temperature, top-k/p,
        penalty): the decode loop appends it with no evaluation and no sampling. Where the mask allows only
        end-of-generation tokens, the first of them (the generation ends whichever is drawn). The mask is the
        one the next position needs anyway (cached): the test costs one count over it."""
        m = self.mask()
        n = int(np.count_nonzero(m))
        if n == 1:
            return int(m.argmax())
        if n <= len(self._eog):
            allowed = np.flatnonzero(m)
            if all(int(t) in self._eog for t in allowed):
                return int(allowed[0])
        return None

    def is_end(self, token: int) -> bool:
        """Whether the token is one of the end-of-generation tokens the grammar allows only where it accepts."""
        return int(token) in self._eog

    def ff_tokens(self) -> list[int]:
        """llguidance's fast-forward tokens: a tokenization of the bytes the grammar forces next. Not
        certain under the masked target (the model may spell the same bytes with other tokens, or a
        longer token may start with them), so they may enter only as a point-mass draft that the target
        verifies; the first of them is certain only where forced_token() says so."""
        self._check()
        return [int(t) for t in self._m.compute_ff_tokens()]


def _matcher(grammar: Grammar, v: _Vocab):
    """llguidance's matcher of `grammar` under `parser_limits` (GrammarError if it does not compile)."""
    llg = _llguidance()
    limits = parser_limits()
    err = llg.LLMatcher.validate_grammar(grammar.source, v.llt, limits=limits)
    if err:
        raise GrammarError(f"{grammar.what} does not compile: {_first_lines(err)}")
    m = llg.LLMatcher(v.llt, grammar.source, log_level=0, limits=limits)
    if m.is_error():
        raise GrammarError(f"{grammar.what} does not compile: {_first_lines(m.get_error())}")
    return m


TRIAL_STEPS = 16
COMPILE_CPU_S = 0.150   # compile + the trial's masks, CPU time: 30 tools with enums and patterns take ~16 ms
MASK_CPU_S = 0.020      # one mask's CPU time at most: legitimate grammars take well under a millisecond


def _trial(grammar: Grammar, v: _Vocab) -> None:
    """What the sandbox runs: compile, then the masks along the first allowed token, TRIAL_STEPS deep,
    within COMPILE_CPU_S of CPU time in all and MASK_CPU_S each (a mask is computed for every generated
    token, on the worker). CPU time, not wall time: a board under load must not refuse a good grammar."""
    t0 = time.process_time()
    m = _matcher(grammar, v)
    eog = set(v.eog)
    for _ in range(TRIAL_STEPS):
        _within_budget(grammar, time.process_time() - t0)
        t = time.process_time()
        raw = m.compute_bitmask()
        spent = time.process_time() - t
        if spent > MASK_CPU_S:
            raise GrammarError(f"{grammar.what} takes {spent * 1000:.0f} ms of CPU to compute one token's mask; the "
                               f"limit for a grammar from a request is {MASK_CPU_S * 1000:.0f} ms (fewer "
                               "alternatives or shared definitions usually fix it)")
        bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")
        if m.is_error():
            raise GrammarError(f"{grammar.what} fails: {_first_lines(m.get_error())}")
        allowed = np.flatnonzero(bits[: v.n_vocab].astype(bool) & v.allowed)
        nxt = next((int(t) for t in allowed if int(t) not in eog), None)
        if nxt is None:
            if len(allowed) == 0:
                raise GrammarError(f"{grammar.what} allows no token")
            return
        m.consume_token(nxt)
        if m.is_error():
            raise GrammarError(f"{grammar.what} fails: {_first_lines(m.get_error())}")


def vet_grammar(grammar: Grammar | None, tokenizer, n_vocab: int | None = None) -> None:
    """The sandbox's verdict on `grammar` for this vocabulary (GrammarError if refused), remembered."""
    if grammar is not None:
        v = _vocab(tokenizer, n_vocab or tokenizer.n_vocab)
        sandbox.vet(grammar.source, grammar.what, v.trial)


def _within_budget(grammar: Grammar, spent: float) -> None:
    if spent > COMPILE_CPU_S:
        raise GrammarError(f"{grammar.what} takes more than {COMPILE_CPU_S * 1000:.0f} ms of CPU to compile, the "
                           "limit for a grammar from a request; simplify it (fewer alternatives, rules or repetitions)")


def compile_constraint(grammar: Grammar | None, tokenizer, n_vocab: int | None = None) -> GrammarConstraint | None:
    return None if grammar is None else GrammarConstraint(grammar, tokenizer, n_vocab)
