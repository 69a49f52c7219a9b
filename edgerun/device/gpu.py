"""Never silently on the CPU: whether a profile that expects a GPU got one, and where the layers went.

A Jetson or Apple profile asks llama.cpp to put every layer on the GPU (n_gpu_layers -1). Whether that
happens depends on the installed build (a wheel from PyPI or a rebuild after an upgrade may have no CUDA)
and on the device being reachable (the driver, the device nodes, the service's groups). llama.cpp says
nothing above its debug log when no GPU takes the layers: the model then runs on the CPU, several times
slower. `check()` says which case this is and what fixes it; `edgerun chat/generate/serve` warn with it
at start, `--require-gpu` makes it an error, /health, /metrics and `edgerun profile detect` show it.
"""

from __future__ import annotations

import logging
import shlex
import sys
from dataclasses import dataclass

from ..errors import BackendError, EdgerunError
from .profiles import DeviceProfile

log = logging.getLogger(__name__)

REQUIRE_GPU_ENV = "EDGERUN_REQUIRE_GPU"
_BACKEND = {"cuda": "CUDA", "metal": "Metal"}


class GpuRequired(EdgerunError):
    """--require-gpu (EDGERUN_REQUIRE_GPU=1) was given and the model's layers are not on a GPU."""


@dataclass(frozen=True)
class GpuStatus:
    """What edgerun knows about the GPU for one loaded target (or, before a load, for the build)."""

    profile: str
    expected: str | None                 # "cuda" | "metal" when the profile puts layers on a GPU, else None
    backends: tuple[tuple[str, int], ...]   # llama.cpp's compiled-in backends and their device counts
    gpu_devices: tuple[str, ...]         # "CUDA0 (Orin)": the GPUs this build sees
    supports_gpu_offload: bool           # llama.cpp's llama_supports_gpu_offload() (true with RPC alone)
    device: str                          # where the target's layers run ("CPU", "CUDA0 (Orin)", "unknown")
    gpu_layers: int | None               # layers on a GPU (None: not loaded yet / not llama.cpp)
    n_layers: int | None                 # the model's blocks + its output layer, as llama.cpp counts
    problem: str | None = None           # why the GPU is not used, when it should be
    fix: str | None = None               # what to do about it

    @property
    def on_gpu(self) -> bool:
        return bool(self.gpu_layers) and self.gpu_layers == self.n_layers

    def to_dict(self) -> dict:
        return {"device": self.device, "gpu_layers": self.gpu_layers, "n_layers": self.n_layers,
                "expected": self.expected, "gpu_devices": list(self.gpu_devices),
                "backends": {name: n for name, n in self.backends},
                "supports_gpu_offload": self.supports_gpu_offload, "problem": self.problem, "fix": self.fix}

    def message(self) -> str:
        return f"{self.problem}. Fix: {self.fix}" if self.fix else str(self.problem)


def rebuild_command(profile: DeviceProfile, llama_version: str | None = None) -> str:
    """The command that installs llama-cpp-python with the profile's GPU backend (deploy/install.sh runs
    the same) into the Python running edgerun (`python -m pip`, not whichever `pip` is on PATH: a service's
    venv is not the login shell's), leaving its dependencies as they are (--no-deps: a forced reinstall
    would otherwise replace numpy too)."""
    if llama_version is None:
        try:
            import llama_cpp

            llama_version = llama_cpp.__version__
        except ImportError:          # pragma: no cover - the caller found llama.cpp already
            llama_version = "0.3.36"
    args = f"{profile.build.cmake_args} -DGGML_RPC=on".strip()
    env = "".join(f"{k}={v} " for k, v in profile.build.env.items())
    return (f'{env}CMAKE_ARGS="{args}" {shlex.quote(sys.executable)} -m pip install --force-reinstall --no-deps '
            f'--no-cache-dir --no-binary llama-cpp-python llama-cpp-python=={llama_version}')


def expected_compute(profile: DeviceProfile, n_gpu_layers: int | None = None) -> str | None:
    """'cuda'/'metal' when this profile (with the n_gpu_layers in force) puts layers on a GPU."""
    n = profile.llama.n_gpu_layers if n_gpu_layers is None else n_gpu_layers
    if profile.priors.compute in _BACKEND and n != 0:
        return profile.priors.compute
    return None


