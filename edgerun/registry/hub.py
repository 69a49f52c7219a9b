"""Models named on the Hugging Face hub, `hf:ORG/REPO[@REV][:QUANT|/FILE.gguf]`: the names, the file picking
rule and the cache of verified files; hub_download.py asks the hub (the `huggingface_hub` client, optional
extra `hub`) what a name resolves to and downloads it into this cache.

Data and cache only, like the rest of registry/: turning a hub name into a ready model file (converting an
INT4 checkpoint, checking its vocabulary) is edgerun.resolve.

Cache layout, $EDGERUN_HOME/hub/ORG/REPO/:

    COMMIT/PATH          a file of the repo at that commit, under its repo path; only ever renamed into place
                         after its hash matched the hub's (LFS sha256, or the git blob id for small files)
    COMMIT/.files.json   {path: {size, sha256, hub_hash}} of every verified file of that commit (atomic JSON)
    picks/KEY.json       one per name pulled (KEY: revision and selector): the commit it resolved to, its
                         files and hashes, the primary file. Written last: a name without one is not pulled.
    .staging/PATH.HASH.part   a download in progress; a later pull resumes it

A pick is read with no network: `--no-pull`, `serve` and the offline bundle use what is here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence
from urllib.parse import quote

from ..errors import HubError, InvalidArgument
from ..util.atomic import write_json
from ..util.home import cache_dir
from .fetch import Progress

log = logging.getLogger(__name__)

PREFIX = "hf:"
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")   # tried in this order when a GGUF repo is named without a quant tag
_NOT_MODEL = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")   # GGUF side files, not a model
_SPLIT = re.compile(r"^(?P<prefix>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
_NAME = re.compile(r"^hf:(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?:@(?P<rev>[\w.-]+))?"
                   r"(?::(?P<quant>[\w.-]+)|/(?P<file>[^\s:]+\.gguf))?$", re.IGNORECASE)
_CHUNK = 1 << 22


@dataclass(frozen=True)
class HubName:
    """A parsed `hf:` name. quant is upper-cased; file and quant are never both set."""
    repo_id: str
    revision: str | None = None
    quant: str | None = None
    file: str | None = None

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        sel = f":{self.quant}" if self.quant else f"/{self.file}" if self.file else ""
        return f"{PREFIX}{self.repo_id}{rev}{sel}"

    @property
    def key(self) -> str:
        """The pick record's file name: revision and selector, safe as one path component."""
        sel = f":{self.quant}" if self.quant else f"/{self.file}" if self.file else ""
        return quote(f"{self.revision or ''}{sel}" or "default", safe="") + ".json"


@dataclass(frozen=True)
class Pick:
    """A pulled name as recorded in the cache (picks/KEY.json)."""
    name: str
    repo_id: str
    requested_revision: str | None
    revision: str
    kind: str
    primary: str
    files: dict                    # path -> {"size", "sha256", "hub_hash"}
    directory: Path
    pulled_at: str = ""
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def model_path(self) -> Path:
        """The file to load (kind gguf) or the checkpoint directory (int4, float)."""
        return self.directory / self.primary if self.kind == "gguf" else self.directory

    @property
    def size(self) -> int:
        return sum(int(f["size"]) for f in self.files.values())


# ---- names and the file picking rule (no network) --------------------------------------------------------------

def is_hub_name(spec: str) -> bool:
    return os.fspath(spec).startswith(PREFIX)


def parse_name(spec: str) -> HubName:
    """`hf:ORG/REPO[@REV][:QUANT|/FILE.gguf]` -> HubName (InvalidArgument if it is not one)."""
    m = _NAME.match(os.fspath(spec).strip())
    if m is None:
        raise InvalidArgument(f"{spec!r} is not a hub name; expected hf:ORG/REPO[@REVISION][:QUANT|/FILE.gguf], "
                              "e.g. hf:ggml-org/gemma-3-1b-it-GGUF:Q4_K_M")
    quant = m.group("quant")
    return HubName(m.group("repo"), m.group("rev"), quant.upper() if quant else None, m.group("file"))


def is_model_gguf(path: str) -> bool:
    """A .gguf file that is a model, not a side file (projector, importance matrix, MTP / drafter heads)."""
    base = path.rsplit("/", 1)[-1]
    return base.lower().endswith(".gguf") and not any(k in base for k in _NOT_MODEL)


def split_parts(paths: Sequence[str], first: str) -> list[str]:
    """All parts of the split GGUF whose first part is `first` (just [first] for a whole file), in order."""
    m = _SPLIT.match(first)
    if m is None:
        return [first]
    parts = sorted(p for p in paths if (s := _SPLIT.match(p)) and s["prefix"] == m["prefix"]
                   and s["count"] == m["count"])
    if len(parts) != int(m["count"]):
        raise HubError(f"split GGUF {first}: the repo has {len(parts)} of its {int(m['count'])} parts")
    return parts


