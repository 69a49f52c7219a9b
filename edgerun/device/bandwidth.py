"""Memory-bandwidth probe: STREAM-like copy (c = b) and triad (a = b + s*c), multi-threaded.

Arrays are much larger than the last-level cache, so the figures are DRAM bandwidth. The native C
kernel (kernels/stream.c, compiled on first use) is preferred; numpy is the fallback
and also the independent cross-check: a threaded numpy copy of the same size measured in the same
run. Bytes are counted as STREAM counts them: copy 2 x 8 B, triad 3 x 8 B per element (write-
allocate traffic is not counted). On CUDA / Metal devices the GPU variants measure device memory.
"""

from __future__ import annotations

import ctypes
import json
import logging
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import psutil

from ..errors import BackendError, InvalidArgument
from . import kernels
from .measurements import atomic_write_json, device_identity, key_of, probes_dir, read_json

log = logging.getLogger(__name__)

MiB = 1024 ** 2
GiB = 1024 ** 3
_CHUNK = 32 * 1024          # doubles per numpy triad chunk (256 KiB: stays in L2)


@dataclass(frozen=True)
class Bandwidth:
    copy_gbs: float                 # GB/s (1e9 B/s), bytes counted as STREAM does
    triad_gbs: float
    method: str                     # c | numpy | cuda | metal
    threads: int
    array_bytes: int                # bytes per array (3 arrays are allocated)
    reps: int
    check_copy_gbs: float | None = None   # independent numpy copy of the same size, same run (CPU only)

    @property
    def check_ratio(self) -> float | None:
        return self.copy_gbs / self.check_copy_gbs if self.check_copy_gbs else None

    @property
    def best_gbs(self) -> float:
        return max(self.copy_gbs, self.triad_gbs)

    def to_dict(self) -> dict:
        return {**asdict(self), "check_ratio": self.check_ratio}

    @classmethod
    def from_dict(cls, d: dict) -> "Bandwidth":
        return cls(**{k: d[k] for k in ("copy_gbs", "triad_gbs", "method", "threads", "array_bytes", "reps")},
                   check_copy_gbs=d.get("check_copy_gbs"))


def last_level_cache_bytes() -> int:
    """Largest CPU cache reported by sysfs (32 MiB if unknown)."""
    best = 0
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            txt = f.read_text().strip().upper()
        except OSError:
            continue
        mult = {"K": 1024, "M": MiB, "G": GiB}.get(txt[-1:], 1)
        digits = txt.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * mult)
    return best or 32 * MiB


def default_array_bytes() -> int:
    """At least 8x the last-level cache and 256 MiB, at most 1 GiB and 1/8 of available memory."""
    want = max(8 * last_level_cache_bytes(), 256 * MiB)
    cap = min(GiB, psutil.virtual_memory().available // 8)
    return int(max(min(want, cap), 16 * MiB))


def default_threads() -> int:
    return max(1, psutil.cpu_count(logical=False) or psutil.cpu_count() or 1)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------

def c_stream(n: int, threads: int, reps: int) -> tuple[float, float]:
    """(best copy seconds, best triad seconds) from the native kernel; BackendError if unavailable."""
    lib_path = kernels.build_stream_c()
    if lib_path is None:
        raise BackendError("the C bandwidth kernel is not available (no working C compiler)")
    lib = ctypes.CDLL(str(lib_path))
    fn = lib.edgerun_stream
    fn.argtypes = [ctypes.c_uint64, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_double)]
    fn.restype = ctypes.c_int
    out = (ctypes.c_double * 3)()
    rc = fn(n, threads, reps, out)
    if rc != 0:
        raise BackendError(f"the C bandwidth kernel failed (code {rc}: 1 = out of memory, 2 = threads, 3 = arguments)"
                           f" for {n} doubles x 3 arrays on {threads} threads")
    expect = 8.0 * len(range(0, n, 4093))      # c = b = 2, then a = b + 3c = 8 at every sampled index
    if abs(out[2] - expect) > 1e-6 * expect:
        raise BackendError(f"the C bandwidth kernel computed a wrong checksum {out[2]} (expected {expect})")
    return float(out[0]), float(out[1])


