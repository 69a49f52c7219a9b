"""Writing a bundle: the models (verified against their pinned sha256), the unit and env file, install.sh,
and manifest.json of every file's size and sha256; into a folder built under a hidden name and renamed at
the end, or a tarball written the same way."""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Sequence

from ..config import DEFAULT_MODEL
from ..device.profiles import load_profile
from ..errors import InvalidArgument
from ..registry import hub
from ..registry.manifest import default_draft_for
from ..serve.systemd import DEFAULT_PREFIX, render_unit
from ..util.atomic import atomic_dir, atomic_path, raise_if_stopped, remove_stale
from ..version import __version__
from .files import _place, _reusable, _walk, sha256_file
from .models import PLACE_SCRIPT, add_models, check_name, hub_auto_draft
from .spec import BundleError, BundleResult, BundleSpec, Progress, Say, Target, target_for
from .wheels import build_edgerun_wheel, check_llama_wheel, download_dependencies, llama_pin, llama_wheel_for, source_root

FORMAT = 1                     # manifest.json's "format": bumped when install.sh must read it differently


def env_file_text(template: str, model: str, draft: str | None, profile: str) -> str:
    """deploy/edgerun.env with this bundle's model, drafter and profile, and pulls off (no network)."""
    sets = {"EDGERUN_MODEL": model, "EDGERUN_DRAFT": draft or "none", "EDGERUN_PROFILE": profile,
            "EDGERUN_NO_PULL": "1"}
    lines = template.splitlines()
    for key, value in sets.items():
        pat = re.compile(rf"^#?{key}=.*$")
        for i, line in enumerate(lines):
            if pat.match(line):
                lines[i] = f"{key}={value}"
                break
        else:
            lines.append(f"{key}={value}")
    head = "# Written by `edgerun bundle`: the bundle's models are installed; nothing is downloaded.\n"
    return head + "\n".join(lines) + "\n"


# --- the bundle ---------------------------------------------------------------------------------------

def resolve_models(spec: BundleSpec) -> tuple[list[str], str | None]:
    """The models to carry (the served one first) and the drafter to serve with. Registry names, NAME@VARIANT
    and hub names (hf:ORG/REPO...) are carried; `auto` for a hub model stays "auto" until make_bundle has
    pulled it (its drafter is a cached model of the same vocabulary: hub_auto_draft)."""
    models = list(dict.fromkeys(spec.models or (DEFAULT_MODEL,)))
    for name in models:
        if not hub.is_hub_name(name) and (os.sep in name or name.endswith((".gguf", ".onnx"))):
            raise InvalidArgument(f"--model {name}: a bundle takes registry names (`edgerun list`), NAME@VARIANT "
                                  "or hub names (hf:ORG/REPO[@REV][:QUANT|/FILE.gguf]), whose verified files it "
                                  "carries with their sha256")
        check_name(name)
    draft = spec.draft
    if draft == "auto":      # the paired drafter, else suffix lookup (model-free, as `--draft auto` runs it)
        if hub.is_hub_name(models[0]):
            return models, "auto"
        draft = default_draft_for(models[0]) or "suffix"
    elif draft in ("none", ""):
        draft = None
    if draft in ("suffix", "lookup"):
        return models, draft
    if draft is not None:
        check_name(draft)
        if draft not in models:
            models.append(draft)
    return models, draft


