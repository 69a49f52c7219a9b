"""Bounds on grammars that come from the network, checked before llguidance sees them.

A JSON schema, a Lark grammar, a regex or a tool's parameters schema is untrusted input. llguidance
compiles it in native code: a schema nested a few thousand levels deep (a `$ref` chain, `items` or
`anyOf`) overflows its stack and ends the whole process, and nested counted repetitions
(`(a{1000}){1000}`) make its lexer build expressions until one of its own limits stops it, seconds
later. These checks are cheap (one pass, no recursion), and their limits are far above any real
schema (docs/structured.md says which); what passes them is compiled with llguidance's own
`LLParserLimits` (grammar.py) and, the first time a grammar is seen, in a child process (sandbox.py).
Every refusal is an InvalidArgument naming the limit.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgument


@dataclass(frozen=True)
class GrammarLimits:
    max_chars: int = 64 * 1024         # a grammar's text, or a schema's JSON (30 tools with enums: ~15 KB)
    max_depth: int = 128               # schema objects nested in one another, `$ref` hops included
    max_nodes: int = 20_000            # schema objects in all
    max_repeat: int = 2_000            # a regex's counted repetitions multiplied along their nesting
    max_regex_nesting: int = 200       # parentheses inside one regex


LIMITS = GrammarLimits()

# keywords whose value is a schema, a list of schemas or a map of name -> schema
_SUB = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_SUB_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUB_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_COUNTS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")


def check_schema(schema: Any, limits: GrammarLimits = LIMITS) -> None:
    """Refuse a JSON schema deeper (following local `$ref`s), larger or more repetitive than `limits`."""
    if not isinstance(schema, dict):
        return
    try:
        n = len(json.dumps(schema))     # C speed: a 5,000-property schema is refused before it is walked
    except RecursionError:              # nested past the encoder's recursion: far past max_depth
        raise InvalidArgument(f"the JSON schema nests more than {limits.max_depth} levels deep (counting $ref "
                              "hops): the limit for a grammar from a request") from None
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"the JSON schema is not JSON data: {e}") from None
    if n > limits.max_chars:
        raise InvalidArgument(f"the JSON schema is {n} characters as JSON; at most {limits.max_chars} are accepted "
                              "(the limit for a grammar from a request)")
    nodes = [schema]                       # every schema object, in discovery order
    index = {id(schema): 0}
    children: list[list[int]] = [[]]
    i = 0
    while i < len(nodes):                  # breadth-first: no recursion, whatever the nesting
        node = nodes[i]
        subs = _subschemas(node, schema)
        for s in subs:
            if not isinstance(s, dict):
                continue
            j = index.get(id(s))
            if j is None:
                if len(nodes) >= limits.max_nodes:
                    raise InvalidArgument(f"the JSON schema has more than {limits.max_nodes} schema objects "
                                          "(the limit for a grammar from a request)")
                j = index[id(s)] = len(nodes)
                nodes.append(s)
                children.append([])
            children[i].append(j)
        for key in _COUNTS:
            v = node.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > limits.max_repeat:
                raise InvalidArgument(f"the JSON schema's {key} is {v:g}; at most {limits.max_repeat} is accepted "
                                      "in a grammar from a request")
        if isinstance(node.get("pattern"), str):
            check_regex(node["pattern"], limits, what="a pattern in the JSON schema")
        i += 1
    _check_depth(children, limits)


def _subschemas(node: dict, root: dict) -> list:
    out = []
    for k in _SUB:
        v = node.get(k)
        if isinstance(v, list):            # items as a list (draft 4 tuples)
            out.extend(v)
        elif v is not None:
            out.append(v)
    for k in _SUB_LIST:
        v = node.get(k)
        if isinstance(v, list):
            out.extend(v)
    for k in _SUB_MAP:
        v = node.get(k)
        if isinstance(v, dict):
            out.extend(v.values())
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        target = _pointer(root, ref[1:])
        if target is not None:
            out.append(target)
    return out


def _pointer(root: dict, pointer: str) -> Any:
    """A JSON pointer within the schema (None if it does not resolve)."""
    node: Any = root
    if not pointer:
        return root
    if not pointer.startswith("/"):
        return None
    for part in pointer[1:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _check_depth(children: list[list[int]], limits: GrammarLimits) -> None:
    """The longest chain of nested schema objects from the root, a cycle (a recursive schema) cut
    where it comes back to an object on the chain. Iterative depth-first search."""
    depth = [0] * len(children)            # 0: not finished
    on_path = [False] * len(children)
    stack = [(0, 0)]
    on_path[0] = True
    while stack:
        v, k = stack[-1]
        if k < len(children[v]):
            stack[-1] = (v, k + 1)
            w = children[v][k]
            if depth[w] == 0 and not on_path[w]:
                on_path[w] = True
                stack.append((w, 0))
                if len(stack) > limits.max_depth:
                    raise InvalidArgument(f"the JSON schema nests more than {limits.max_depth} levels deep "
                                          "(counting $ref hops): the limit for a grammar from a request")
            continue
        stack.pop()
        on_path[v] = False
        depth[v] = 1 + max((depth[w] for w in children[v]), default=0)
        if depth[v] > limits.max_depth:
            raise InvalidArgument(f"the JSON schema nests more than {limits.max_depth} levels deep "
                                  "(counting $ref hops): the limit for a grammar from a request")


_QUANT = re.compile(r"\{(\d*)(?:,(\d*))?\}")


def check_regex(pattern: str, limits: GrammarLimits = LIMITS, *, what: str = "the regex") -> None:
    """Refuse counted repetitions whose product along their nesting exceeds `limits.max_repeat`
    (`(a{1000}){1000}` would be a million copies), and parentheses nested too deep."""
    frames = [1]                 # per open group: the largest repeat product seen inside it
    after_group = None           # the product inside a group that just closed (a quantifier may follow)
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        closed, after_group = after_group, None
        if c == "\\":
            i += 2
        elif c == "[":                      # a character class: skip to its end
            i += 1
            if i < n and pattern[i] == "^":
                i += 1
            if i < n and pattern[i] == "]":
                i += 1
            while i < n and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
            i += 1
        elif c == "(":
            frames.append(1)
            if len(frames) > limits.max_regex_nesting:
                raise InvalidArgument(f"{what} nests more than {limits.max_regex_nesting} groups")
            i += 1
        elif c == ")":
            if len(frames) > 1:
                inner = frames.pop()
                frames[-1] = max(frames[-1], inner)
                after_group = inner
            i += 1
        else:
            m = _QUANT.match(pattern, i) if c == "{" else None
            if m and (m.group(1) or m.group(2)):
                count = max(int(g) for g in m.groups() if g)
                total = (closed or 1) * max(count, 1)
                if total > limits.max_repeat:
                    raise InvalidArgument(f"{what} repeats up to {total} times (counted repetitions multiplied "
                                          f"along their nesting); at most {limits.max_repeat} is accepted")
                frames[-1] = max(frames[-1], total)
                i = m.end()
            else:
                i += 1


def check_text(text: str, what: str, limits: GrammarLimits = LIMITS) -> None:
    if len(text) > limits.max_chars:
        raise InvalidArgument(f"the {what} is {len(text)} characters; at most {limits.max_chars} are accepted")


_LARK_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"i?')
_LARK_RANGE = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?")


def check_lark(text: str, limits: GrammarLimits = LIMITS) -> None:
    """A Lark grammar's repetitions (`x{m,n}`, `x ~ m..n`, and those of its /regex/ terminals) and group
    nesting, with its string literals set aside (their brackets are text)."""
    bare = _LARK_STRING.sub('""', text)
    bare = _LARK_RANGE.sub(lambda m: "{" + m.group(1) + ("," + m.group(2) if m.group(2) else "") + "}", bare)
    check_regex(bare, limits, what="the Lark grammar")
