"""One generation request, built and checked once at the edge (CLI, Python API, HTTP): what to answer
(prompt, messages or prompt tokens), how to sample, when to stop, the output's structure, the draft length.

Every check of a request's options lives here or in the type it builds (SamplingArgs for sampling values,
SpeculativeArgs for gamma, constrain/ for schemas, grammars and tools); the runtime and the server take a
Request as given. A Request is frozen: the server's queue, its worker and the decode loop share one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from .config import SamplingArgs, parse_gamma
from .constrain.base import Constraint
from .constrain.grammar import Grammar, grammar_from_options
from .constrain.tools import Tool, ToolChoice, parse_tool_choice, parse_tools, special_tag_ids, tool_grammar
from .errors import InvalidArgument

SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "seed")
STRUCTURE_KEYS = ("tools", "tool_choice", "parallel_tool_calls", "json_schema", "grammar", "response_format")
MAX_STOP_STRINGS = 16      # stop strings per request
MAX_STOP_CHARS = 256       # characters per stop string


@dataclass(frozen=True)
class Structure:
    """What the answer must look like: a grammar (from a JSON schema, a Lark grammar, a regex or an OpenAI
    response_format), or tools the answer may call. The tools' call grammar depends on the vocabulary
    (bind() builds it once the tokenizer is known)."""

    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice("none")
    parallel_tool_calls: bool = True
    grammar: Grammar | None = None

    @classmethod
    def parse(cls, *, tools: Any = None, tool_choice: Any = None, parallel_tool_calls: Any = True,
              json_schema: Any = None, grammar: Any = None, response_format: Any = None) -> "Structure":
        """The structure options of a request, checked (InvalidArgument with the option's name as `param`)."""
        try:
            parsed = parse_tools(tools)
        except InvalidArgument as e:
            raise InvalidArgument(str(e), param="tools") from None
        try:
            choice = parse_tool_choice(tool_choice, parsed)
        except InvalidArgument as e:
            raise InvalidArgument(str(e), param="tool_choice") from None
        shown = tuple(parsed) if choice.mode != "none" else ()
        given = {n: v for n, v in (("json_schema", json_schema), ("grammar", grammar),
                                   ("response_format", response_format)) if v is not None}
        if shown and given and not (isinstance(response_format, dict) and response_format.get("type") == "text"
                                    and len(given) == 1):
            raise InvalidArgument("tools cannot be combined with json_schema, grammar or response_format: "
                                  "a tool call's arguments follow the tool's own parameters schema",
                                  param=next(iter(given)))
        g = None if shown else grammar_from_options(json_schema=json_schema, grammar=grammar,
                                                    response_format=response_format)
        return cls(shown, choice, parallel_tool_calls is not False, g)

    def __bool__(self) -> bool:
        return bool(self.tools) or self.grammar is not None

    @property
    def reads_calls(self) -> bool:
        """The answer may hold tool calls, read back after the generation."""
        return bool(self.tools) and self.tool_choice.mode != "none"

    def bind(self, tokenizer) -> "Structure":
        """This structure with its grammar built for `tokenizer` (the tools' call grammar names the
        vocabulary's <tool_call> tokens where it has them)."""
        if self.grammar is not None or not self.tools:
            return self
        return replace(self, grammar=tool_grammar(self.tools, self.tool_choice, parallel=self.parallel_tool_calls,
                                                  special_ids=special_tag_ids(tokenizer)))


@dataclass(frozen=True)
class Request:
    """One generation. Exactly one of prompt (raw text), messages (a chat, rendered by the model's
    template) and prompt_tokens. max_tokens None: as many as the context holds. sampling: the values this
    request sets (the runtime's defaults fill the rest). gamma None: the runtime's policy (the tuner or the
    loaded fixed gamma); an integer fixes the draft length for this request."""

    prompt: str | None = None
    messages: tuple[Mapping, ...] | None = None
    prompt_tokens: tuple[int, ...] | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    sampling: tuple[tuple[str, Any], ...] = ()
    structure: Structure = field(default_factory=Structure)
    gamma: int | None = None

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.prompt, self.messages, self.prompt_tokens)) != 1:
            raise InvalidArgument("a request needs exactly one of prompt, messages and prompt_tokens")
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise InvalidArgument(f"the prompt must be a string, got {type(self.prompt).__name__}", param="prompt")
        mt = self.max_tokens
        if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt < 0):
            raise InvalidArgument(f"max_tokens must be an integer >= 0, got {mt!r}", param="max_tokens")

    @classmethod
    def build(cls, *, prompt: str | None = None, messages: Sequence[Mapping] | None = None,
              prompt_tokens: Sequence[int] | None = None, max_tokens: int | None = None,
              stop: str | Sequence[str] | None = (), gamma: Any = None, structure: Structure | None = None,
              **options) -> "Request":
        """A Request from keyword options as the Python API takes them: sampling values (temperature, top_k,
        top_p, min_p, repeat_penalty, repeat_last_n, seed; None = the runtime's default) and structure
        options (tools, tool_choice, parallel_tool_calls, json_schema, grammar, response_format) or a
        Structure already parsed. Unknown options are refused."""
        unknown = set(options) - set(SAMPLING_KEYS) - set(STRUCTURE_KEYS)
        if unknown:
            raise InvalidArgument(f"unknown option(s) {sorted(unknown)}; expected some of "
                                  f"{list(SAMPLING_KEYS) + list(STRUCTURE_KEYS)}")
        sampling = {k: options[k] for k in SAMPLING_KEYS if options.get(k) is not None}
        given = {k: options[k] for k in STRUCTURE_KEYS if k in options}
        if structure is None:
            structure = Structure.parse(**{k: v for k, v in given.items() if v is not None})
        elif any(v is not None for v in given.values()):
            raise InvalidArgument("give either a parsed structure or structure options, not both")
        return cls(prompt=prompt, messages=None if messages is None else tuple(messages),
                   prompt_tokens=None if prompt_tokens is None else tuple(prompt_tokens),
                   max_tokens=max_tokens, stop=stop_strings(stop), sampling=check_sampling(sampling),
                   structure=structure, gamma=parse_gamma(gamma))

    @property
    def sampling_kw(self) -> dict:
        return dict(self.sampling)

    def sampling_args(self, base: SamplingArgs) -> SamplingArgs:
        """`base` (the runtime's defaults) with this request's values."""
        return replace(base, **dict(self.sampling)) if self.sampling else base


