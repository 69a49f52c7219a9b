"""An offline bundle: everything a board with no network needs to install and run edgerun, in one folder.

``make_bundle`` runs on a connected Linux machine and writes, for one device profile and one Python
version::

    DIR/install.sh          the offline installer (deploy/bundle-install.sh): checks, verifies, installs
    DIR/manifest.json       target (Python, machine, glibc), models, and every file's size and sha256
    DIR/wheels/*.whl        edgerun, llama-cpp-python (built with the profile's CMAKE_ARGS + RPC), and every
                            dependency (pip download --platform/--python-version --only-binary)
    DIR/models/*.gguf       the models, copied from the verified cache (variants included)
    DIR/deploy/             the systemd unit and the env file (model, drafter, profile, no pulls)

The folder is built beside DIR under a hidden temporary name and renamed at the end (util.atomic), so a
killed bundle never leaves a folder that looks complete; a tarball is written the same way. A rerun into
an existing bundle reuses its wheels whose sha256 still matches its manifest (pip sees them as already
downloaded), and llama-cpp-python built here is kept in the cache ($EDGERUN_HOME/wheels) for the next run.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

from .errors import EdgerunError, InvalidArgument
from .util.atomic import atomic_dir, atomic_path, raise_if_stopped, remove_stale
from .util.home import cache_dir
from .version import __version__

log = logging.getLogger(__name__)

FORMAT = 1                     # manifest.json's "format": bumped when install.sh must read it differently
LLAMA_PIN_RE = re.compile(r"llama-cpp-python==([0-9][0-9A-Za-z.]*)")
SOURCE_PARTS = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "LICENSE", "edgerun", "models",
                "device_profiles", "kernels")
# glibc of the boards' usual systems: the newest manylinux tag the bundle's wheels may carry
DEFAULT_GLIBC = {"rpi": "2.36",       # Raspberry Pi OS bookworm (Debian 12)
                 "jetson": "2.35",    # JetPack 6 (Ubuntu 22.04)
                 "generic": "2.31"}   # Debian 11 / Ubuntu 20.04 and newer
_CHUNK = 1 << 20

Progress = Callable[[str, int, int], None]      # (stage, done, total), as edgerun.registry reports
Say = Callable[[str], None]                     # one line of news about a long step


class BundleError(EdgerunError):
    """A bundle cannot be made as asked (no wheel for the target, a pip download failed, ...)."""


@dataclass(frozen=True)
class BundleSpec:
    """What to bundle: a device profile, the models, the board's Python, and where it goes."""

    profile: str
    out: Path
    models: tuple[str, ...] = ()              # registry names or NAME@VARIANT; () = the default model
    draft: str = "auto"                       # auto (the registry's pair), none, or a registry name
    python: str = "3.11"
    glibc: str | None = None                  # newest glibc the wheels may need; None = the profile family's
    llama_wheel: Path | None = None
    extras: tuple[str, ...] = ("serve",)


@dataclass(frozen=True)
class BundleResult:
    path: Path
    size: int
    n_files: int
    seconds: float
    manifest: dict = field(repr=False, default_factory=dict)


@dataclass(frozen=True)
class Target:
    """The board the bundle is for."""

    profile: str
    machine: str              # x86_64 | aarch64
    python: str               # "3.11"
    glibc: str                # "2.36"
    tegra: bool

    @property
    def platforms(self) -> list[str]:
        """pip --platform values: every manylinux tag up to this glibc (pip does not expand them), and the
        plain linux tag a wheel built from source carries."""
        major, minor = (int(x) for x in self.glibc.split("."))
        tags = [f"manylinux_{major}_{m}_{self.machine}" for m in range(minor, 16, -1)]
        tags.append(f"manylinux2014_{self.machine}")
        if self.machine == "x86_64":
            tags += ["manylinux2010_x86_64", "manylinux1_x86_64"]
        tags.append(f"linux_{self.machine}")
        return tags


