"""JSON that arrives as text inside a request or a file (a schema given as a string, a tool call's
`arguments`, a `--json-schema` or `--tools` file): parsed with a nesting limit of its own.

Python's json module recurses once per level, so text nested a few thousand levels deep raises
RecursionError, which is no EdgerunError: the server answered 500 and the CLI printed a traceback. Here
it is an InvalidArgument naming the limit, the same limit a request body has (MAX_DEPTH).
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import InvalidArgument

MAX_DEPTH = 512          # arrays/objects inside one another (serve/protocol.py's MAX_NESTING for a body)


def too_deep(what: str, limit: int = MAX_DEPTH) -> InvalidArgument:
    return InvalidArgument(f"{what} nests arrays and objects more than {limit} levels deep; that is the limit")


def deeper_than(data: Any, limit: int) -> bool:
    """Whether `data` nests lists/dicts more than `limit` deep (iterative: any depth)."""
    stack = [(data, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = list(v.values())
        elif not isinstance(v, list):
            continue
        if d > limit:
            return True
        stack.extend((c, d + 1) for c in v if isinstance(c, (dict, list)))
    return False


def loads(text: str, what: str, limit: int = MAX_DEPTH) -> Any:
    """json.loads(text), nested at most `limit` deep: InvalidArgument otherwise (json.JSONDecodeError,
    a ValueError, passes through for the caller's own message). The walk runs only when the text has
    enough brackets to be that deep."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise too_deep(what, limit) from None
    if text.count("[") + text.count("{") > limit and deeper_than(data, limit):
        raise too_deep(what, limit)
    return data