def check_sampling(values: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Sampling values a request sets, checked by SamplingArgs (the one place their ranges live)."""
    unknown = set(values) - set(SAMPLING_KEYS)
    if unknown:
        raise InvalidArgument(f"unknown sampling option(s) {sorted(unknown)}; expected some of {list(SAMPLING_KEYS)}")
    SamplingArgs(**values)
    return tuple((k, values[k]) for k in SAMPLING_KEYS if k in values)


def stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """Stop strings: at most MAX_STOP_STRINGS of at most MAX_STOP_CHARS characters; empty ones dropped."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}", param="stop")
    for s in stops:
        if not isinstance(s, str):
            raise InvalidArgument(f"each stop string must be a string, got {s!r:.40}", param="stop")
        if len(s) > MAX_STOP_CHARS:
            raise InvalidArgument(f"each 'stop' string may be at most {MAX_STOP_CHARS} characters", param="stop")
    return tuple(s for s in stops if s)


@dataclass
class Plan:
    """What a request becomes before any token is generated: the prompt's tokens, the compiled grammar
    (of a JSON schema, a grammar, or the tools' calls) and the structure, to read tool calls back with."""

    prompt_tokens: list[int]
    constraint: Constraint | None = None
    structure: Structure = field(default_factory=Structure)

    @property
    def reads_calls(self) -> bool:
        return self.structure.reads_calls
