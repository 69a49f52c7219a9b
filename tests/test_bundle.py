"""`edgerun bundle` and the bundle's install.sh: an offline install, end to end, on this machine.

A bundle for this machine (generic-x86_64-cpu, this Python, SmolLM2 from the cache) is installed into a fresh
prefix inside a network namespace with no interfaces (`unshare -n`: no package index can be reached), and
`edgerun generate` runs from the installed venv. Damaged bundles are refused before anything is installed, a
failed install leaves the previous version in place, and a killed bundle leaves nothing that looks complete.

Needs: the package index for `pip download` (the bundle is made on a connected machine), `unshare -n`
(root or user namespaces), and a llama-cpp-python wheel built once (.ci/run leaves it in build/wheels/;
or EDGERUN_LLAMA_WHEEL=FILE): the test never builds llama.cpp itself. Select with `pytest -m bundle`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"

pytestmark = pytest.mark.bundle


def _llama_wheel() -> Path | None:
    env = os.environ.get("EDGERUN_LLAMA_WHEEL")
    if env:
        return Path(env) if Path(env).is_file() else None
    found = sorted((ROOT / "build" / "wheels").glob("llama_cpp_python-*.whl"))
    return found[-1] if found else None


def _can_unshare() -> bool:
    try:
        return subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _bundle_cmd(out: Path, wheel: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "edgerun", "bundle", "--profile", "generic-x86_64-cpu", "-m", MODEL,
            "--draft", "none", "--python", "%d.%d" % sys.version_info[:2], "--glibc", "2.31",
            "--llama-wheel", str(wheel), "-o", str(out), *extra]


@pytest.fixture(scope="module")
def wheel() -> Path:
    w = _llama_wheel()
    if w is None:
        pytest.skip("no prebuilt llama-cpp-python wheel in build/wheels/ (made by .ci/run) or $EDGERUN_LLAMA_WHEEL; "
                    "this test does not build llama.cpp")
    return w


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, wheel) -> Path:
    """A bundle of this checkout for this machine (needs the package index and SmolLM2 in the cache)."""
    out = tmp_path_factory.mktemp("bundle") / "edgerun-bundle"
    r = subprocess.run(_bundle_cmd(out, wheel), capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "bundle " in r.stdout and "install.sh" in r.stdout
    return out


def _install(bundle: Path, root: Path, *extra: str, netns: bool = True) -> subprocess.CompletedProcess:
    cmd = [str(bundle / "install.sh"), "--prefix", str(root / "opt"), "--etc-dir", str(root / "etc"),
           "--unit-dir", str(root / "units"), "--cache-dir", str(root / "cache"), "--offline", *extra]
    if netns:
        cmd = ["unshare", "-n", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


def _copy(bundle: Path, dest: Path) -> Path:
    """A copy of the bundle to damage (real copies: the original's files must not change)."""
    shutil.copytree(bundle, dest)
    return dest


def test_the_manifest_lists_every_file_with_its_sha256_and_the_target(bundle, wheel):
    import hashlib

    m = json.loads((bundle / "manifest.json").read_text())
    on_disk = sorted(p.relative_to(bundle).as_posix() for p in bundle.rglob("*")
                     if p.is_file() and p.name != "manifest.json")
    assert sorted(f["path"] for f in m["files"]) == on_disk
    for f in m["files"]:
        data = (bundle / f["path"]).read_bytes()
        assert len(data) == f["size"] and hashlib.sha256(data).hexdigest() == f["sha256"], f["path"]
    assert m["target"]["python"] == "%d.%d" % sys.version_info[:2] and m["target"]["machine"] == "x86_64"
    assert m["llama_cpp_python"] == wheel.name and (bundle / "wheels" / wheel.name).is_file()
    names = {p.name.split("-")[0].lower() for p in (bundle / "wheels").glob("*.whl")}
    assert {"edgerun", "llama_cpp_python", "numpy", "gguf", "llguidance", "fastapi", "uvicorn"} <= names
    assert [x["name"] for x in m["models"]] == [MODEL] and (bundle / m["models"][0]["file"]).is_file()
    env = (bundle / "deploy" / "edgerun.env").read_text()
    assert f"\nEDGERUN_MODEL={MODEL}\n" in env and "\nEDGERUN_NO_PULL=1\n" in env


@pytest.fixture(scope="module")
def installed(bundle, tmp_path_factory) -> Path:
    if not _can_unshare():
        pytest.skip("`unshare -n` is not permitted here (needs root or user namespaces)")
    root = tmp_path_factory.mktemp("board")
    r = _install(bundle, root)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "verified" in r.stdout and "no running systemd" in r.stdout
    return root


def test_offline_install_then_generate_from_the_installed_venv(installed):
    root = installed
    venv = root / "opt" / "venv"
    assert venv.is_symlink() and Path(os.readlink(venv)).parent == root / "opt" / "venvs"
    unit = (root / "units" / "edgerun.service").read_text()
    assert f"ExecStart={venv}/bin/edgerun serve" in unit and f"EnvironmentFile={root}/etc/edgerun.env" in unit
    assert "SupplementaryGroups" not in unit          # the x86 CPU profile's unit: no GPU section
    model = root / "opt" / "models" / f"{MODEL}.gguf"
    assert oct(model.stat().st_mode & 0o777) == "0o644"
    assert (root / "cache" / "models" / f"{MODEL}.gguf").resolve() == model
    env = {"PATH": "/usr/bin:/bin", "HOME": str(root), "EDGERUN_HOME": str(root / "cache")}
    r = subprocess.run(["unshare", "-n", str(venv / "bin" / "edgerun"), "generate", "-m", MODEL, "--no-pull",
                        "-n", "12", "-t", "0", "--threads", "2", "The capital of France is"],
                       capture_output=True, text=True, env=env, cwd=root, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip(), "the installed edgerun generated no text"
    # the installed package is the wheel in the venv, not this checkout
    r = subprocess.run([str(venv / "bin" / "python"), "-c", "import edgerun; print(edgerun.__file__)"],
                       capture_output=True, text=True, env=env, cwd=root)
    assert Path(r.stdout.strip()).resolve().is_relative_to(venv.resolve()), r.stdout


def test_a_reinstall_switches_the_venv_and_keeps_the_env_file(bundle, installed):
    root = installed
    env_file = root / "etc" / "edgerun.env"
    env_file.write_text(env_file.read_text() + "EDGERUN_PORT=9999\n")
    before = Path(os.readlink(root / "opt" / "venv"))
    r = _install(bundle, root)
    assert r.returncode == 0, r.stderr[-2000:]
    after = Path(os.readlink(root / "opt" / "venv"))
    assert after != before and after.is_dir() and before.is_dir()     # the previous one kept for a roll-back
    assert env_file.read_text().endswith("EDGERUN_PORT=9999\n") and "keeping the existing" in r.stdout


def test_a_failed_install_leaves_the_previous_version(bundle, installed, tmp_path):
    # a bundle whose manifest is consistent but lacks a dependency: pip --no-index fails mid-install
    root = installed
    broken = _copy(bundle, tmp_path / "broken")
    gone = next((broken / "wheels").glob("click-*.whl"))
    gone.unlink()
    m = json.loads((broken / "manifest.json").read_text())
    m["files"] = [f for f in m["files"] if f["path"] != f"wheels/{gone.name}"]
    (broken / "manifest.json").write_text(json.dumps(m))
    before = os.readlink(root / "opt" / "venv")
    venvs = sorted((root / "opt" / "venvs").iterdir())
    r = _install(broken, root)
    assert r.returncode != 0 and "previous version" in r.stderr
    assert os.readlink(root / "opt" / "venv") == before
    assert sorted((root / "opt" / "venvs").iterdir()) == venvs        # the half-made venv is gone
    r = subprocess.run([str(root / "opt" / "venv" / "bin" / "edgerun"), "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and "0." in r.stdout


@pytest.mark.parametrize("damage", ["corrupt", "missing", "unlisted"])
def test_a_damaged_bundle_is_refused_before_anything_is_installed(bundle, tmp_path, damage):
    bad = _copy(bundle, tmp_path / "bad")
    numpy_wheel = next((bad / "wheels").glob("numpy-*.whl"))
    if damage == "corrupt":
        data = bytearray(numpy_wheel.read_bytes())
        data[len(data) // 2] ^= 0xFF
        numpy_wheel.write_bytes(bytes(data))
    elif damage == "missing":
        numpy_wheel.unlink()
    else:
        shutil.copy(numpy_wheel, bad / "wheels" / "evil-1.0-py3-none-any.whl")
    root = tmp_path / "board"
    r = _install(bad, root, netns=False)
    assert r.returncode == 2
    named = "evil-1.0-py3-none-any.whl" if damage == "unlisted" else numpy_wheel.name
    assert f"wheels/{named}" in r.stderr and "nothing was installed" in r.stderr
    assert not root.exists()


def test_another_python_is_refused_up_front(bundle, tmp_path):
    bad = _copy(bundle, tmp_path / "py")
    m = json.loads((bad / "manifest.json").read_text())
    m["target"]["python"] = "3.99"
    (bad / "manifest.json").write_text(json.dumps(m))
    root = tmp_path / "board"
    r = _install(bad, root, netns=False)
    assert r.returncode == 2 and "CPython 3.99" in r.stderr and "nothing was installed" in r.stderr
    assert not root.exists()


def _start_and_kill(cmd: list[str], sig: int) -> str:
    """Run a bundle until it reports its dependency download (its folder half made), then send `sig`."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    seen = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("dependencies:"):
                break
        if sig == signal.SIGKILL:        # a killed session: the bundle and its pip child, no cleanup at all
            os.killpg(proc.pid, sig)
        else:                            # a polite stop: the bundle itself must stop pip and clean up
            proc.send_signal(sig)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert any(line.startswith("dependencies:") for line in seen), "".join(seen)[-2000:]
    return "".join(seen)


def _complete_looking(parent: Path) -> list[Path]:
    return [p for p in parent.rglob("manifest.json")] + [p for p in parent.iterdir() if not p.name.startswith(".")]


def test_a_killed_bundle_leaves_nothing_complete_and_a_rerun_reuses_and_cleans(bundle, wheel, tmp_path):
    # SIGKILL: no cleanup runs; only a hidden temporary folder (no manifest) stays beside the target
    out = tmp_path / "out" / "b"
    out.parent.mkdir()
    _start_and_kill(_bundle_cmd(out, wheel), signal.SIGKILL)
    assert not out.exists()
    left = list(out.parent.iterdir())
    assert left and all(p.name.startswith(".b.") and p.name.endswith(".tmpdir") for p in left)
    assert not list(out.parent.rglob("manifest.json"))
    # SIGTERM on a tarball: the temporaries are removed, no .tar appears
    tar = tmp_path / "tar" / "b.tar"
    tar.parent.mkdir()
    _start_and_kill(_bundle_cmd(tar, wheel), signal.SIGTERM)
    assert list(tar.parent.iterdir()) == []
    # a rerun into an earlier bundle (a copy of the module's): killed, the earlier one is intact; run
    # again, it reuses the earlier verified wheels and the dead run's temporary folder is removed
    again = _copy(bundle, tmp_path / "again" / "b")
    manifest = (again / "manifest.json").read_bytes()
    _start_and_kill(_bundle_cmd(again, wheel), signal.SIGKILL)
    assert (again / "manifest.json").read_bytes() == manifest
    r = subprocess.run(_bundle_cmd(again, wheel), capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "reusing" in r.stderr and "File was already downloaded" in r.stderr
    assert [p.name for p in again.parent.iterdir()] == ["b"]
    assert json.loads((again / "manifest.json").read_text())["files"]


def test_dry_run_checks_and_verifies_then_prints_the_plan_and_changes_nothing(bundle, tmp_path):
    root = tmp_path / "board"
    r = _install(bundle, root, "--dry-run", netns=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "verified" in r.stdout and "pip install --no-index" in r.stdout and "mv -T" in r.stdout
    assert "--profile generic-x86_64-cpu" in r.stdout              # the unit is rendered for the bundle's board
    assert not root.exists()


# --- refusals made before anything is fetched or written (no network, no model) ---------------------------

def test_the_target_names_every_manylinux_tag_up_to_its_glibc():
    from edgerun.bundle import BundleSpec, target_for

    t = target_for(BundleSpec(profile="rpi5-8gb", out=Path("x")))
    assert (t.machine, t.python, t.glibc) == ("aarch64", "3.11", "2.36")
    assert t.platforms[0] == "manylinux_2_36_aarch64" and "manylinux_2_17_aarch64" in t.platforms
    assert t.platforms[-1] == "linux_aarch64" and not any("x86_64" in p for p in t.platforms)


@pytest.mark.parametrize("profile, words", [
    ("apple-m2", "Linux boards"),
    ("jetson-orin-nano-8gb", "--llama-wheel"),
    ("rpi5-8gb", "emulate_pi.sh"),
])
def test_a_board_whose_llama_wheel_cannot_be_made_here_is_refused_up_front(profile, words, tmp_path, monkeypatch):
    import platform

    from edgerun.bundle import BundleError, BundleSpec, make_bundle

    if profile == "rpi5-8gb" and platform.machine() in ("aarch64", "arm64"):
        pytest.skip("on an arm64 machine the Pi's wheel is built here")
    monkeypatch.setenv("EDGERUN_EMU_DIR", str(tmp_path / "emu"))      # no cross-built wheel there
    out = tmp_path / "b"
    with pytest.raises(BundleError, match=words):
        make_bundle(BundleSpec(profile=profile, out=out))
    assert list(tmp_path.iterdir()) == []


def test_a_llama_wheel_for_another_architecture_is_refused(tmp_path):
    from edgerun.bundle import BundleError, BundleSpec, llama_pin, make_bundle

    w = tmp_path / f"llama_cpp_python-{llama_pin(ROOT)}-py3-none-linux_aarch64.whl"
    w.write_bytes(b"PK")
    with pytest.raises(BundleError, match="not this bundle's x86_64"):
        make_bundle(BundleSpec(profile="generic-x86_64-cpu", out=tmp_path / "b", llama_wheel=w))
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("args, words", [
    (["--profile", "apple-m2"], "Linux boards"),
    (["--profile", "generic-x86_64-cpu", "--python", "2.7"], "--python '2.7'"),
    (["--profile", "no-such-board"], "unknown device profile"),
])
def test_the_cli_prints_one_error_line_and_exits_2(args, words, tmp_path):
    r = subprocess.run([sys.executable, "-m", "edgerun", "bundle", *args, "-o", str(tmp_path / "b")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and words in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and list(tmp_path.iterdir()) == []


def test_the_bundles_drafter_is_the_pair_else_suffix_lookup():
    from edgerun.bundle import BundleSpec
    from edgerun.bundle.make import resolve_models

    spec = lambda **kw: BundleSpec(profile="generic-x86_64-cpu", out=Path("x"), **kw)      # noqa: E731
    assert resolve_models(spec(models=("smollm2-135m-instruct",))) == (["smollm2-135m-instruct"], "suffix")
    models, draft = resolve_models(spec(models=("qwen2.5-coder-1.5b-instruct",)))
    assert draft == "qwen2.5-coder-0.5b-instruct" and models == ["qwen2.5-coder-1.5b-instruct", draft]
    assert resolve_models(spec(models=("smollm2-135m-instruct",), draft="none"))[1] is None
    assert resolve_models(spec(models=("smollm2-135m-instruct",), draft="lookup"))[1] == "lookup"