def check(profile: DeviceProfile, target=None, *, n_gpu_layers: int | None = None,
          require: bool = False) -> GpuStatus:
    """The GPU status of the build (target None) or of a loaded target. With require=True there must be a GPU
    and (for a target) every layer on it, whatever the profile; else a problem is one only when the
    profile expects a GPU."""
    from .. import llama_lib

    want = expected_compute(profile, n_gpu_layers)
    try:
        backends = llama_lib.backends()
        gpus = tuple(f"{n} ({d})" for n, d, _ in llama_lib.gpu_devices())
        offload = llama_lib.supports_gpu_offload()
    except BackendError:                 # no llama.cpp here (an ONNX-only install)
        backends, gpus, offload = (), (), False
    placement = getattr(target, "placement", None)
    if target is None:
        device, gpu_layers, n_layers = (gpus[0] if gpus else "CPU"), None, None
    elif placement is None:
        device, gpu_layers, n_layers = "unknown (not a llama.cpp model)", None, None
    else:
        device, gpu_layers, n_layers = placement.device, placement.gpu_layers, placement.n_layers
    status = GpuStatus(profile=profile.name, expected=want, backends=backends, gpu_devices=gpus,
                       supports_gpu_offload=offload, device=device,
                       gpu_layers=gpu_layers, n_layers=n_layers)
    if not (want or require):
        return status
    kind = _BACKEND.get(want or profile.priors.compute, "a GPU")
    who = (f"the device profile {profile.name} expects the GPU ({kind})" if want
           else "--require-gpu asks for a GPU")
    built = {name: n for name, n in backends if name.upper() in ("CUDA", "MTL", "METAL", "VULKAN", "HIP", "ROCM",
                                                                    "SYCL", "MUSA", "OPENCL", "CANN")}
    problem = fix = None
    if not gpus and not built:
        problem = (f"{who}, but the installed llama.cpp has no GPU backend (built in: "
                   f"{', '.join(n for n, _ in backends) or 'none'}): the model runs on the CPU, several times slower")
        fix = (f"rebuild llama-cpp-python with {kind}: {rebuild_command(profile)}" if want
               else "install a llama-cpp-python built with a GPU backend (docs/devices.md)")
    elif not gpus:
        problem = (f"{who}; the installed llama.cpp has {', '.join(built)} built in but it found no GPU device: "
                   f"the model runs on the CPU")
        fix = ("check the driver (tegrastats / nvidia-smi), the device nodes (ls -l /dev/nvmap /dev/nvhost-* "
               "/dev/nvgpu/igpu0) and that this user is in their groups (video, render); the systemd unit from "
               "`edgerun service print --profile PROFILE` grants them")
    elif target is not None and placement is None and require:    # ONNX: onnxruntime's providers decide
        problem = f"{who}, but the target is not a llama.cpp model: its placement is not checked"
        fix = "serve a .gguf model to run it on the GPU through llama.cpp"
    elif target is not None and placement is not None and gpu_layers == 0:
        problem = f"{who}, but none of the model's {n_layers} layers is on it"
        fix = "--gpu-layers -1 puts every layer on the GPU"
    elif target is not None and placement is not None and gpu_layers < n_layers:
        problem = f"{who}, but only {gpu_layers} of the model's {n_layers} layers are on it: the rest run on the CPU"
        fix = "--gpu-layers -1 puts them all there (a smaller model or context if they do not fit)"
    return GpuStatus(**{**status.__dict__, "problem": problem, "fix": fix})


def enforce(status: GpuStatus, require: bool) -> None:
    """Raise GpuRequired for a problem under --require-gpu; else warn about it (a logged WARNING: the CLI
    prints it on stderr, the service's journal keeps it)."""
    if status.problem is None:
        return
    if require:
        raise GpuRequired(f"{status.message()} (--require-gpu / {REQUIRE_GPU_ENV})")
    log.warning("%s. Fix: %s. (--require-gpu makes this an error.)", status.problem, status.fix)


def status_for(profile: DeviceProfile, model_path=None) -> GpuStatus:
    """check() for `edgerun profile show/detect`: of this llama.cpp build, or of the model file at model_path
    (the CLI resolves a name, downloading nothing) loaded without a context (weights only, mmapped) to see
    where its layers land."""
    if model_path is None:
        return check(profile)
    from .. import llama_lib

    m = llama_lib.Model.load(model_path, n_gpu_layers=profile.llama.n_gpu_layers)
    try:
        return check(profile, m)
    finally:
        m.close()


def status_lines(st: GpuStatus) -> list[str]:
    """The lines `edgerun profile show/detect` print about the GPU."""
    layers = (f"{st.gpu_layers}/{st.n_layers} layers on a GPU" if st.gpu_layers is not None
              else "layers: --model counts them")
    lines = [f"backend     llama.cpp {', '.join(f'{n}:{k}' for n, k in st.backends) or 'not installed'} "
             f"(backend:devices); GPU devices: {', '.join(st.gpu_devices) or 'none'}",
             f"device      {st.device}; {layers}; the profile expects {st.expected or 'no GPU'}"]
    if st.problem:
        lines += [f"PROBLEM     {st.problem}", f"fix         {st.fix}"]
    return lines
