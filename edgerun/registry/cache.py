"""The models cache ($EDGERUN_HOME/models): where a registry model (or a variant made from it) lives, and
whether it is there. Turning what a user wrote into a file is edgerun.resolve."""

from __future__ import annotations

from pathlib import Path

from ..util.home import cache_dir
from .manifest import Manifest, get_manifest


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