def _slices(n: int, threads: int) -> list[slice]:
    return [slice(n * t // threads, n * (t + 1) // threads) for t in range(threads)]


def numpy_stream(n: int, threads: int, reps: int) -> tuple[float, float]:
    """(best copy seconds, best triad seconds) with numpy; threads work on disjoint slices
    (numpy releases the GIL inside copies and ufunc loops). Triad runs in cache-sized chunks so
    its temporary never goes to DRAM: main-memory traffic is the 3 x 8 B STREAM counts."""
    a, b, c = np.empty(n), np.empty(n), np.empty(n)
    parts = _slices(n, threads)

    def init(sl: slice) -> None:
        a[sl] = 1.0
        b[sl] = 2.0
        c[sl] = 0.5

    def copy(sl: slice) -> None:
        np.copyto(c[sl], b[sl])

    def triad(sl: slice) -> None:
        tmp = np.empty(_CHUNK)
        for lo in range(sl.start, sl.stop, _CHUNK):
            hi = min(lo + _CHUNK, sl.stop)
            t = tmp[: hi - lo]
            np.multiply(c[lo:hi], 3.0, out=t)
            np.add(b[lo:hi], t, out=a[lo:hi])

    best_copy = best_triad = float("inf")
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(init, parts))
        for _ in range(reps):
            t0 = time.perf_counter()
            list(ex.map(copy, parts))
            t1 = time.perf_counter()
            list(ex.map(triad, parts))
            t2 = time.perf_counter()
            best_copy, best_triad = min(best_copy, t1 - t0), min(best_triad, t2 - t1)
    if not np.allclose(a[:: max(1, n // 1000)], 8.0):
        raise BackendError("the numpy bandwidth kernel computed wrong values")
    return best_copy, best_triad


def numpy_copy_gbs(array_bytes: int, threads: int, reps: int = 5) -> float:
    """Independent check: threaded numpy copy of array_bytes, counted as read + write."""
    n = array_bytes // 8
    a = np.full(n, 1.0)
    c = np.full(n, 0.0)     # touched now: np.zeros' lazily mapped pages would slow the first copies
    parts = _slices(n, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as ex:
        for _ in range(reps):
            t0 = time.perf_counter()
            list(ex.map(lambda sl: np.copyto(c[sl], a[sl]), parts))
            best = min(best, time.perf_counter() - t0)
    return 2 * n * 8 / best / 1e9


def _gpu_stream(kind: str, array_bytes: int, reps: int) -> Bandwidth:
    exe = kernels.build_stream_cuda() if kind == "cuda" else kernels.build_stream_metal()
    if exe is None:
        raise BackendError(f"the {kind} bandwidth program could not be built")
    elem = 8 if kind == "cuda" else 4
    n = array_bytes // elem
    try:
        res = subprocess.run([str(exe), str(n), str(reps)], capture_output=True, text=True, timeout=300, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        raise BackendError(f"the {kind} bandwidth program failed to run: {e}") from e
    if res.returncode != 0:
        raise BackendError(f"the {kind} bandwidth program failed: {res.stderr.strip()[-500:]}")
    d = json.loads(res.stdout.strip().splitlines()[-1])
    e = d.get("elem_bytes", elem)
    return Bandwidth(copy_gbs=2 * n * e / d["copy_s"] / 1e9, triad_gbs=3 * n * e / d["triad_s"] / 1e9,
                     method=kind, threads=0, array_bytes=n * e, reps=reps)


# ----------------------------------------------------------------------------------------------
# The probe
# ----------------------------------------------------------------------------------------------

def probe_bandwidth(*, array_bytes: int | None = None, threads: int | None = None, reps: int = 5,
                    rounds: int = 3, method: str = "auto", check: bool = True) -> Bandwidth:
    """Measure memory bandwidth now (not cached). method: auto (C, else numpy) | c | numpy | cuda | metal.

    The kernel and the numpy cross-check alternate for `rounds` rounds of `reps` repetitions and
    each keeps its best, so both see the same machine load (the development machine is shared).
    """
    if method not in ("auto", "c", "numpy", "cuda", "metal"):
        raise InvalidArgument(f"bandwidth method must be auto, c, numpy, cuda or metal, got {method!r}")
    if reps < 1 or rounds < 1:
        raise InvalidArgument(f"reps and rounds must be >= 1, got {reps}, {rounds}")
    array_bytes = array_bytes or default_array_bytes()
    if array_bytes < 8 * 1024:
        raise InvalidArgument(f"array_bytes must be at least 8 KiB, got {array_bytes}")
    if method in ("cuda", "metal"):
        return _gpu_stream(method, array_bytes, reps)
    threads = threads or default_threads()
    n = array_bytes // 8
    used = "numpy" if method == "numpy" else "c"
    if used == "c" and kernels.build_stream_c() is None:
        if method == "c":
            raise BackendError("the C bandwidth kernel is not available (no working C compiler)")
        log.info("C bandwidth kernel unavailable; measuring with numpy")
        used = "numpy"
    kernel = c_stream if used == "c" else numpy_stream
    t_copy = t_triad = float("inf")
    chk = 0.0
    for _ in range(rounds):
        tc, tt = kernel(n, threads, reps)
        t_copy, t_triad = min(t_copy, tc), min(t_triad, tt)
        if check:
            chk = max(chk, numpy_copy_gbs(n * 8, threads, reps))
    bw = Bandwidth(copy_gbs=2 * n * 8 / t_copy / 1e9, triad_gbs=3 * n * 8 / t_triad / 1e9, method=used,
                   threads=threads, array_bytes=n * 8, reps=reps * rounds, check_copy_gbs=chk if check else None)
    log.info("bandwidth (%s, %d threads, %d MiB arrays): copy %.1f GB/s, triad %.1f GB/s", used, threads,
             n * 8 // MiB, bw.copy_gbs, bw.triad_gbs)
    return bw


def _cache_path(compute: str) -> Path:
    return probes_dir() / f"bandwidth-{key_of(device_identity(), compute)}.json"


def cached_bandwidth(compute: str = "cpu") -> Bandwidth | None:
    d = read_json(_cache_path(compute))
    try:
        return Bandwidth.from_dict(d) if d else None
    except (KeyError, TypeError) as e:
        log.warning("ignoring a malformed bandwidth cache entry: %s", e)
        return None


def measure_and_cache(compute: str = "cpu", **kw) -> Bandwidth:
    """Measure (GPU variant first where the device has one, CPU otherwise) and store for reuse."""
    bw = None
    if compute in ("cuda", "metal"):
        try:
            bw = probe_bandwidth(method=compute, **{k: v for k, v in kw.items() if k in ("array_bytes", "reps")})
        except BackendError as e:
            log.warning("%s bandwidth probe failed (%s); measuring the CPU side instead", compute, e)
    if bw is None:
        bw = probe_bandwidth(**kw)
    atomic_write_json(_cache_path(compute), {**bw.to_dict(), "device": device_identity()})
    return bw
