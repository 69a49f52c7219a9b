"""The fix that the GPU warning prints (edgerun/device/gpu.py: rebuild_command) is a command a user can paste:
it installs into the Python running edgerun (a service's venv, not whichever pip is on PATH), keeps the
installed dependencies, and every option in it is one pip knows (pip itself parses it here, offline)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from edgerun.device import gpu
from edgerun.device.profiles import load_profile


def _split(command: str) -> tuple[dict[str, str], list[str]]:
    """The leading NAME=VALUE words of a shell command as an environment, and the rest."""
    words, env = shlex.split(command), {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    return env, words


@pytest.mark.parametrize("name", ["jetson-orin-nano-8gb", "jetson-agx-orin-64gb", "apple-m2"])
def test_the_rebuild_command_uses_this_python_and_keeps_the_dependencies(name):
    prof = load_profile(name)
    env, argv = _split(gpu.rebuild_command(prof, "0.3.36"))
    assert argv[:4] == [sys.executable, "-m", "pip", "install"]
    assert {"--force-reinstall", "--no-deps", "--no-cache-dir"} <= set(argv)
    assert argv[argv.index("--no-binary") + 1] == "llama-cpp-python" and argv[-1] == "llama-cpp-python==0.3.36"
    assert env["CMAKE_ARGS"] == f"{prof.build.cmake_args} -DGGML_RPC=on"
    assert {k: env[k] for k in prof.build.env} == dict(prof.build.env)   # CUDACXX on a Jetson


def test_pip_accepts_every_option_of_the_rebuild_command(tmp_path):
    # run offline against an empty wheel folder: pip parses the options (a wrong one exits 2, "no such
    # option") and then finds nothing to install (exit 1) - nothing is built or changed
    env, argv = _split(gpu.rebuild_command(load_profile("jetson-orin-nano-8gb"), "0.3.36"))
    run_env = {**os.environ, **env, "PIP_FIND_LINKS": str(tmp_path), "PIP_CONFIG_FILE": os.devnull}
    r = subprocess.run([*argv, "--dry-run", "--no-index"], capture_output=True, text=True, timeout=120,
                       env=run_env)
    assert r.returncode == 1, r.stderr
    assert "No matching distribution found for llama-cpp-python==0.3.36" in r.stderr


def test_a_jetson_warning_names_the_command():
    st = gpu.check(load_profile("jetson-orin-nx-16gb"))
    assert st.fix.endswith(gpu.rebuild_command(load_profile("jetson-orin-nx-16gb")))