def _normal_machine(m: str) -> str:
    return {"amd64": "x86_64", "x86_64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}.get(m.lower(), m)


def target_for(spec: BundleSpec) -> Target:
    """The board a profile describes: Linux, its CPU architecture, the Python and glibc asked for."""
    from .device.profiles import load_profile

    prof = load_profile(spec.profile)
    if prof.match.system not in (None, "Linux"):
        raise BundleError(f"profile {prof.name} is for {prof.match.system}; bundles are for Linux boards "
                          "(systemd): install with pip there")
    machines = sorted({_normal_machine(m) for m in prof.match.machine})
    if len(machines) != 1 or machines[0] not in ("x86_64", "aarch64"):
        raise BundleError(f"profile {prof.name} does not name one CPU architecture (match.machine: "
                          f"{list(prof.match.machine)}); expected x86_64 or aarch64")
    if not re.fullmatch(r"3\.(1[0-9]|[2-9][0-9])", spec.python):
        raise InvalidArgument(f"--python {spec.python!r}: expected the board's CPython as MAJOR.MINOR, 3.10 or "
                              "newer (Raspberry Pi OS bookworm: 3.11)")
    family = "rpi" if prof.name.startswith("rpi") else "jetson" if prof.match.tegra else "generic"
    glibc = spec.glibc or DEFAULT_GLIBC[family]
    if not re.fullmatch(r"2\.[0-9]{2}", glibc) or int(glibc.split(".")[1]) < 17:
        raise InvalidArgument(f"--glibc {glibc!r}: expected the board's glibc as 2.NN, 2.17 or newer "
                              "(`ldd --version` on the board)")
    return Target(profile=prof.name, machine=machines[0], python=spec.python, glibc=glibc,
                  tegra=bool(prof.match.tegra))


# --- small helpers -------------------------------------------------------------------------------------

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


def _pip(args: Sequence[str], say: Say | None, *, env: dict | None = None, what: str) -> None:
    """Run pip with its news lines passed on (Collecting / Saved / Building ...); raise with its tail."""
    cmd = [sys.executable, "-m", "pip", *args]
    log.info("running %s", shlex.join(cmd))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    tail: list[str] = []
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            line = line.rstrip()
            if not line or line.startswith("WARNING: Location"):
                continue
            tail = (tail + [line])[-15:]
            if say is not None and line.lstrip().startswith(("Collecting", "Saved", "File was already",
                                                             "Building wheel", "Created wheel", "Processing")):
                say(f"{what}: {line.strip()}")
        rc = proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if rc != 0:
        raise BundleError(f"{what} failed (pip exit {rc}):\n" + "\n".join(tail))


def _wheel_tags(name: str) -> tuple[str, str, str, str]:
    """(distribution, version, python tag, platform tag) of a wheel file name."""
    parts = name[:-len(".whl")].split("-")
    if not name.endswith(".whl") or len(parts) not in (5, 6):
        raise BundleError(f"{name} is not a wheel file name (NAME-VERSION-PY-ABI-PLATFORM.whl)")
    return parts[0], parts[1], parts[-3], parts[-1]


# --- the parts ----------------------------------------------------------------------------------------

def source_root() -> Path:
    """The source tree edgerun runs from (a checkout or an editable install): its wheel is built from it."""
    root = Path(__file__).resolve().parent.parent
    if not (root / "pyproject.toml").is_file() or not (root / "deploy" / "bundle-install.sh").is_file():
        raise BundleError(f"edgerun runs from {root}, which is not its source tree (no pyproject.toml and "
                          "deploy/); run `edgerun bundle` from a checkout (pip install -e .)")
    return root


def llama_pin(root: Path) -> str:
    m = LLAMA_PIN_RE.search((root / "pyproject.toml").read_text())
    if not m:
        raise BundleError(f"{root / 'pyproject.toml'} pins no llama-cpp-python==VERSION")
    return m.group(1)


def build_edgerun_wheel(root: Path, out: Path, say: Say | None) -> Path:
    """edgerun's own wheel (models/, device_profiles/, kernels/ inside it, as setup.py arranges), built from a
    copy of the source tree so the checkout gets no build/ or egg-info."""
    with tempfile.TemporaryDirectory(prefix="edgerun-src-") as tmp:
        src = Path(tmp) / "edgerun-src"
        src.mkdir()
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "_data", "*.egg-info")
        for part in SOURCE_PARTS:
            p = root / part
            if p.is_dir():
                shutil.copytree(p, src / part, ignore=ignore)
            elif p.is_file():
                shutil.copy2(p, src / part)
        isolation = []
        try:
            import setuptools  # noqa: F401  (no isolated build env: it would need the package index)
            import wheel  # noqa: F401
            isolation = ["--no-build-isolation"]
        except ImportError:
            pass
        _pip(["wheel", "--no-deps", *isolation, "-w", str(out), str(src)], say, what="edgerun wheel")
    wheels = sorted(out.glob(f"edgerun-{__version__}-*.whl"))
    if not wheels:
        raise BundleError(f"pip wheel made no edgerun-{__version__}-*.whl in {out}")
    return wheels[0]


def check_llama_wheel(path: Path, pin: str, target: Target) -> None:
    if not path.is_file():
        raise BundleError(f"--llama-wheel {path} does not exist")
    dist, version, _, plat = _wheel_tags(path.name)
    if dist != "llama_cpp_python" or version != pin:
        raise BundleError(f"--llama-wheel {path.name} is not a llama_cpp_python-{pin}-*.whl (edgerun pins "
                          f"llama-cpp-python=={pin})")
    if not any(p.endswith("_" + target.machine) for p in plat.split(".")):
        raise BundleError(f"--llama-wheel {path.name} is for {plat}, not this bundle's {target.machine} "
                          f"({target.profile})")
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except zipfile.BadZipFile as e:
        raise BundleError(f"--llama-wheel {path} is not a readable wheel: {e}") from e
    if bad is not None:
        raise BundleError(f"--llama-wheel {path}: {bad} is corrupt")


def llama_wheel_for(target: Target, pin: str, say: Say | None) -> Path:
    """llama-cpp-python for the target when no --llama-wheel is given: built here with the profile's
    CMAKE_ARGS + RPC if this machine is of the target's kind (kept in the cache), the Pi emulation's
    cross-built wheel for a Pi profile, otherwise an error saying how to get one."""
    from .device.profiles import load_profile

    prof = load_profile(target.profile)
    cmake_args = " ".join(x for x in (prof.build.cmake_args, "-DGGML_RPC=on") if x)
    if target.tegra:
        raise BundleError(
            f"{target.profile}: llama-cpp-python with CUDA cannot be built here; build it on the Jetson (or an "
            f"arm64 machine with its JetPack's CUDA) with `CMAKE_ARGS='{cmake_args}' pip wheel --no-deps "
            f"--no-binary llama-cpp-python llama-cpp-python=={pin}` and pass it with --llama-wheel")
    here = _normal_machine(platform.machine())
    if target.profile.startswith("rpi") and here != "aarch64":
        emu = Path(os.environ.get("EDGERUN_EMU_DIR") or cache_dir() / "emu") / f"wheels-{target.profile}"
        found = sorted(emu.glob(f"llama_cpp_python-{pin}-*linux_aarch64.whl"))
        if found:
            if say:
                say(f"llama-cpp-python: the cross-built wheel {found[-1]}")
            return found[-1]
        raise BundleError(
            f"{target.profile}: no cross-built llama-cpp-python wheel in {emu}; make one with "
            f"`sudo bench/boards/emulate_pi.sh --profiles {target.profile} host rootfs wheels llama` "
            "(or build it on a Pi and pass --llama-wheel)")
    if platform.system() != "Linux" or here != target.machine:
        raise BundleError(f"{target.profile} is a {target.machine} board and this is {platform.system()} "
                          f"{here}: build llama-cpp-python on such a board with CMAKE_ARGS='{cmake_args}' "
                          "(`pip wheel --no-deps llama-cpp-python`) and pass it with --llama-wheel")
    key = hashlib.sha256(f"{pin} {cmake_args} {sorted(prof.build.env.items())}".encode()).hexdigest()[:12]
    store = cache_dir() / "wheels" / f"llama-{target.profile}-{key}"
    found = sorted(store.glob(f"llama_cpp_python-{pin}-*.whl"))
    if found:
        if say:
            say(f"llama-cpp-python: reusing {found[-1]} (built here with CMAKE_ARGS='{cmake_args}')")
        return found[-1]
    if say:
        say(f"llama-cpp-python: building {pin} with CMAKE_ARGS='{cmake_args}' (minutes; once, kept in {store})")
    env = {**os.environ, "CMAKE_ARGS": cmake_args, "FORCE_CMAKE": "1", **prof.build.env}
    with atomic_dir(store) as tmp:
        _pip(["wheel", "--no-deps", "--no-cache-dir", "--no-binary", "llama-cpp-python", "-w", str(tmp),
              f"llama-cpp-python=={pin}"], say, env=env, what="llama-cpp-python build")
    found = sorted(store.glob(f"llama_cpp_python-{pin}-*.whl"))
    if not found:
        raise BundleError(f"the llama-cpp-python build left no wheel in {store}")
    return found[-1]


def download_dependencies(wheels: Path, edgerun_wheel: Path, llama_wheel: Path, target: Target,
                          extras: Sequence[str], say: Say | None) -> None:
    """Every dependency of edgerun[extras] as wheels for the target (no code of theirs runs here)."""
    req = f"{edgerun_wheel}[{','.join(extras)}]" if extras else str(edgerun_wheel)
    args = ["download", "--only-binary=:all:", "--python-version", target.python, "--implementation", "cp",
            "-d", str(wheels), "--find-links", str(wheels)]
    for p in target.platforms:
        args += ["--platform", p]
    _pip([*args, req, str(llama_wheel)], say, what="dependencies")


def _model_files(names: Sequence[str], progress: Progress | None, say: Say | None) -> list[tuple[str, Path]]:
    """(name, cached file) for each model: pulled if missing, re-hashed against its pinned sha256 (a variant,
    made by edgerun here, is taken as made: it is written atomically)."""
    from .registry.manifest import get_manifest, split_name
    from .resolve import pull_model

    out = []
    for name in names:
        base, variant = split_name(name)
        get_manifest(base)                        # an unknown name fails here, before anything is fetched
        if say:
            say(f"models: {name} (verifying the cached file against its pinned sha256)")
        out.append((name, pull_model(name, progress, verify=True)))
    return out


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


# --- the bundle ---------------------------------------------------------------------------------------

def resolve_models(spec: BundleSpec) -> tuple[list[str], str | None]:
    from .config import DEFAULT_MODEL
    from .registry.manifest import default_draft_for, split_name

    models = list(dict.fromkeys(spec.models or (DEFAULT_MODEL,)))
    for name in models:
        if os.sep in name or name.endswith((".gguf", ".onnx")):
            raise InvalidArgument(f"--model {name}: a bundle takes registry names (`edgerun list`) or "
                                  "NAME@VARIANT, whose pinned files it can verify")
    draft = spec.draft
    if draft == "auto":
        draft = default_draft_for(models[0])
    elif draft in ("none", ""):
        draft = None
    if draft is not None:
        split_name(draft)
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
    from .device.profiles import load_profile
    from .serve.systemd import DEFAULT_PREFIX, render_unit

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

    model_records = []
    for name, path in _model_files(models, progress, say):
        dest = d / "models" / path.name
        _place(path, dest, progress, stage=f"copy {path.name}")
        model_records.append({"name": name, "file": f"models/{path.name}"})
        raise_if_stopped()

    (d / "deploy").mkdir()
    (d / "deploy" / "edgerun.service").write_text(        # as install.sh renders it for the default prefix
        render_unit(f"{DEFAULT_PREFIX}/venv/bin/edgerun serve", profile=load_profile(target.profile)))
    (d / "deploy" / "edgerun.env").write_text(
        env_file_text((root / "deploy" / "edgerun.env").read_text(), models[0], draft, target.profile))
    installer = d / "install.sh"
    shutil.copyfile(root / "deploy" / "bundle-install.sh", installer)
    installer.chmod(0o755)

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
        "extras": list(spec.extras),
        "llama_cpp_python": llama.name,
        "model": models[0],
        "draft": draft,
        "models": model_records,
        "files": records,
    }
    (d / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest
