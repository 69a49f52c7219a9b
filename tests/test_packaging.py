"""Installs find the design card's top-level folders (models/, device_profiles/, kernels/): a wheel built
from the checkout and one built from the sdist carry every file, and a profile loads from such an install;
the editable install (the README's Quickstart) reads them from the checkout."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from edgerun.util import resources

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = resources.FOLDERS


def _shipped_files() -> set[str]:
    return {f"{d}/{p.relative_to(ROOT / d)}" for d in FOLDERS for p in (ROOT / d).rglob("*") if p.is_file()}


def _run(cmd: list[str], cwd: Path, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
         cwd=out)
    (whl,) = out.glob("edgerun-*.whl")
    return whl


def _wheel_data(whl: Path) -> set[str]:
    prefix = "edgerun/_data/"
    with zipfile.ZipFile(whl) as z:
        return {n[len(prefix):] for n in z.namelist() if n.startswith(prefix) and not n.endswith("/")}


def test_the_folders_hold_the_files():
    files = _shipped_files()
    assert any(f.startswith("models/") and f.endswith(".yaml") for f in files)
    assert "device_profiles/rpi5-8gb.yaml" in files and "kernels/stream.c" in files


def test_wheel_carries_every_manifest_profile_and_kernel(wheel):
    assert _wheel_data(wheel) == _shipped_files()


def test_a_profile_and_a_manifest_load_from_an_install_made_from_the_wheel(wheel, tmp_path):
    site = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)], cwd=tmp_path)
    code = ("import edgerun, edgerun.device.profiles as p, edgerun.registry as r, edgerun.device.kernels as k; "
            "print(edgerun.__file__); print(p.load_profile('rpi5-8gb').name); "
            "print(sorted(m.name for m in r.list_models())[0]); print(k.source('stream.c').is_file())")
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("EDGERUN_MODELS_DIR", None)
    out = _run([sys.executable, "-c", code], cwd=tmp_path, env=env).stdout.split("\n")
    assert out[0].startswith(str(site)), out        # the installed copy, not the checkout
    assert out[1:4] == ["rpi5-8gb", "gemma3-270m", "True"]


def test_a_wheel_built_from_the_sdist_carries_them_too(tmp_path):
    _run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(tmp_path), str(ROOT)], cwd=tmp_path)
    (sdist,) = tmp_path.glob("edgerun-*.tar.gz")
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert _shipped_files() <= names
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
          str(sdist)], cwd=tmp_path)
    (whl,) = tmp_path.glob("edgerun-*.whl")
    assert _wheel_data(whl) == _shipped_files()


def test_a_checkout_reads_the_top_level_folders():
    """The editable install and a plain checkout have no edgerun/_data: the folders are the repository's."""
    if (ROOT / "edgerun" / "_data").exists() or not Path(resources.__file__).is_relative_to(ROOT):
        pytest.skip("edgerun is imported from an install, not from this checkout")
    for folder in FOLDERS:
        assert resources.data_dir(folder) == ROOT / folder
