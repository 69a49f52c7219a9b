"""The command systemd would run for a unit's ExecStart=, for running it where there is no systemd (a
chroot of an emulated board): prints bash assignments of `wd` (WorkingDirectory=), `svc_env` (the
Environment= assignments, then each EnvironmentFile=, which win, as in systemd) and `svc_cmd` (ExecStart=),
with the system manager's specifiers %C=/var/cache, %S=/var/lib, %%=%.

    python unit_exec.py ROOT /etc/systemd/system/edgerun.service     # files read under ROOT

Only what edgerun's unit uses: one ExecStart= without prefixes, Environment=, EnvironmentFile= (a leading
'-': optional), WorkingDirectory=. Used by emulate_pi.sh's bundle stage.
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

SPECIFIERS = {"%C": "/var/cache", "%S": "/var/lib", "%%": "%"}


def expand(value: str) -> str:
    for k, v in SPECIFIERS.items():
        value = value.replace(k, v)
    return value


def env_file(text: str) -> dict[str, str]:
    env = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")) or "=" not in line:
            continue
        k, _, v = line.partition("=")
        env[k.strip()] = " ".join(shlex.split(v)) if v.strip() else ""
    return env


def unit_exec(root: Path, unit: str) -> tuple[str, dict[str, str], list[str]]:
    env: dict[str, str] = {}
    files: list[str] = []
    cmd: list[str] = []
    wd = "/"
    for line in (root / unit.lstrip("/")).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, val = line.partition("=")
        if key == "Environment":
            for a in shlex.split(val):
                k, _, v = a.partition("=")
                env[k] = expand(v)
        elif key == "EnvironmentFile":
            files.append(expand(val))
        elif key == "ExecStart":
            cmd = shlex.split(expand(val))
        elif key == "WorkingDirectory":
            wd = expand(val)
    if not cmd:
        sys.exit(f"{unit}: no ExecStart=")
    for f in files:
        path = root / f.lstrip("-").lstrip("/")
        if not path.is_file():
            if f.startswith("-"):
                continue
            sys.exit(f"{unit}: EnvironmentFile={f} does not exist")
        env.update(env_file(path.read_text()))
    return wd, env, cmd


def main() -> None:
    root, unit = Path(sys.argv[1]), sys.argv[2]
    wd, env, cmd = unit_exec(root, unit)
    print(f"wd={shlex.quote(wd)}")
    print("svc_env=(" + " ".join(shlex.quote(f"{k}={v}") for k, v in env.items()) + ")")
    print("svc_cmd=(" + " ".join(shlex.quote(a) for a in cmd) + ")")


if __name__ == "__main__":
    main()