def make_bundle(spec: BundleSpec, *, progress: Progress | None = None, say: Say | None = None) -> BundleResult:
    """Write the bundle (a folder, or a tarball when spec.out ends with .tar) and return what was written."""
    t0 = time.perf_counter()
    out = Path(spec.out).expanduser().absolute()
    as_tar = out.name.endswith(".tar")
    target = target_for(spec)
    models, draft = resolve_models(spec)
    root = source_root()
    pin = llama_pin(root)
    llama = Path(spec.llama_wheel).expanduser().absolute() if spec.llama_wheel else None
    if llama is not None:
        check_llama_wheel(llama, pin, target)
    else:                     # before anything is written: a board whose wheel cannot be made here is refused now
        llama = llama_wheel_for(target, pin, say)
    if draft == "auto":       # a hub model's pair is known once it is pulled (before anything is written)
        draft = hub_auto_draft(models[0], progress, say)
        if draft not in ("suffix", "lookup") and draft not in models:
            models.append(draft)
    if as_tar:
        if out.is_dir():
            raise InvalidArgument(f"-o {out} is a directory; expected a new FILE.tar (or a folder without .tar)")
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(out, ".tmpdir")
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.{os.getpid()}.", suffix=".tmpdir", dir=out.parent))
        try:
            folder = staging / out.name[:-len(".tar")]
            folder.mkdir()
            manifest = _fill(folder, spec, target, models, draft, root, pin, llama, {}, progress, say)
            raise_if_stopped()
            total = sum(p.stat().st_size for p in _walk(folder))
            if say:
                say(f"tar: writing {out} ({total / 1e6:.0f} MB)")
            with atomic_path(out) as tmp:
                with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
                    tar.add(folder, arcname=folder.name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        size = out.stat().st_size
    else:
        if out.exists() and out.is_dir() and any(out.iterdir()) and not (out / "manifest.json").is_file():
            raise InvalidArgument(f"-o {out} is a folder that holds something other than a bundle; expected a "
                                  "new or empty folder, or an earlier bundle to update")
        reuse = _reusable(out) if out.is_dir() else {}
        if reuse and say:
            say(f"reusing {len(reuse)} verified wheel(s) of the earlier bundle in {out}")
        with atomic_dir(out) as tmp:
            manifest = _fill(tmp, spec, target, models, draft, root, pin, llama, reuse, progress, say)
        size = sum(f["size"] for f in manifest["files"])
    return BundleResult(path=out, size=size, n_files=len(manifest["files"]), seconds=time.perf_counter() - t0,
                        manifest=manifest)


def _fill(d: Path, spec: BundleSpec, target: Target, models: list[str], draft: str | None, root: Path,
          pin: str, llama: Path, reuse: dict[str, Path], progress: Progress | None,
          say: Say | None) -> dict:
    d.chmod(0o755)                       # a temporary folder is 0700; the bundle is meant to be read
    wheels = d / "wheels"
    wheels.mkdir()
    for name, p in reuse.items():
        if not name.startswith(("edgerun-", "llama_cpp_python-")):
            _place(p, wheels / name)
    if say:
        say(f"edgerun wheel: building {__version__} from {root}")
    edgerun_wheel = build_edgerun_wheel(root, wheels, say)
    raise_if_stopped()
    _place(llama, wheels / llama.name)
    raise_if_stopped()
    if say:
        say(f"dependencies: wheels for CPython {target.python} on {target.machine} (glibc <= {target.glibc})")
    download_dependencies(wheels, edgerun_wheel, wheels / llama.name, target, spec.extras, say)
    llamas = sorted(wheels.glob("llama_cpp_python-*.whl"))
    if [w.name for w in llamas] != [llama.name]:
        raise BundleError(f"expected exactly the llama-cpp-python wheel {llama.name} in the bundle, found "
                          f"{[w.name for w in llamas]}")
    raise_if_stopped()
    return fill_rest(d, target, models, draft, root=root, llama_name=llama.name, extras=spec.extras,
                     progress=progress, say=say)


def fill_rest(d: Path, target: Target, models: list[str], draft: str | None, *, root: Path, llama_name: str,
              extras: Sequence[str], progress: Progress | None = None, say: Say | None = None) -> dict:
    """Everything of a bundle after its wheels: the models, the unit and env file, the installer, and
    manifest.json over every file in `d` (tests make a bundle of models alone with it: no pip, no llama.cpp)."""
    model_records = add_models(d, models, progress, say)

    (d / "deploy").mkdir()
    (d / "deploy" / "edgerun.service").write_text(        # as install.sh renders it for the default prefix
        render_unit(f"{DEFAULT_PREFIX}/venv/bin/edgerun serve", profile=load_profile(target.profile)))
    (d / "deploy" / "edgerun.env").write_text(
        env_file_text((root / "deploy" / "edgerun.env").read_text(), models[0], draft, target.profile))
    installer = d / "install.sh"
    shutil.copyfile(root / "deploy" / "bundle-install.sh", installer)
    installer.chmod(0o755)
    shutil.copyfile(root / "deploy" / "bundle-place-hub.py", d / PLACE_SCRIPT)

    files = list(_walk(d))
    total = sum(p.stat().st_size for p in files)
    done = 0
    records = []
    for p in files:
        size = p.stat().st_size
        digest = sha256_file(p, progress, "checksums", done, total)
        done += size
        records.append({"path": p.relative_to(d).as_posix(), "size": size, "sha256": digest})
        raise_if_stopped()
    by_path = {r["path"]: r for r in records}
    for m in model_records:
        m["sha256"] = by_path[m["file"]]["sha256"]
        m["size"] = by_path[m["file"]]["size"]
    manifest = {
        "format": FORMAT,
        "edgerun": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "profile": target.profile,
        "target": {"python": target.python, "machine": target.machine, "glibc": target.glibc,
                   "platforms": target.platforms},
        "extras": list(extras),
        "llama_cpp_python": llama_name,
        "model": models[0],
        "draft": draft,
        "models": model_records,
        "files": records,
    }
    (d / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest
