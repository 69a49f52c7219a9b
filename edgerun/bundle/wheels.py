"""The bundle's wheels: edgerun's own (built from the source tree), llama-cpp-python for the board (given,
cross-built, or built here with the profile's CMAKE_ARGS and kept in the cache), and every dependency
downloaded for the board's platform and Python (pip download --platform; no code of theirs runs here)."""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Sequence

from ..device.profiles import load_profile
from ..util.atomic import atomic_dir
from ..util.home import cache_dir
from ..version import __version__
from .spec import BundleError, Say, Target, _normal_machine

log = logging.getLogger(__name__)

LLAMA_PIN_RE = re.compile(r"llama-cpp-python==([0-9][0-9A-Za-z.]*)")
SOURCE_PARTS = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "LICENSE", "edgerun", "models",
                "device_profiles", "kernels")


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


def source_root() -> Path:
    """The source tree edgerun runs from (a checkout or an editable install): its wheel is built from it."""
    root = Path(__file__).resolve().parents[2]
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
            f"`sudo bench/boards/emulate_pi.sh --profiles {target.profile} host llama` "
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
