#!/usr/bin/env python3
"""Lay out a bundle's hub models on the board (the bundle's place_hub.py, run by its install.sh after every
file was verified against manifest.json). Standard library only: it runs with the board's python3.

    python3 place_hub.py BUNDLE PREFIX CACHE [--dry-run]

The files of a hub model (hub/ORG/REPO/COMMIT/PATH) and converted checkpoints (models/converted/FILE) are
copied to PREFIX (root-owned, mode 0644), and CACHE (the service's EDGERUN_HOME) links to each one, as
install.sh does for registry files; the records edgerun reads and may update (picks/KEY.json, a commit's
.files.json, merged with what the cache already lists) are written into CACHE itself. Every write is
atomic (a temporary name, then a rename), so a rerun (an upgrade) finds a consistent cache.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import sys

DRY = "--dry-run" in sys.argv


def say(msg: str) -> None:
    print(f"==> {msg}", flush=True)


def _mkdirs(path: str) -> None:
    if not DRY:
        os.makedirs(path, mode=0o755, exist_ok=True)


def _atomic_write(dest: str, data: bytes) -> None:
    if DRY:
        print(f"+ write {dest}")
        return
    _mkdirs(os.path.dirname(dest))
    tmp = f"{dest}.{os.getpid()}.part"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, dest)


def _copy(src: str, dest: str) -> bool:
    """src to dest (a temporary name, then a rename); False when dest already holds the same bytes."""
    if os.path.isfile(dest) and not os.path.islink(dest) and filecmp.cmp(src, dest, shallow=False):
        return False
    if DRY:
        print(f"+ copy {src} {dest}")
        return True
    _mkdirs(os.path.dirname(dest))
    tmp = f"{dest}.{os.getpid()}.part"
    shutil.copyfile(src, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, dest)
    return True


def _link(target: str, link: str) -> None:
    """link -> target, replacing a link or a different file there (a real file with the same bytes stays)."""
    if os.path.islink(link) and os.readlink(link) == target:
        return
    if os.path.isfile(link) and not os.path.islink(link) and filecmp.cmp(target, link, shallow=False):
        return
    if DRY:
        print(f"+ ln -sfn {target} {link}")
        return
    _mkdirs(os.path.dirname(link))
    tmp = f"{link}.{os.getpid()}.link"
    os.symlink(target, tmp)
    os.replace(tmp, link)


def _merge_files_json(src: str, dest: str) -> None:
    """A commit's .files.json in the cache: the bundle's entries added to what the cache lists already."""
    with open(src) as f:
        new = json.load(f)
    try:
        with open(dest) as f:
            old = json.load(f)
        if not isinstance(old, dict):
            old = {}
    except (OSError, ValueError):
        old = {}
    old.update(new)
    _atomic_write(dest, (json.dumps(old, indent=1) + "\n").encode())


def _drop_unused_commits(repo: str, prefix: str, cache: str) -> None:
    """An upgrade that carries a newer revision of a repo: the commits no record in the cache names any more
    go, in the cache and under PREFIX (as a pull drops them); nothing goes if a record cannot be read."""
    picks = os.path.join(cache, "hub", repo, "picks")
    used = set()
    for name in os.listdir(picks) if os.path.isdir(picks) else ():
        try:
            with open(os.path.join(picks, name)) as f:
                used.add(json.load(f)["revision"])
        except (OSError, ValueError, KeyError, TypeError):
            return
    for root in (cache, prefix):
        top = os.path.join(root, "hub", repo)
        for d in sorted(os.listdir(top)) if os.path.isdir(top) else ():
            path = os.path.join(top, d)
            if d in used or d == "picks" or d.startswith(".") or not os.path.isdir(path) or os.path.islink(path):
                continue
            if DRY:
                print(f"+ rm -rf {path}")
            else:
                say(f"removing {path}: a commit of {repo} that no installed name uses any more")
                shutil.rmtree(path, ignore_errors=True)


def place(bundle: str, prefix: str, cache: str) -> int:
    with open(os.path.join(bundle, "manifest.json")) as f:
        manifest = json.load(f)
    copied = kept = 0
    for entry in manifest["files"]:
        rel = entry["path"]
        src = os.path.join(bundle, rel)
        parts = rel.split("/")
        if parts[0] == "hub" and parts[-1] == ".files.json":
            _merge_files_json(src, os.path.join(cache, rel))
        elif parts[0] == "hub" and len(parts) > 2 and parts[-2] == "picks":
            with open(src, "rb") as f:
                _atomic_write(os.path.join(cache, rel), f.read())
        elif parts[0] == "hub" or rel.startswith("models/converted/"):
            dest = os.path.join(prefix, rel)
            if _copy(src, dest):
                copied += 1
            else:
                kept += 1
            _link(dest, os.path.join(cache, rel))
    for m in manifest.get("models", []):
        if m.get("hub"):
            h = m["hub"]
            _drop_unused_commits(h["repo_id"], prefix, cache)
            conv = f", its converted GGUF {h['converted']}" if h.get("converted") else ""
            say(f"hub model {m['name']}: {h['repo_id']} at {h['revision'][:12]} ({len(h['files'])} files{conv})")
    did = "to copy" if DRY else "copied"
    say(f"hub files: {copied} {did} to {prefix}, {kept} already there; linked from {cache} (the unit's EDGERUN_HOME)")
    return 0


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--dry-run"]
    if len(args) != 3:
        sys.exit("usage: place_hub.py BUNDLE PREFIX CACHE [--dry-run]")
    sys.exit(place(*args))
