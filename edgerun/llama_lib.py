"""The one place that touches llama-cpp-python's low-level C API: init, logging, model lifetime.

llama.cpp's loader is strict about some things and silent (or process-aborting) about others,
so a GGUF is checked here first: magic, readable header, tensor data inside the file.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from .errors import BackendError, ModelFormatError
from .formats.ggufscan import read_info

log = logging.getLogger("edgerun.llama")

_lock = threading.Lock()
_lib = None
_log_cb = None  # keep the ctypes callback alive
_amx_warned = False
_capture = threading.local()   # Model.load collects llama.cpp's log lines of its own load here
AMX_ENV = "EDGERUN_LLAMA_AMX"    # "1": let an AMX build of llama.cpp use its AMX kernels


def lib():
    """Import llama_cpp once, initialise its backend and route its log into `logging` (debug)."""
    global _lib, _log_cb
    if _lib is None:
        with _lock:
            if _lib is None:
                try:    # lazily: loading libllama costs ~0.5 s (measured here), and a missing build gets this message
                    import llama_cpp
                except ImportError as e:  # pragma: no cover - depends on the install
                    raise BackendError(
                        "llama-cpp-python is not installed or failed to import "
                        f"({e}); install it with `pip install llama-cpp-python` (see README)") from e

                @llama_cpp.llama_log_callback
                def _cb(level, text, user_data):
                    lines = getattr(_capture, "lines", None)
                    if lines is not None:
                        lines.append(text.decode("utf-8", "replace"))
                    if log.isEnabledFor(logging.DEBUG):
                        log.debug(text.decode("utf-8", "replace").rstrip())

                _log_cb = _cb
                llama_cpp.llama_log_set(_log_cb, ctypes.c_void_p(0))
                llama_cpp.llama_backend_init()
                _lib = llama_cpp
    return _lib


def check_gguf(path: str | Path) -> Path:
    """Raise a clear error unless `path` is a complete GGUF file (magic, header, tensor data in bounds)."""
    return read_info(path).path


@functools.cache
def amx_in_build() -> bool:
    """Whether this llama.cpp build has Intel AMX matmul kernels (its system info says AMX_INT8 = 1)."""
    return "AMX_INT8 = 1" in lib().llama_print_system_info().decode("utf-8", "replace")


def use_extra_buffers() -> bool:
    """Whether models load with llama.cpp's extra CPU buffer types (AMX, weight repacking).

    llama.cpp built with -march=native on a CPU with AMX (Sapphire Rapids and newer Xeons) puts
    Q4_0/Q4_1/Q8_0 weights into AMX buffers, and its AMX matmul segfaults on some virtual machines
    (seen on a 2-core Firecracker VM: the whole process dies in ggml_backend_amx_mul_mat). edgerun
    cannot catch a segfault, so for such a build it loads weights without the extra buffer types
    (plain AVX-512 kernels; correct everywhere, slower) unless EDGERUN_LLAMA_AMX=1. A build made
    without AMX (README: "Intel AMX") keeps weight repacking and is unaffected.
    """
    global _amx_warned
    if not amx_in_build() or os.environ.get(AMX_ENV) == "1":
        return True
    if not _amx_warned:
        _amx_warned = True
        log.warning("this llama.cpp build uses Intel AMX kernels, which crash on some virtual machines: "
                    "loading weights without AMX and repacking (slower). Rebuild llama-cpp-python without "
                    "AMX for full speed (README, 'Intel AMX'), or set %s=1 where AMX works.", AMX_ENV)
    return False


# ggml_backend_dev_type's values (ggml-backend.h)
_DEV_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}


@functools.cache
def _ggml():
    """libggml (the library llama.cpp's backends register in), with the device-listing calls declared."""
    lib()
    from llama_cpp import _ggml as g

    L = g.libggml
    vp, sz, cp = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
    for name, args, res in (("ggml_backend_reg_count", [], sz), ("ggml_backend_reg_get", [sz], vp),
                            ("ggml_backend_reg_name", [vp], cp), ("ggml_backend_reg_dev_count", [vp], sz),
                            ("ggml_backend_dev_count", [], sz), ("ggml_backend_dev_get", [sz], vp),
                            ("ggml_backend_dev_name", [vp], cp), ("ggml_backend_dev_description", [vp], cp),
                            ("ggml_backend_dev_type", [vp], ctypes.c_int)):
        fn = getattr(L, name)
        fn.argtypes, fn.restype = args, res
    return L


@functools.cache
def backends() -> tuple[tuple[str, int], ...]:
    """The backends compiled into this llama.cpp build and how many devices each found: (("CPU", 1),
    ("RPC", 0)) on a CPU build; ("CUDA", 0) means CUDA is built in but saw no GPU (driver, permissions)."""
    g = _ggml()
    out = []
    for i in range(g.ggml_backend_reg_count()):
        reg = g.ggml_backend_reg_get(i)
        out.append((g.ggml_backend_reg_name(reg).decode(), int(g.ggml_backend_reg_dev_count(reg))))
    return tuple(out)


@functools.cache
def devices() -> tuple[tuple[str, str, str], ...]:
    """Every device this build registered: (name, description, type), type one of cpu|gpu|igpu|accel|meta."""
    g = _ggml()
    out = []
    for i in range(g.ggml_backend_dev_count()):
        d = g.ggml_backend_dev_get(i)
        out.append((g.ggml_backend_dev_name(d).decode(), (g.ggml_backend_dev_description(d) or b"").decode(),
                    _DEV_TYPES.get(g.ggml_backend_dev_type(d), "unknown")))
    return tuple(out)


def gpu_devices() -> tuple[tuple[str, str, str], ...]:
    """The GPU (and integrated GPU) devices llama.cpp can offload layers to here."""
    return tuple(d for d in devices() if d[2] in ("gpu", "igpu"))


def supports_gpu_offload() -> bool:
    """llama.cpp's own llama_supports_gpu_offload(). True on a build with RPC even without a GPU (it counts
    RPC workers as offload targets): gpu_devices() says whether a GPU is here."""
    return bool(lib().llama_supports_gpu_offload())


@dataclass(frozen=True)
class Placement:
    """Where a loaded model's layers went, as llama.cpp's load log says (it has no API for it).

    gpu_layers counts like llama.cpp's "offloaded N/M layers to GPU": of n_layers = the model's blocks + the
    output layer; it is 0 when no GPU device took part (that log line reports the request even then)."""

    device: str                          # "CUDA0 (Orin)", or "CPU" when no GPU holds a layer
    gpu_layers: int
    n_layers: int
    buffers: tuple[tuple[str, float], ...] = ()     # (buffer type, MiB) of the weights: ("CUDA0", 870.0), ...

    def to_dict(self) -> dict:
        return {"device": self.device, "gpu_layers": self.gpu_layers, "n_layers": self.n_layers,
                "buffers_mib": dict(self.buffers)}


_USING = re.compile(r"using device (\S+) \((.*?)\)")
_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
_BUFFER = re.compile(r"(\S+) model buffer size =\s*([\d.]+) MiB")


def placement_from_log(text: str, n_layers: int, gpus: set[str] | None = None) -> Placement:
    """A Placement from llama.cpp's load log (text) of a model with n_layers blocks; gpus: the names of the
    GPU devices (default: this build's, gpu_devices())."""
    if gpus is None:
        gpus = {name for name, _, _ in gpu_devices()}
    used_all = _USING.findall(text)
    used = [(n, d) for n, d in used_all if n in gpus]
    buffers = tuple((n, float(m)) for n, m in _BUFFER.findall(text))
    m = _OFFLOADED.search(text)
    total = int(m.group(2)) if m else n_layers + 1
    on_gpu = int(m.group(1)) if (m and used) else 0
    if on_gpu:
        device = ", ".join(f"{n} ({d})" for n, d in used)
    elif used_all:                       # RPC workers (a cluster): the layers are remote, none on a GPU here
        device = ", ".join(n for n, _ in used_all)
    else:
        device = "CPU"
    return Placement(device=device, gpu_layers=on_gpu, n_layers=total, buffers=buffers)


class Model:
    """An owned llama_model pointer (freed on close/garbage collection)."""

    def __init__(self, ptr, path: Path, placement: Placement | None = None) -> None:
        self.ptr = ptr
        self.path = path
        self.placement = placement

    @classmethod
    def load(cls, path: str | Path, *, vocab_only: bool = False, n_gpu_layers: int = 0,
             use_mmap: bool = True, use_mlock: bool = False, cluster=None) -> "Model":
        """cluster: an attached edgerun.cluster.head.Cluster: the layers spread over its RPC workers."""
        p = check_gguf(path)
        L = lib()
        params = L.llama_model_default_params()
        params.vocab_only = vocab_only
        params.n_gpu_layers = n_gpu_layers
        if cluster is not None:
            cluster.model_params(params)
        params.use_extra_bufts = use_extra_buffers()
        params.load_mode = {(True, False): L.LLAMA_LOAD_MODE_MMAP, (True, True): L.LLAMA_LOAD_MODE_MMAP_MLOCK,
                            (False, True): L.LLAMA_LOAD_MODE_MLOCK, (False, False): L.LLAMA_LOAD_MODE_NONE}[
            (bool(use_mmap), bool(use_mlock))]
        _capture.lines = []
        try:
            ptr = L.llama_model_load_from_file(os.fsencode(p), params)
            load_log = "".join(_capture.lines)
        finally:
            _capture.lines = None
        if not ptr:
            raise ModelFormatError(
                f"llama.cpp could not load {p} (unsupported architecture or damaged file; "
                f"run with --verbose for llama.cpp's log)")
        placement = None if vocab_only else placement_from_log(load_log, L.llama_model_n_layer(ptr))
        return cls(ptr, p, placement)

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(512)
        n = lib().llama_model_meta_val_str(self.ptr, key.encode(), buf, 512)
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def close(self) -> None:
        if self.ptr:
            lib().llama_model_free(self.ptr)
            self.ptr = None

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order varies
        try:
            self.close()
        except (AttributeError, TypeError):
            pass
