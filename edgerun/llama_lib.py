"""The one place that touches llama-cpp-python's low-level C API: init, logging, model lifetime.

llama.cpp's loader is strict about some things and silent (or process-aborting) about others,
so a GGUF is checked here first: magic, readable header, tensor data inside the file.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from pathlib import Path

from .errors import BackendError, ModelFormatError
from .formats.ggufscan import read_info

log = logging.getLogger("edgerun.llama")

_lock = threading.Lock()
_lib = None
_log_cb = None  # keep the ctypes callback alive
_amx_warned = False
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


class Model:
    """An owned llama_model pointer (freed on close/garbage collection)."""

    def __init__(self, ptr, path: Path) -> None:
        self.ptr = ptr
        self.path = path

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
        ptr = L.llama_model_load_from_file(os.fsencode(p), params)
        if not ptr:
            raise ModelFormatError(
                f"llama.cpp could not load {p} (unsupported architecture or damaged file; "
                f"run with --verbose for llama.cpp's log)")
        return cls(ptr, p)

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
