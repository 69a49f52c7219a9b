"""bench/boards/unit_exec.py: the command, environment and working directory the emulated Pi's bundle stage
runs for the installed unit's ExecStart (no systemd in a chroot). Checked on the unit `edgerun service print`
renders and the shipped env file."""
from __future__ import annotations

import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("unit_exec", REPO / "bench" / "boards" / "unit_exec.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


unit_exec = _load()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    unit = subprocess.run([sys.executable, "-m", "edgerun", "service", "print", "--profile", "rpi5-8gb",
                           "--exec-start", "/opt/edgerun/venv/bin/edgerun serve",
                           "--env-file", "/etc/edgerun/edgerun.env"],
                          check=True, capture_output=True, text=True, cwd=REPO).stdout
    (tmp_path / "etc/systemd/system").mkdir(parents=True)
    (tmp_path / "etc/systemd/system/edgerun.service").write_text(unit)
    (tmp_path / "etc/edgerun").mkdir(parents=True)
    env = (REPO / "deploy/edgerun.env").read_text()
    # the file wins over the unit's Environment=, as in systemd; quotes are the file's, not the value's
    env += '\nEDGERUN_HOME="/srv/edgerun home"\nEDGERUN_PROFILE=rpi5-8gb\n# EDGERUN_PORT=1\n'
    (tmp_path / "etc/edgerun/edgerun.env").write_text(env)
    return tmp_path


def test_the_rendered_unit(root: Path) -> None:
    wd, env, cmd = unit_exec.unit_exec(root, "/etc/systemd/system/edgerun.service")
    assert cmd == ["/opt/edgerun/venv/bin/edgerun", "serve"]
    assert wd == "/var/lib/edgerun"                          # %S/edgerun
    assert env["EDGERUN_HOME"] == "/srv/edgerun home"        # EnvironmentFile= after Environment=
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["EDGERUN_PROFILE"] == "rpi5-8gb"
    assert env["EDGERUN_PORT"] == "8080"                     # a commented line is not read


def test_specifier_and_no_env_file(root: Path) -> None:
    (root / "etc/edgerun/edgerun.env").unlink()
    with pytest.raises(SystemExit, match="EnvironmentFile=/etc/edgerun/edgerun.env does not exist"):
        unit_exec.unit_exec(root, "/etc/systemd/system/edgerun.service")
    unit = root / "etc/systemd/system/edgerun.service"
    unit.write_text(unit.read_text().replace("EnvironmentFile=/etc", "EnvironmentFile=-/etc"))
    wd, env, cmd = unit_exec.unit_exec(root, "/etc/systemd/system/edgerun.service")
    assert env["EDGERUN_HOME"] == "/var/cache/edgerun"      # %C/edgerun
    assert "EDGERUN_MODEL" not in env


def test_prints_bash(root: Path) -> None:
    out = subprocess.run([sys.executable, str(REPO / "bench/boards/unit_exec.py"), str(root),
                          "/etc/systemd/system/edgerun.service"], check=True, capture_output=True, text=True).stdout
    script = out + 'printf "%s\\n" "$wd" "${svc_cmd[@]}" "${svc_env[@]}"'
    lines = subprocess.run(["bash", "-c", script], check=True, capture_output=True, text=True).stdout.splitlines()
    assert lines[:3] == ["/var/lib/edgerun", "/opt/edgerun/venv/bin/edgerun", "serve"]
    assert "EDGERUN_HOME=/srv/edgerun home" in lines[3:]
    assert shlex.split(out.splitlines()[0]) == ["wd=/var/lib/edgerun"]
