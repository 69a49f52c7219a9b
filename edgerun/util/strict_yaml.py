"""Our YAML is strict: one loader, for model manifests and device profiles alike, from a file into frozen
dataclasses. A duplicate key (PyYAML silently keeps the last one), an unknown key, a missing required key
and a value of the wrong type are errors of one shape, naming the file and the dotted key."""

from __future__ import annotations

import dataclasses
import math
import difflib
import types
import typing
from collections import abc
from pathlib import Path
from typing import Any

import yaml


MAX_BYTES = 1 << 20      # a manifest or profile is a few KB; anything near this is not one


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that raises on a duplicate mapping key and refuses aliases (*name): nothing edgerun reads
    needs them, and nested aliases expand exponentially (a few hundred bytes can exhaust memory)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.events.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"aliases (*{event.anchor}) are not allowed here; "
                                              "write the value out", event.start_mark)
        return super().compose_node(parent, index)


def _construct_mapping(loader: StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (each key may appear once)", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


if getattr(yaml, "__with_libyaml__", False):
    class CStrictLoader(yaml.CSafeLoader):
        """StrictLoader's rules on libyaml's C parser (about ten times faster: a one-shot command reads the
        profiles and manifests at start). Aliases are found in the composed graph, before construction."""

    CStrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
else:                                   # pragma: no cover - PyYAML without libyaml
    CStrictLoader = None


def _has_alias(node) -> bool:
    """Whether a composed node graph reuses a node (what an alias composes to). Iterative."""
    seen: set[int] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if id(n) in seen:
            return True
        seen.add(id(n))
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                stack.extend((k, v))
        elif isinstance(n, yaml.SequenceNode):
            stack.extend(n.value)
    return False


def load(text: str):
    """Parse YAML text strictly (raises yaml.YAMLError on syntax errors and duplicate keys)."""
    if CStrictLoader is None:
        return yaml.load(text, Loader=StrictLoader)
    loader = CStrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None and _has_alias(node):
            return yaml.load(text, Loader=StrictLoader)      # the pure-Python loader names the alias and raises
        return loader.construct_document(node) if node is not None else None
    finally:
        loader.dispose()


def read_mapping(path: Path, error: type[Exception], what: str) -> dict:
    """The top-level mapping of a YAML file; `error` (naming the file) when it cannot be read or parsed."""
    p = Path(path)
    try:
        if p.is_dir():
            raise error(f"{what} {path} is a directory; expected a YAML file")
        size = p.stat().st_size
        if size > MAX_BYTES:
            raise error(f"{what} {path} is {size} bytes; a {what} file is at most {MAX_BYTES} bytes")
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise error(f"{what} {path} is not UTF-8 text (byte {e.start}); expected a YAML file") from None
    try:
        data = load(text)
    except yaml.YAMLError as e:
        raise error(f"{what} {path} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise error(f"{path}: expected a mapping of {what} keys at the top level, got {type(data).__name__}")
    return data


def build(cls: type, data: Any, *, path: Path, error: type[Exception], where: str = "",
          exclude: abc.Container[str] = ()) -> Any:
    """An instance of dataclass `cls` from a YAML mapping, every value checked against its annotation
    (nested dataclasses, tuples, mappings, unions with None; '1e-5' strings read as floats).
    Fields named in `exclude` are not keys (they are filled in by the caller)."""
    return _Builder(path, error, exclude).dataclass(cls, data, where)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


class _Builder:
    def __init__(self, path: Path, error: type[Exception], exclude: abc.Container[str]) -> None:
        self.path, self.error, self.exclude = path, error, exclude

    def fail(self, msg: str) -> Exception:
        return self.error(f"{self.path}: {msg}")

    def dataclass(self, cls: type, data: Any, where: str) -> Any:
        if not isinstance(data, dict):
            raise self.fail(f"{where or 'the file'} must be a mapping of {cls.__name__} keys, got {_short(data)}")
        hints = typing.get_type_hints(cls)
        fields = [f for f in dataclasses.fields(cls) if f.name not in self.exclude]
        names = [f.name for f in fields]
        for key in data:
            if key not in names:
                hint = difflib.get_close_matches(str(key), names, n=1)
                did = f" (did you mean {hint[0]!r}?)" if hint else ""
                raise self.fail(f"unknown key {_dotted(where, key)!r}{did}; expected one of: {', '.join(names)}")
        kwargs = {}
        for f in fields:
            if f.name in data:
                kwargs[f.name] = self.value(data[f.name], hints[f.name], _dotted(where, f.name))
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise self.fail(f"missing required key {_dotted(where, f.name)!r} ({_type_name(hints[f.name])})")
        return cls(**kwargs)

    def value(self, value: Any, tp: Any, where: str) -> Any:
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin in (typing.Union, types.UnionType):
            if value is None:
                if type(None) in args:
                    return None
                raise self.fail(f"{where} must not be empty (null)")
            errors = []
            for a in args:
                if a is type(None):
                    continue
                try:
                    return self.value(value, a, where)
                except self.error as e:
                    errors.append(e)
            if len(errors) == 1:
                raise errors[0]
            raise self.fail(f"{where} has the wrong type: expected {_type_name(tp)}, got {_short(value)}")
        if value is None:
            raise self.fail(f"{where} must not be empty (null)")
        if dataclasses.is_dataclass(tp):
            return self.dataclass(tp, value, where)
        if origin is tuple:
            if not isinstance(value, list):
                raise self.fail(f"{where} must be a list, got {_short(value)}")
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(self.value(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
            if len(value) != len(args):
                raise self.fail(f"{where} must be a list of {len(args)} items, got {_short(value)}")
            return tuple(self.value(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        if origin in (abc.Mapping, dict):
            if not isinstance(value, dict):
                raise self.fail(f"{where} must be a mapping, got {_short(value)}")
            kt, vt = args or (str, str)
            return {self.value(k, kt, f"{where} key"): self.value(v, vt, f"{where}.{k}") for k, v in value.items()}
        if tp is bool:
            if isinstance(value, bool):
                return value
            raise self.fail(f"{where} must be true or false, got {_short(value)}")
        if tp is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            raise self.fail(f"{where} must be an integer, got {_short(value)}")
        if tp is float:
            x = None
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                x = float(value)
            elif isinstance(value, str):    # PyYAML reads 1e-5 (no dot) as a string: convert explicitly
                try:
                    x = float(value)
                except ValueError:
                    pass
            if x is None or not math.isfinite(x):
                raise self.fail(f"{where} must be a number (finite), got {_short(value)}")
            return x
        if tp is str:
            if isinstance(value, str):
                return value
            quote = " (quote it)" if isinstance(value, (int, float)) and not isinstance(value, bool) else ""
            raise self.fail(f"{where} must be a string{quote}, got {_short(value)}")
        raise self.fail(f"{where}: unsupported schema type {_type_name(tp)}")  # a bug in the schema


def _dotted(where: str, key: Any) -> str:
    return f"{where}.{key}" if where else str(key)


def _short(value: Any, limit: int = 60) -> str:
    """repr of a value, cut to `limit` characters (a message never embeds a whole document)."""
    r = repr(value)
    return r if len(r) <= limit else r[:limit] + "..."
