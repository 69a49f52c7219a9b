"""Never silently on the CPU (edgerun/device/gpu.py): on this CPU-only llama.cpp build a GPU profile warns
with the fix, --require-gpu / EDGERUN_REQUIRE_GPU exit 2, /health, /metrics and `edgerun profile` say where
the layers are; the Jetson unit reaches the GPU's device nodes. Real processes, real llama.cpp: the only
thing not run here is a GPU, so a CUDA load's log lines are fed to the parser as text."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from edgerun import llama_lib
from edgerun.device import gpu
from edgerun.device.detect import detect
from edgerun.device.profiles import load_profile
from edgerun.serve import systemd as service
from server_harness import ServerProcess, clean_env

FIXTURES = Path(__file__).parent / "fixtures" / "boards"
JETSONS = ["jetson-orin-nano-8gb", "jetson-orin-nx-16gb", "jetson-agx-orin-64gb"]
ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(bool(llama_lib.gpu_devices()),
                                reason="these tests describe a llama.cpp build without a GPU device")


def _edgerun(*args, home: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgerun", *map(str, args)], capture_output=True, text=True,
                          timeout=120, env=clean_env(home, **env))


# -- the build and the load ------------------------------------------------------------------------

def test_this_build_has_no_gpu_but_llama_cpp_says_it_can_offload_when_rpc_is_built_in():
    names = {n for n, _ in llama_lib.backends()}
    assert "CPU" in names and not llama_lib.gpu_devices()
    assert {t for _, _, t in llama_lib.devices()} <= {"cpu", "accel"}
    # llama_supports_gpu_offload() counts RPC workers as offload targets: it cannot tell the GPU is missing
    assert llama_lib.supports_gpu_offload() == ("RPC" in names)


def test_a_model_asked_onto_the_gpu_lands_on_the_cpu_and_the_placement_says_so(tiny_qwen2):
    m = llama_lib.Model.load(tiny_qwen2, n_gpu_layers=-1)
    try:
        assert m.placement.device == "CPU" and m.placement.gpu_layers == 0
        assert m.placement.n_layers == 3                      # 2 blocks + the output layer, as llama.cpp counts
        assert m.placement.buffers and all(name.startswith("CPU") for name, _ in m.placement.buffers)
    finally:
        m.close()


# a CUDA load's lines, in the format strings of llama.cpp's loader (src/llama.cpp, src/llama-model.cpp)
CUDA_LOG = (
    "llama_model_load_from_file_impl: using device CUDA0 (Orin) (0000:00:00.0) - 6120 MiB free\n"
    "load_tensors: offloading output layer to GPU\n"
    "load_tensors: offloading 27 repeating layers to GPU\n"
    "load_tensors: offloaded 29/29 layers to GPU\n"
    "load_tensors:        CUDA0 model buffer size =   870.44 MiB\n"
    "load_tensors:   CPU_Mapped model buffer size =   140.15 MiB\n")


def test_placement_from_a_cuda_load_log():
    p = llama_lib.placement_from_log(CUDA_LOG, 28, gpus={"CUDA0"})
    assert (p.device, p.gpu_layers, p.n_layers) == ("CUDA0 (Orin)", 29, 29)
    assert dict(p.buffers) == {"CUDA0": 870.44, "CPU_Mapped": 140.15}


def test_the_offload_line_alone_is_not_believed():
    # llama.cpp prints "offloaded N/M layers to GPU" whenever it supports offload (an RPC build too), even
    # when no GPU device took part: then every layer is on the CPU
    log = CUDA_LOG.replace("using device CUDA0", "using device RPC0")
    p = llama_lib.placement_from_log(log, 28, gpus=set())
    assert p.gpu_layers == 0 and p.n_layers == 29 and p.device == "RPC0"
    assert llama_lib.placement_from_log("load_tensors: offloaded 29/29 layers to GPU\n", 28, gpus=set()).device == "CPU"


# -- detection on the boards' files ----------------------------------------------------------------

@pytest.mark.parametrize("board", JETSONS)
def test_a_detected_jetson_on_this_build_is_a_problem_with_the_profiles_cuda_build_as_fix(board):
    prof, _ = detect(FIXTURES / board, machine="aarch64")
    assert prof.name == board
    st = gpu.check(prof)
    assert st.expected == "cuda" and st.device == "CPU" and st.gpu_devices == ()
    assert "no GPU backend" in st.problem and "CPU" in st.problem
    assert 'CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=87 -DGGML_RPC=on"' in st.fix
    assert "llama-cpp-python==" in st.fix and "CUDACXX=/usr/local/cuda/bin/nvcc" in st.fix
    with pytest.raises(gpu.GpuRequired, match="--require-gpu"):
        gpu.enforce(st, True)


@pytest.mark.parametrize("board", ["rpi5-8gb", "rpi4-8gb"])
def test_a_cpu_board_is_no_problem_unless_a_gpu_is_required(board):
    prof, _ = detect(FIXTURES / board, machine="aarch64")
    assert gpu.check(prof).problem is None
    assert "asks for a GPU" in gpu.check(prof, require=True).problem


def test_apple_profiles_expect_metal_and_say_so():
    st = gpu.check(load_profile("apple-m2"))
    assert st.expected == "metal" and "Metal" in st.problem and "-DGGML_METAL=on" in st.fix


def test_gpu_layers_0_on_a_jetson_is_a_choice_not_a_problem():
    assert gpu.check(load_profile("jetson-orin-nano-8gb"), n_gpu_layers=0).problem is None


# -- the commands ------------------------------------------------------------------------------------

def test_generate_on_a_jetson_profile_warns_with_the_fix_and_still_answers(tiny_qwen2, tmp_path):
    r = _edgerun("generate", "Hi", "-m", tiny_qwen2, "--draft", "none", "--profile", "jetson-orin-nano-8gb",
                 "-n", "3", "--ctx", "256", home=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "WARNING" in r.stderr and "jetson-orin-nano-8gb expects the GPU (CUDA)" in r.stderr
    assert "-DCMAKE_CUDA_ARCHITECTURES=87" in r.stderr and "--require-gpu makes this an error" in r.stderr
    quiet = _edgerun("generate", "Hi", "-m", tiny_qwen2, "--draft", "none", "--profile", "generic-x86_64-cpu",
                     "-n", "3", "--ctx", "256", home=tmp_path)
    assert quiet.returncode == 0 and "GPU" not in quiet.stderr


@pytest.mark.parametrize("how", ["flag", "env"])
def test_require_gpu_is_an_error_before_anything_loads(tiny_qwen2, tmp_path, how):
    args = ["generate", "Hi", "-m", tmp_path / "not-there.gguf", "--profile", "jetson-orin-nano-8gb"]
    r = _edgerun(*args, *(["--require-gpu"] if how == "flag" else []), home=tmp_path,
                 **({"EDGERUN_REQUIRE_GPU": "1"} if how == "env" else {}))
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr
    assert "no GPU backend" in r.stderr and "--require-gpu" in r.stderr     # not "model not found": it failed first


def test_chat_require_gpu_exits_2(tiny_qwen2, tmp_path):
    r = subprocess.run([sys.executable, "-m", "edgerun", "chat", "-m", str(tiny_qwen2), "--draft", "none",
                        "--profile", "generic-x86_64-cpu", "--require-gpu"], input="hi\n", capture_output=True,
                       text=True, timeout=120, env=clean_env(tmp_path))
    assert r.returncode == 2 and r.stderr.startswith("error: --require-gpu asks for a GPU")


def test_profile_show_with_a_model_counts_the_layers_on_the_gpu(tiny_qwen2, tmp_path):
    r = _edgerun("profile", "show", "jetson-orin-nano-8gb", "-m", tiny_qwen2, home=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "device      CPU; 0/3 layers on a GPU; the profile expects cuda" in r.stdout
    assert "PROBLEM     the device profile jetson-orin-nano-8gb expects the GPU" in r.stdout
    j = json.loads(_edgerun("profile", "show", "jetson-orin-nano-8gb", "--json", home=tmp_path).stdout)
    assert j["gpu"]["device"] == "CPU" and j["gpu"]["expected"] == "cuda" and j["gpu"]["problem"]


def test_profile_detect_shows_the_backend_device(tiny_qwen2, tmp_path):
    r = _edgerun("profile", "detect", "--json", "-m", tiny_qwen2, home=tmp_path)
    assert r.returncode == 0, r.stderr
    g = json.loads(r.stdout)["gpu"]
    assert (g["device"], g["gpu_layers"], g["n_layers"], g["gpu_devices"]) == ("CPU", 0, 3, [])
    assert "CPU" in g["backends"]
    text = _edgerun("profile", "detect", home=tmp_path).stdout
    assert "  backend     llama.cpp " in text and "GPU devices: none" in text


# -- the server ----------------------------------------------------------------------------------------

def test_health_and_metrics_show_where_the_layers_run(tiny_qwen2, tmp_path):
    srv = ServerProcess([*("-m", tiny_qwen2, "--draft", "none", "--profile", "jetson-orin-nano-8gb", "--threads", "1",
                           "--ctx", "256")], env=clean_env(tmp_path))
    try:
        srv.wait_ready()
        srv.wait_for_line(r"GPU \(CUDA\), but the installed llama.cpp has no GPU backend", 10)
        h = httpx.get(srv.url + "/health", timeout=10)
        body = h.json()
        assert h.status_code == 200, body
        g = body["gpu"]
        assert (g["device"], g["gpu_layers"], g["n_layers"], g["expected"]) == ("CPU", 0, 3, "cuda")
        assert "no GPU backend" in g["problem"] and "DGGML_CUDA=on" in g["fix"]
        m = httpx.get(srv.url + "/metrics", timeout=10).text
        assert 'edgerun_backend_info{device="CPU",expected="cuda"} 1' in m
        assert "edgerun_gpu_layers 0" in m and "edgerun_model_layers 3" in m and "edgerun_gpu_problem 1" in m
    finally:
        assert srv.terminate() == 0


def test_serve_require_gpu_exits_2_before_binding(tiny_qwen2, tmp_path):
    r = _edgerun("serve", "-m", tiny_qwen2, "--draft", "none", "--profile", "jetson-orin-nano-8gb", "--port", "0",
                 home=tmp_path, EDGERUN_REQUIRE_GPU="1")
    assert r.returncode == 2 and "error: the device profile jetson-orin-nano-8gb expects the GPU" in r.stderr
    assert "listening on" not in r.stderr + r.stdout


# -- the systemd unit ------------------------------------------------------------------------------------

@pytest.mark.parametrize("board", JETSONS)
def test_the_jetson_unit_joins_the_gpu_groups_and_allows_its_device_nodes(board):
    unit = service.render_unit("/opt/edgerun/venv/bin/edgerun serve", profile=load_profile(board))
    lines = unit.splitlines()
    assert "SupplementaryGroups=video render" in lines and "DynamicUser=yes" in lines
    for node in ("/dev/nvmap", "/dev/nvhost-ctrl-gpu", "/dev/nvhost-as-gpu", "/dev/nvgpu/igpu0/ctrl",
                 "/dev/nvgpu/igpu0/as", "/dev/host1x-fence", "/dev/dri/renderD128"):
        assert f"DeviceAllow={node} rw" in lines
    # nothing may hide or close the nodes: no PrivateDevices=, no DevicePolicy=strict
    assert not any(l.startswith(("PrivateDevices=", "DevicePolicy=")) for l in lines)
    # ProtectClock= implies DeviceAllow=char-rtc r, which closes the device cgroup: the nodes must be listed
    assert "ProtectClock=yes" in lines


@pytest.mark.parametrize("name", ["rpi5-8gb", "generic-x86_64-cpu", "apple-m2"])
def test_other_units_are_unchanged(name):
    assert service.render_unit("/opt/edgerun/venv/bin/edgerun serve", profile=load_profile(name)) == \
        service.installed_unit_text()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (Debian package 'systemd'; deploy/ci-deps.sh installs it)")
def test_the_jetson_unit_passes_systemd_analyze_verify(tmp_path):
    from test_deploy import _verify

    unit = tmp_path / "edgerun.service"
    unit.write_text(service.render_unit(profile=load_profile("jetson-orin-nano-8gb")))
    assert _verify(unit) == []
    (tmp_path / "bad").mkdir()
    bad = tmp_path / "bad" / "edgerun.service"
    bad.write_text(unit.read_text().replace("DeviceAllow=/dev/nvmap rw", "DeviceAllow=/dev/nvmap rwx"))
    assert _verify(bad) != []                                 # the check can fail: a bad access mode


def test_service_print_renders_the_jetson_unit(tmp_path):
    r = _edgerun("service", "print", "--profile", "jetson-agx-orin-64gb", home=tmp_path)
    assert r.returncode == 0 and "SupplementaryGroups=video render" in r.stdout
    assert "DeviceAllow=/dev/nvmap rw" in r.stdout and "# GPU (jetson-agx-orin-64gb)" in r.stdout


def test_install_dry_run_on_a_jetson_writes_the_gpu_unit(tmp_path):
    cmd = ["bash", str(ROOT / "deploy" / "install.sh"), "--dry-run", "--python", sys.executable,
           "--prefix", str(tmp_path / "opt"), "--etc-dir", str(tmp_path / "etc"), "--unit-dir",
           str(tmp_path / "units"), "--profile", "jetson-orin-nano-8gb"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ})
    assert r.returncode == 0, r.stderr
    assert "    | SupplementaryGroups=video render" in r.stdout.splitlines()
    assert "    | DeviceAllow=/dev/nvgpu/igpu0/ctrl rw" in r.stdout.splitlines()
    assert "10-gpu.conf" not in r.stdout or "rm -f" in r.stdout
