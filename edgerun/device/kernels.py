"""Native probe kernels: compiled at run time with the system compiler, cached by source hash.

The sources are the top-level kernels/ folder (shipped inside the wheel) so any install can build them. A
missing compiler is not an error: callers fall back to numpy (see bandwidth.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

from ..util.atomic import atomic_path
from ..util.resources import data_dir
from ..util.home import cache_dir

log = logging.getLogger(__name__)


def source(name: str) -> Path:
    return data_dir("kernels") / name


def kernels_dir() -> Path:
    return cache_dir() / "kernels"


def find_compiler(kind: str = "c") -> str | None:
    """The C compiler ($CC, cc, gcc, clang) or, for kind 'cuda', nvcc; None if there is none."""
    if kind == "cuda":
        cands = [os.environ.get("NVCC"), "nvcc", "/usr/local/cuda/bin/nvcc"]
    elif kind == "objc":
        cands = ["clang"]
    else:
        cands = [os.environ.get("CC"), "cc", "gcc", "clang"]
    for c in cands:
        if c and (found := shutil.which(c)):
            return found
    return None


def _build(src: Path, out_name: str, compiler: str, flags: list[str]) -> Path | None:
    """Compile src into kernels_dir()/<hash>/out_name once; None (logged) if the compiler fails."""
    digest = hashlib.sha256(src.read_bytes() + "\0".join([compiler, *flags]).encode()).hexdigest()[:16]
    out = kernels_dir() / digest / out_name
    if out.is_file():
        return out
    try:
        with atomic_path(out, suffix=".tmp", mode=0o755) as tmp:
            cmd = [compiler, *flags, str(src), "-o", str(tmp)]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
            if res.returncode != 0:
                raise _CompileFailed(f"({' '.join(cmd)}): {res.stderr.strip()[-2000:]}")
    except (OSError, subprocess.SubprocessError, _CompileFailed) as e:
        log.warning("compiling %s failed %s", src.name, e)
        return None
    log.info("built %s -> %s", src.name, out)
    return out


class _CompileFailed(Exception):
    """The compiler exited non-zero (caught in _build: a probe falls back to numpy)."""


def build_stream_c() -> Path | None:
    """libstream shared library (copy + triad, pthreads) or None when no C compiler works."""
    cc = find_compiler("c")
    if cc is None:
        log.info("no C compiler found: the bandwidth probe uses numpy")
        return None
    return _build(source("stream.c"), "libstream.so", cc, ["-O3", "-shared", "-fPIC", "-pthread"])


def build_stream_cuda(arch: str = "native") -> Path | None:
    """The CUDA device-memory bandwidth program (Jetson), or None when nvcc is missing or fails."""
    nvcc = find_compiler("cuda")
    if nvcc is None:
        return None
    return _build(source("stream_cuda.cu"), "stream_cuda", nvcc, ["-O3", f"-arch={arch}"])


def build_stream_metal() -> Path | None:
    """The Metal bandwidth program (Apple), or None when clang/Metal is missing or fails."""
    clang = find_compiler("objc")
    if clang is None:
        return None
    return _build(source("stream_metal.m"), "stream_metal", clang,
                  ["-O2", "-fobjc-arc", "-framework", "Foundation", "-framework", "Metal"])