def pick_gguf(paths: Sequence[str], quant: str | None) -> str | None:
    """The GGUF a quant tag names, by llama.cpp's `-hf REPO:QUANT` rule (docs/models.md): in path order, the
    first model GGUF whose path holds the tag followed by '.' or '-' (any case), skipping parts 2.. of split
    files; no tag tries Q4_K_M, then Q8_0, then takes the first model GGUF. None if nothing matches."""
    models = [p for p in sorted(paths) if is_model_gguf(p)
              and ((s := _SPLIT.match(p)) is None or int(s["index"]) == 1)]
    for tag in ([quant] if quant else DEFAULT_QUANTS):
        pattern = re.compile(re.escape(tag) + r"[.-]", re.IGNORECASE)
        for p in models:
            if pattern.search(p):
                return p
    if quant is None and models:
        return models[0]
    return None


def quant_tags(paths: Sequence[str]) -> list[str]:
    """The quant tags a repo's model GGUFs offer (what a `:QUANT` may name), for error messages."""
    tags = []
    for p in sorted(paths):
        if is_model_gguf(p):
            stem = _SPLIT.sub(r"\g<prefix>", p.rsplit("/", 1)[-1])
            stem = stem[:-5] if stem.lower().endswith(".gguf") else stem
            m = re.search(r"[-.]([A-Za-z0-9_]+)$", stem)
            if m and m.group(1).upper() not in tags:
                tags.append(m.group(1).upper())
    return tags


# ---- the cache (no network) -------------------------------------------------------------------------------------

def hub_dir() -> Path:
    return cache_dir() / "hub"


def repo_dir(repo_id: str) -> Path:
    return hub_dir() / repo_id


def pick_path(name: HubName) -> Path:
    return repo_dir(name.repo_id) / "picks" / name.key


def read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def load_pick(path: Path) -> Pick | None:
    d = read_json(path)
    if d is None:
        return None
    try:
        return Pick(name=d["name"], repo_id=d["repo_id"], requested_revision=d.get("requested_revision"),
                    revision=d["revision"], kind=d["kind"], primary=d["primary"], files=dict(d["files"]),
                    directory=repo_dir(d["repo_id"]) / d["revision"], pulled_at=d.get("pulled_at", ""),
                    extra=dict(d.get("extra") or {}))
    except (KeyError, TypeError):
        return None


def _complete(p: Pick) -> bool:
    """Every file of the pick is there with its recorded size (a cheap check; verify() re-hashes)."""
    for path, f in p.files.items():
        try:
            if (p.directory / path).stat().st_size != int(f["size"]):
                return False
        except OSError:
            return False
    return True


def cached(name: HubName | str) -> Pick | None:
    """The pick of `name` if it was pulled and its files are all there; no network."""
    name = parse_name(name) if isinstance(name, str) else name
    p = load_pick(pick_path(name))
    return p if p is not None and _complete(p) else None


def list_pulled() -> list[Pick]:
    """Every complete pick in the cache, by name."""
    root = hub_dir()
    picks = [p for f in sorted(root.glob("*/*/picks/*.json")) if (p := load_pick(f)) is not None and _complete(p)] \
        if root.is_dir() else []
    return sorted(picks, key=lambda p: p.name)


def describe_cached(repo_id: str | None = None) -> str:
    """One phrase naming what the cache holds (of one repo, or all), for error messages."""
    every = list_pulled()
    picks = [p for p in every if repo_id is None or p.repo_id == repo_id]
    if not picks:
        others = f" (other hub models cached: {', '.join(p.name for p in every)})" if every else ""
        return (f"nothing from {repo_id} is cached" if repo_id else "no hub model is cached") + others
    return "cached: " + ", ".join(f"{p.name} (revision {p.revision[:12]})" for p in picks)


def set_extra(pick: Pick, **values) -> Pick:
    """Record more facts about a pulled name (the vocabulary fingerprint resolve computed)."""
    path = pick_path(parse_name(pick.name))
    d = read_json(path)
    if d is None:
        return pick
    d["extra"] = {**(d.get("extra") or {}), **values}
    write_json(path, d)
    return load_pick(path) or pick


def hash_file(path: Path, progress: Progress | None = None, stage: str = "verify") -> tuple[str, str]:
    """(sha256, git blob sha1) of a file, in one read."""
    size = path.stat().st_size
    sha, blob = hashlib.sha256(), hashlib.sha1(f"blob {size}\0".encode())
    done = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
            blob.update(chunk)
            done += len(chunk)
            if progress is not None:
                progress(stage, done, size)
    return sha.hexdigest(), blob.hexdigest()


def verify(pick: Pick, progress: Progress | None = None) -> list[str]:
    """Re-hash every file of a pick; the paths whose sha256 differs from the one recorded at pull time."""
    bad = []
    for path, f in pick.files.items():
        full = pick.directory / path
        if not full.is_file() or hash_file(full, progress, f"verify {path}")[0] != f["sha256"]:
            bad.append(path)
    return bad


def forget(pick: Pick, paths: Sequence[str]) -> None:
    """Drop a pick and the named files of it (they failed verify): the next pull fetches them again."""
    pick_path(parse_name(pick.name)).unlink(missing_ok=True)
    files_json = pick.directory / ".files.json"
    known = read_json(files_json) or {}
    for p in paths:
        (pick.directory / p).unlink(missing_ok=True)
        known.pop(p, None)
    if files_json.exists():
        write_json(files_json, known)
