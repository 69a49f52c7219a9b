"""The bundle's files: sha256 (the manifest's and install.sh's check), placing a file (a hard link, else a
copy), walking a folder, and an earlier bundle's wheels that still match its manifest (reused)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterator

from .spec import Progress

_CHUNK = 1 << 20


def sha256_file(path: Path, progress: Progress | None = None, stage: str = "hash",
                done: int = 0, total: int = 0) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            done += len(chunk)
            if progress is not None and total:
                progress(stage, done, total)
    return h.hexdigest()


def _place(src: Path, dest: Path, progress: Progress | None = None, stage: str = "copy") -> None:
    """Hard-link src to dest (the cache replaces files by rename, never in place), else copy it."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dest)
        return
    except OSError:
        pass
    total = src.stat().st_size
    done = 0
    with open(src, "rb") as fi, open(dest, "wb") as fo:
        while chunk := fi.read(_CHUNK):
            fo.write(chunk)
            done += len(chunk)
            if progress is not None:
                progress(stage, done, total)
    shutil.copymode(src, dest)


def _walk(root: Path) -> Iterator[Path]:
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            yield p


def _reusable(old: Path) -> dict[str, Path]:
    """An earlier bundle's wheels whose sha256 still matches its manifest, by file name."""
    try:
        manifest = json.loads((old / "manifest.json").read_text())
        files = {f["path"]: f for f in manifest["files"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    good = {}
    for rel, f in files.items():
        p = old / rel
        if rel.startswith("wheels/") and p.is_file() and p.stat().st_size == f.get("size") \
                and sha256_file(p) == f.get("sha256"):
            good[p.name] = p
    return good
