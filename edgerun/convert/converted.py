"""`--model DIR` for an INT4 checkpoint: convert it once into the models cache, keyed by its content hash.

The cached file is $EDGERUN_HOME/models/converted/<name>-<sha256[:16]>.gguf, where the hash covers the
checkpoint's bytes (config, weights, tokenizer files). Hashing a large checkpoint on every load would
be slow, so converted/index.json remembers, per (file names, sizes, mtimes), the hash computed last
time: an unchanged directory resolves without reading its weights; a changed one is hashed again.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import gguf

from ..util.atomic import write_json
from ..util.home import cache_dir
from .checkpoint import Int4Checkpoint
from .convert import convert

log = logging.getLogger(__name__)

INDEX = "index.json"


def converted_dir() -> Path:
    return cache_dir() / "models" / "converted"


def _stat_key(ckpt: Int4Checkpoint) -> str:
    h = hashlib.sha256()
    for f in ckpt.source_files():
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _read_index(d: Path) -> dict:
    try:
        data = json.loads((d / INDEX).read_text())
        return data if isinstance(data, dict) else {}
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def converted_model(directory: str | Path, *, exact: bool = False, name: str | None = None) -> Path:
    """The cached GGUF of INT4 checkpoint `directory`, converting it first if it is not there yet. `name` is
    the file's name stem (default: the directory's name; a hub checkout's directory is named by its commit)."""
    ckpt = Int4Checkpoint(directory)
    d = converted_dir()
    d.mkdir(parents=True, exist_ok=True)
    index = _read_index(d)
    key = _stat_key(ckpt)
    sha = index.get(key) or ckpt.sha256()
    path = d / f"{name or ckpt.name}-{sha[:16]}{'-exact' if exact else ''}.gguf"
    if not path.is_file():
        log.warning("converting %s (%s) into the cache: %s", ckpt.path, ckpt.scheme.label, path)
        convert(ckpt.path, path, exact=exact)
    if index.get(key) != sha:
        index[key] = sha
        write_json(d / INDEX, index)
    return path


def list_converted() -> list[dict]:
    """The converted models in the cache: name, path, size, source format and source hash."""
    rows = []
    d = converted_dir()
    for p in sorted(d.glob("*.gguf")) if d.is_dir() else ():
        r = gguf.GGUFReader(p)
        meta = {k: f.contents() for k, f in r.fields.items() if k.startswith("edgerun.") or k == "general.architecture"}
        rows.append({"name": p.stem, "path": str(p), "size": p.stat().st_size,
                     "arch": meta.get("general.architecture", ""),
                     "source_format": meta.get("edgerun.import.source_format", ""),
                     "quant": meta.get("edgerun.quant.format", ""),
                     "source_name": meta.get("edgerun.source.name", ""),
                     "source_sha256": meta.get("edgerun.source.sha256", "")})
    return rows
