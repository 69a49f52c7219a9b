"""Tokenizer and chat template, read from a GGUF's metadata through llama.cpp's vocabulary code.

One tokenizer module for every backend: the llama.cpp backend shares its loaded model; other
backends (ONNX, the numpy reference) load the same GGUF vocabulary-only (no weights).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import re
from datetime import datetime
from pathlib import Path
from typing import Sequence

from . import llama_lib
from .errors import ContextOverflow, InvalidArgument, ModelFormatError

log = logging.getLogger(__name__)

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


_SPLIT_ABOVE_BYTES = 4096       # texts longer than this are split at special tokens by edgerun (see tokenize)
# llama_token_attr bits (llama.h)
_ATTR_UNKNOWN, _ATTR_UNUSED, _ATTR_CONTROL, _ATTR_USER_DEFINED = 1 << 0, 1 << 1, 1 << 3, 1 << 4
_ATTR_LSTRIP, _ATTR_RSTRIP = 1 << 7, 1 << 8
_PAD_TEXT = re.compile(r"^(\[PAD\d+\]|<\|?pad(_?\d+)?\|?>|<unused\d+>)$", re.IGNORECASE)


def is_padding(text: str, attr: int) -> bool:
    """A vocabulary row that is padding, never a real token (Qwen2.5 pads 151,665 tokens to 151,936 rows)."""
    return attr == 0 or bool(attr & _ATTR_UNUSED) or bool(_PAD_TEXT.match(text))


def vocab_fingerprint(texts: Sequence[str], types: Sequence[int], bos: int, eos: int) -> str:
    """sha256 over token strings, token types and the BOS/EOS ids: equal iff the vocabularies match."""
    h = hashlib.sha256()
    h.update(f"bos={bos};eos={eos};n={len(texts)}\n".encode())
    for t, ty in zip(texts, types):
        h.update(t.encode("utf-8", "surrogatepass"))
        h.update(b"\x00%d\x01" % ty)
    return h.hexdigest()


class Tokenizer:
    """Text <-> token ids and the chat template of one model (wraps a llama.cpp vocabulary)."""

    def __init__(self, model: "llama_lib.Model") -> None:
        lib = llama_lib.lib()
        self._model = model                     # keeps the llama_model alive
        self._vocab = lib.llama_model_get_vocab(model.ptr)
        self.n_vocab: int = lib.llama_vocab_n_tokens(self._vocab)
        self.bos_id: int = lib.llama_vocab_bos(self._vocab)
        self.eos_id: int = lib.llama_vocab_eos(self._vocab)
        self.add_bos: bool = bool(lib.llama_vocab_get_add_bos(self._vocab))
        self.source = model.path
        tmpl = lib.llama_model_chat_template(model.ptr, None)
        self.chat_template: str | None = tmpl.decode("utf-8") if tmpl else None
        self._pieces: dict[int, bytes] = {}
        self._eog: dict[int, bool] = {}
        self._fingerprint: str | None = None
        self._texts: list[str] | None = None
        self._max_bytes: int | None = None
        self._specials: tuple | None = None

    @classmethod
    def from_gguf(cls, path: str | Path) -> "Tokenizer":
        """Load only the vocabulary of a GGUF file (no weights)."""
        return cls(llama_lib.Model.load(path, vocab_only=True))

    # -- vocabulary ---------------------------------------------------------------------------
    def token_text(self, token: int) -> str:
        raw = llama_lib.lib().llama_vocab_get_text(self._vocab, token)
        return raw.decode("utf-8", "surrogateescape") if raw else ""

    def token_texts(self) -> list[str]:
        if self._texts is None:
            self._texts = [self.token_text(i) for i in range(self.n_vocab)]
        return self._texts

    def token_types(self) -> list[int]:
        lib = llama_lib.lib()
        return [int(lib.llama_vocab_get_attr(self._vocab, i)) for i in range(self.n_vocab)]

    @property
    def vocab_fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = vocab_fingerprint(self.token_texts(), self.token_types(), self.bos_id, self.eos_id)
        return self._fingerprint

    def is_eog(self, token: int) -> bool:
        """End of generation: EOS, EOT (e.g. <|im_end|>) and the model's other end tokens."""
        eog = self._eog.get(token)             # asked twice a generated token: a call into llama.cpp once per id
        if eog is None:
            eog = self._eog[token] = bool(llama_lib.lib().llama_vocab_is_eog(self._vocab, token))
        return eog

    # -- text <-> tokens ----------------------------------------------------------------------
    @property
    def max_token_bytes(self) -> int:
        """The most bytes one token stands for (special tokens' text included): a text of B bytes is at
        least B / max_token_bytes tokens, whatever the tokenizer does."""
        if self._max_bytes is None:
            self._max_bytes = max(1, max(len(self.special_bytes(i)) for i in range(self.n_vocab)))
        return self._max_bytes

    def check_fits(self, n_bytes: int, n_tokens: int) -> None:
        """Refuse, before tokenizing, a text too long to be at most n_tokens tokens (ContextOverflow):
        tokenizing pathological text costs more than linear time, and the server has one worker."""
        if n_bytes > n_tokens and n_bytes > n_tokens * self.max_token_bytes:     # (every token is >= 1 byte)
            raise ContextOverflow(
                f"the prompt is {n_bytes} bytes: at least {-(-n_bytes // self.max_token_bytes)} tokens (a token "
                f"is at most {self.max_token_bytes} bytes), more than the context's {n_tokens}; shorten it")

    def tokenize(self, text: str, special: bool = True, add_bos: bool | None = None,
                 limit: int | None = None) -> list[int]:
        """Text -> token ids. limit: refuse (ContextOverflow) a text that cannot be at most `limit` tokens,
        without tokenizing it."""
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:    # a lone surrogate (JSON "\ud800", or invalid UTF-8 bytes from argv)
            raise InvalidArgument(f"the text is not valid Unicode: {text[e.start:e.end]!a} at character {e.start} "
                                  "(a lone surrogate, or bytes that are not UTF-8); expected UTF-8 text") from None
        if limit is not None:
            self.check_fits(len(data), limit)
        add = self.add_bos if add_bos is None else add_bos
        # long texts: split at special tokens here (linear); short ones cost llama.cpp's pass nothing
        if special and len(data) > _SPLIT_ABOVE_BYTES and self._special_re() is not None:
            return self._tokenize_specials(text, add)
        return self._llama_tokenize(data, special, add)

    def _special_re(self):
        """A regex of the special tokens' texts, longest first, for splitting text at them in linear time
        (llama.cpp's own special-token pass is quadratic in their count: 40,000 `<|im_start|>` take
        seconds). None where a special token strips whitespace next to it (lstrip/rstrip attributes):
        llama.cpp's pass handles those, so it is used as is."""
        if self._specials is None:
            types = self.token_types()
            texts = self.token_texts()
            specials = {}
            strips = False
            for i, (t, a) in enumerate(zip(texts, types)):
                if a & (_ATTR_UNKNOWN | _ATTR_CONTROL | _ATTR_USER_DEFINED) and t:
                    specials.setdefault(t, i)
                    strips |= bool(a & (_ATTR_LSTRIP | _ATTR_RSTRIP))
            if strips or not specials:
                self._specials = (None, {})
            else:
                alts = sorted(specials, key=len, reverse=True)
                self._specials = (re.compile("|".join(re.escape(a) for a in alts)), specials)
        return self._specials[0]

    def _tokenize_specials(self, text: str, add_bos: bool) -> list[int]:
        pattern, ids = self._specials
        lib = llama_lib.lib()
        add_b = add_bos and bool(lib.llama_vocab_get_add_bos(self._vocab)) and self.bos_id >= 0
        add_e = add_bos and bool(lib.llama_vocab_get_add_eos(self._vocab)) and self.eos_id >= 0
        out: list[int] = [self.bos_id] if add_b else []      # what llama.cpp's add_special adds
        pos = 0
        for m in pattern.finditer(text):
            if m.start() > pos:
                out += self._llama_tokenize(text[pos:m.start()].encode("utf-8"), False, False)
            out.append(ids[m.group(0)])
            pos = m.end()
        if pos < len(text):
            out += self._llama_tokenize(text[pos:].encode("utf-8"), False, False)
        return out + ([self.eos_id] if add_e else [])

    def _llama_tokenize(self, data: bytes, special: bool, add: bool) -> list[int]:
        lib = llama_lib.lib()
        n_max = len(data) + 8
        buf = (ctypes.c_int32 * n_max)()
        n = lib.llama_tokenize(self._vocab, data, len(data), buf, n_max, add, special)
        if n < 0:
            n_max = -n
            buf = (ctypes.c_int32 * n_max)()
            n = lib.llama_tokenize(self._vocab, data, len(data), buf, n_max, add, special)
        return list(buf[:n])

    def _piece(self, token: int, special: bool) -> bytes:
        lib = llama_lib.lib()
        buf = ctypes.create_string_buffer(64)
        n = lib.llama_token_to_piece(self._vocab, token, buf, 64, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = lib.llama_token_to_piece(self._vocab, token, buf, -n, 0, special)
        return buf.raw[:n]

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token renders to (control tokens render as nothing)."""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self._piece(token, False)
        return piece

    def special_bytes(self, token: int) -> bytes:
        """The bytes of a token with control tokens rendered as their text (e.g. b"<|im_end|>")."""
        return self._piece(token, True)

    def detokenize(self, tokens: Sequence[int]) -> bytes:
        return b"".join(self.token_bytes(t) for t in tokens)

    # -- chat ---------------------------------------------------------------------------------
    @property
    def template_knows_tools(self) -> bool:
        """Whether the model's chat template renders `tools` itself (Qwen2.5's does; SmolLM2's does not)."""
        return bool(self.chat_template) and "tools" in self.chat_template

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            tools: Sequence[dict] | None = None) -> str:
        """Render messages ([{'role', 'content'}]) with the model's template (ChatML if it has none).
        tools: OpenAI tool objects, passed to a template that knows tools (see constrain/tools.py)."""
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InvalidArgument(f"message {i} must be a dict with string 'role' and 'content', got {m!r}")
        template = self.chat_template
        if template is None:
            template = CHATML_TEMPLATE if self._is_single_token("<|im_start|>") else _PLAIN_TEMPLATE
            log.info("model has no chat template; using a %s template", "ChatML" if template is CHATML_TEMPLATE else "plain")
        extra = {"tools": list(tools)} if tools else {}
        return _render(template, messages, add_generation_prompt, **extra,
                       bos_token=self.token_text(self.bos_id) if self.bos_id >= 0 else "",
                       eos_token=self.token_text(self.eos_id) if self.eos_id >= 0 else "")

    def _is_single_token(self, text: str) -> bool:
        return len(self.tokenize(text, special=True, add_bos=False)) == 1

    def chat_prompt_tokens(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                           limit: int | None = None) -> list[int]:
        """Chat messages -> prompt tokens. BOS is added only if the template did not write it.

        The template's own text is tokenized with its special tokens; what the messages say is not:
        `<|im_start|>system` typed inside a message stays text and cannot forge a turn. Each content
        is rendered as a marker, and the rendered text is tokenized piece by piece."""
        marked = [dict(m, content=_MARK.format(i)) if isinstance(m, dict) and isinstance(m.get("content"), str) and m["content"] else m
                  for i, m in enumerate(messages)]
        text = self.apply_chat_template(marked, add_generation_prompt=True, tools=tools)
        if limit is not None:           # the rendered prompt with every content in place, before tokenizing
            contents = sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in messages
                           if isinstance(m, dict) and isinstance(m.get("content"), str))
            self.check_fits(len(_MARK_RE.sub("", text).encode("utf-8", "surrogatepass")) + contents, limit)
        bos_text = self.token_text(self.bos_id) if self.bos_id >= 0 else ""
        add_bos = self.add_bos and not (bos_text and text.startswith(bos_text))
        out: list[int] = []
        for k, piece in enumerate(_MARK_RE.split(text)):
            if k % 2:                                         # a message's content: never special tokens
                out += self.tokenize(messages[int(piece)]["content"], special=False, add_bos=False)
            elif piece:
                out += self.tokenize(piece, special=True, add_bos=add_bos and not out)
        if add_bos and (not out or out[0] != self.bos_id):
            out.insert(0, self.bos_id)
        return out


# a message's content while the template renders (private-use characters: no text carries them by accident)
_MARK = "\ue000edgerun-content-{}\ue001"
_MARK_RE = re.compile("\ue000edgerun-content-(\\d+)\ue001")


def _raise_exception(msg):
    raise InvalidArgument(f"chat template refused the messages: {msg}")


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    """The template compiled once (jinja's parse + compile is ~12 ms for Qwen2.5's, paid per request before)."""
    # jinja2 is imported here and in _render: ~0.15 s measured, paid only where a chat template is used
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    # as Hugging Face renders templates: plain JSON (jinja's own tojson escapes <, > and & for HTML)
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals.update(raise_exception=_raise_exception,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(template)


def _render(template: str, messages, add_generation_prompt: bool, **extra) -> str:
    from jinja2 import TemplateError

    try:
        return _compiled(template).render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                          **extra)
    except TemplateError as e:
        raise ModelFormatError(f"the model's chat template failed to render: {e}") from e
