"""Transparent huge pages for a backend's weights: collapse the memory a model load added into 2 MiB pages.

Every decode step streams all weights once. On 4 KiB pages that is a TLB miss per 4 KiB read (and, in a
virtual machine, a nested page walk each); on 2 MiB pages one per 2 MiB. Linux >= 6.1 can turn resident
memory into huge pages on request, whatever the THP sysfs mode says short of `never`
(`madvise(MADV_COLLAPSE)`), so a backend snapshots the process's anonymous mappings before it loads a
model and collapses what the load added afterwards: the weights (llama.cpp's repacked CPU buffers,
onnxruntime's prepacked blocks), the KV cache and the compute buffers. Only spans that are (almost) all
resident are collapsed, so no RSS is added. Measured per backend in docs/onnx.md and docs/decode.md.

Best effort: another OS, a kernel without MADV_COLLAPSE, THP `never` or no free huge pages only log.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

MADV_COLLAPSE = 25          # <linux/mman.h>, Linux >= 6.1: make huge pages now, whatever the THP sysfs mode
RESIDENT_MIN = 0.9          # a huge page's span is collapsed only if at least this share of it is resident


def parse_anon_ranges(maps: str) -> dict[int, tuple[int, bool]]:
    """start -> (end, is the brk heap) of the private writable anonymous mappings in /proc/<pid>/maps text."""
    out = {}
    for line in maps.splitlines():
        f = line.split()
        if len(f) >= 5 and f[1].startswith("rw") and f[1].endswith("p") and (len(f) == 5 or f[5] == "[heap]"):
            start, end = (int(x, 16) for x in f[0].split("-"))
            out[start] = (end, len(f) > 5)
    return out


def anon_ranges() -> dict[int, tuple[int, bool]]:
    """This process's private anonymous mappings now ({} where /proc/self/maps is not there)."""
    if not sys.platform.startswith("linux"):
        return {}
    try:
        return parse_anon_ranges(Path("/proc/self/maps").read_text())
    except OSError:
        return {}


def new_ranges(before: dict[int, tuple[int, bool]], after: dict[int, tuple[int, bool]],
               page: int) -> list[tuple[int, int]]:
    """Page-aligned [start, end) spans, each at least one `page` long, where memory allocated between
    `before` and `after` may lie: mappings `before` lacked (or their new tail, when grown in place) and
    the whole brk heap -- malloc hands out memory freed there earlier (a closed session's) again."""
    spans = []
    for start, (end, heap) in sorted(after.items()):
        lo = start if heap else max(start, before.get(start, (start, False))[0])
        lo, hi = -(-lo // page) * page, end // page * page         # inwards to whole pages
        if hi - lo >= page:
            spans.append((lo, hi))
    return spans


def collapse_new_memory(before: dict[int, tuple[int, bool]], what: str, kind: str = "weight memory") -> int:
    """Back the anonymous memory mapped since `before` (anon_ranges()) with transparent huge pages, where it
    is (almost) all resident -- the weights, not thread stacks or free heap -- and return the bytes
    collapsed. `what` names the model in the log line, `kind` the memory."""
    if not before:
        return 0
    try:
        page = int(Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size").read_text())
        small = os.sysconf("SC_PAGE_SIZE")
        libc = ctypes.CDLL(None, use_errno=True)
        madvise, mincore = libc.madvise, libc.mincore
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, ValueError, AttributeError) as e:
        log.debug("no transparent huge pages for %s: %s", what, e)
        return 0
    t0 = time.perf_counter()
    done, err = 0, 0
    resident = np.zeros(page // small, dtype=np.uint8)             # mincore's answer for one huge page
    for lo, hi in new_ranges(before, anon_ranges(), page):
        for a in range(lo, hi, page):
            if mincore(a, page, resident.ctypes.data) != 0 or (resident & 1).mean() < RESIDENT_MIN:
                continue                                           # mostly unused: collapsing would only add RSS
            # the contents stay; later allocations in these mappings keep the system's THP policy
            if madvise(a, page, MADV_COLLAPSE) == 0:
                done += page
            else:
                err = ctypes.get_errno()
    if done:
        log.info("%s: %d MiB of %s on %d KiB pages in %.0f ms",
                 what, done >> 20, kind, page >> 10, 1e3 * (time.perf_counter() - t0))
    elif err:
        log.debug("%s: MADV_COLLAPSE failed (%s); %s stays on small pages", what, os.strerror(err), kind)
    return done


class Pending:
    """The memory a load added, collapsed later: off the path to the first token and out of a short run's way
    (the backend starts it when the process is idle or its run grew long). `start()` collapses it on a thread
    of its own (once; later calls do nothing), `settle()` on this thread and returns the bytes. A process
    that ends before the thread is done loses nothing but the thread's work."""

    def __init__(self, before: dict[int, tuple[int, bool]], what: str, kind: str) -> None:
        self._args = (before, what, kind)
        self._lock = threading.Lock()
        self._started = False
        self._finished = threading.Event()
        self.done = 0

    @property
    def started(self) -> bool:
        return self._started

    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
        threading.Thread(target=self._run, name="edgerun-hugepages", daemon=True).start()

    def settle(self, timeout: float | None = None) -> int:
        with self._lock:
            run_here = not self._started
            self._started = True
        if run_here:
            self._run()
        self._finished.wait(timeout)
        return self.done

    def _run(self) -> None:
        try:
            self.done = collapse_new_memory(*self._args)
        finally:
            self._finished.set()
