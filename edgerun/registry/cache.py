"""The models cache ($EDGERUN_HOME) and resolving what a user wrote (registry name or path) to a file."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING


from ..errors import ModelFormatError, ModelNotFound
from .manifest import Manifest, get_manifest, load_manifests, split_name, unknown_message

if TYPE_CHECKING:
    from .fetch import Progress


log = logging.getLogger(__name__)


_MODEL_SUFFIXES = (".gguf", ".onnx")


def cache_dir() -> Path:
    """Root of edgerun's cache: $EDGERUN_HOME, default ~/.cache/edgerun."""
    env = os.environ.get("EDGERUN_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "edgerun"


def cached_path(model: str | Manifest, variant: str | None = None) -> Path:
    """Where a registry model's assembled file (or a variant made from it) lives in the cache, whether or not
    it is there."""
    m = model if isinstance(model, Manifest) else get_manifest(model)
    if variant is None:
        return cache_dir() / "models" / m.file_name
    return cache_dir() / "models" / f"{m.name}@{variant}.{m.format}"


def is_cached(model: str | Manifest, variant: str | None = None) -> bool:
    """Cheap check: the cached file exists and has the pinned size (``pull(verify=True)`` re-hashes); a variant
    exists (it is written atomically, so a file under its name is complete)."""
    m = model if isinstance(model, Manifest) else get_manifest(model)
    path = cached_path(m, variant)
    if variant is not None:
        return path.is_file()
    return path.is_file() and path.stat().st_size == m.size


def _looks_like_path(spec: str) -> bool:
    return (os.sep in spec or "/" in spec or spec.startswith((".", "~"))
            or spec.lower().endswith(_MODEL_SUFFIXES))


def _local_model(spec: str) -> Path:
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        if (path / "model.onnx").is_file():
            return path
        from ..convert import is_int4_checkpoint
        if is_int4_checkpoint(path):                 # a published INT4 checkpoint: converted once into the cache
            from ..convert.cache import converted_model
            return converted_model(path)
        raise ModelFormatError(f"{path} is a directory without model.onnx or a quantized config.json; expected a "
                               ".gguf file, an ONNX export directory holding model.onnx, or an INT4 checkpoint "
                               "directory (AutoAWQ, GPTQ, compressed-tensors)")
    raise ModelNotFound(f"no such file or directory: {path}; expected a path to a .gguf file or an ONNX "
                        "export directory, or a registry model name (see `edgerun list`)")


def resolve_model(spec: str | os.PathLike, *, pull: bool = True, progress: Progress | None = None) -> Path:
    """Turn what a user wrote into a model path.

    A registry name gives its cached file, pulled first if missing (or ModelNotFound when
    ``pull=False``); a path to a local .gguf file or an ONNX export directory gives that path; an INT4
    checkpoint directory gives its GGUF in the cache, converted on first use (edgerun.convert.cache).
    """
    spec = os.fspath(spec)
    if _looks_like_path(spec):
        return _local_model(spec)
    manifests = load_manifests()
    name, variant = split_name(spec)
    m = manifests.get(name)
    if m is None:
        if Path(spec).exists():
            return _local_model(spec)
        raise ModelNotFound(unknown_message(spec, manifests))
    if variant is not None and variant not in m.variants:
        known = ", ".join(f"{m.name}@{v}" for v in m.variants) or "none"
        raise ModelNotFound(f"model {m.name} has no variant {variant!r}; its variants: {known}")
    if is_cached(m, variant):
        return cached_path(m, variant)
    if not pull:
        how = f"edgerun pull {m.name} --variant {variant}" if variant else f"edgerun pull {m.name}"
        raise ModelNotFound(f"model {spec} is not in the cache ({cached_path(m, variant)}); run `{how}` first")
    from .fetch import pull_manifest

    return pull_manifest(m, progress=progress, variant=variant)
