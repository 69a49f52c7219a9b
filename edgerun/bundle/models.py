"""The bundle's models: registry files (models/FILE) and hub models (hf:ORG/REPO...), each verified in the
cache first (pulled if missing), then hard-linked (else copied) into the bundle.

A hub model is carried as the cache holds it, limited to the revision and files of the names bundled:

    hub/ORG/REPO/COMMIT/PATH          the pick's verified files (a GGUF, its split parts, or a checkpoint)
    hub/ORG/REPO/COMMIT/.files.json   {path: {size, sha256, hub_hash}} of the files carried, nothing else
    hub/ORG/REPO/picks/KEY.json       the name's record (commit, files, hashes, vocabulary fingerprint)
    models/converted/NAME-HASH.gguf   an INT4 checkpoint's GGUF, converted here once: the board needs neither
                                      the conversion's CPU time and memory nor a second conversion

The bundle's install.sh verifies them against manifest.json like every other file, and place_hub.py
(deploy/bundle-place-hub.py) lays them out in the service's cache: `--no-pull` and the service then resolve
the name from its record with no network, as on the machine that pulled it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from ..errors import HubError
from ..registry import hub
from ..registry.manifest import get_manifest, split_name
from ..resolve import auto_draft, pull_model
from ..util.atomic import raise_if_stopped, write_json
from .files import _place
from .spec import Progress, Say

PLACE_SCRIPT = "place_hub.py"          # deploy/bundle-place-hub.py in the bundle, run by install.sh


def check_name(name: str) -> None:
    """An unknown registry name or a malformed hub name fails here, before anything is fetched."""
    if hub.is_hub_name(name):
        hub.parse_name(name)
    else:
        get_manifest(split_name(name)[0])


def hub_auto_draft(model: str, progress: Progress | None, say: Say | None) -> str:
    """`--draft auto` for a hub model: pulled first if it is not cached, then a cached model of the same vocabulary
    as `--draft auto` finds it at run time, else the model-free suffix drafter."""
    if hub.cached(model) is None:       # a cached one is re-hashed once, when it is carried (add_models)
        if say:
            say(f"models: {model} (pulling it first, to pick its drafter)")
        pull_model(model, progress)
    return auto_draft(model)


def add_models(d: Path, names: Sequence[str], progress: Progress | None = None,
               say: Say | None = None) -> list[dict]:
    """Put each model into bundle folder `d`; one record per name for manifest.json's "models" ("file": the
    file the name loads, relative to `d`; "hub": what else a hub name carries)."""
    records = []
    for name in names:
        if hub.is_hub_name(name):
            records.append(_add_hub(d, name, progress, say))
        else:
            get_manifest(split_name(name)[0])
            if say:
                say(f"models: {name} (verifying the cached file against its pinned sha256)")
            path = pull_model(name, progress, verify=True)
            _place(path, d / "models" / path.name, progress, stage=f"copy {path.name}")
            records.append({"name": name, "file": f"models/{path.name}"})
        raise_if_stopped()
    return records


def _add_hub(d: Path, name: str, progress: Progress | None, say: Say | None) -> dict:
    if say:
        say(f"models: {name} (re-hashing the cached files against the sha256 recorded at pull; pulled if missing)")
    path = pull_model(name, progress, verify=True)          # the GGUF to load (a checkpoint's: converted)
    pick = hub.cached(name)
    if pick is None:                                      # pull_model leaves a complete pick or raises
        raise HubError(f"{name}: pulled, but its record is not in the cache ({hub.pick_path(hub.parse_name(name))})")
    rel_dir = Path("hub") / pick.repo_id / pick.revision
    carried = []
    for rel in sorted(pick.files):
        _place(pick.directory / rel, d / rel_dir / rel, progress, stage=f"copy {rel}")
        carried.append((rel_dir / rel).as_posix())
        raise_if_stopped()
    files_json = d / rel_dir / ".files.json"          # only what is carried (another name may share the commit)
    known = hub.read_json(files_json) or {}
    known.update(pick.files)
    write_json(files_json, known)
    record = hub.read_json(hub.pick_path(hub.parse_name(name)))
    pick_rel = Path("hub") / pick.repo_id / "picks" / hub.parse_name(name).key
    write_json(d / pick_rel, record)
    out = {"name": name, "hub": {"repo_id": pick.repo_id, "revision": pick.revision, "kind": pick.kind,
                                 "pick": pick_rel.as_posix(), "files": carried, "converted": None}}
    if pick.kind == "int4":
        _place(path, d / "models" / "converted" / path.name, progress, stage=f"copy {path.name}")
        out["hub"]["converted"] = out["file"] = f"models/converted/{path.name}"
    else:
        out["file"] = (rel_dir / pick.primary).as_posix()
    return out
