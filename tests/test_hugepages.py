"""Transparent huge pages for what a model load adds (edgerun/util/hugepages.py), and the llama.cpp backend's use."""

import mmap
import sys

import numpy as np
import pytest

from edgerun.backends.llamacpp import LlamaCppBackend
from edgerun.config import BackendArgs
from edgerun.util.hugepages import anon_ranges, collapse_new_memory, new_ranges, parse_anon_ranges

MB2 = 2 << 20


def anon_huge_kib(lo: int = 0, hi: int = 1 << 64) -> int:
    """AnonHugePages (KiB) of this process's mappings that overlap [lo, hi), from /proc/self/smaps."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start < hi and end > lo
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1])
    return total


def test_new_anonymous_memory_spans_for_huge_pages():
    maps = """55a48ecf8000-55a490000000 rw-p 00000000 00:00 0                          [heap]
7f4000000000-7f4000600000 rw-p 00000000 00:00 0
7f4010a63000-7f4010dc3000 r--p 00000000 fd:01 123                        /x/model.onnx.data
7f4020000000-7f4020200000 rw-s 00000000 00:05 9                          /dev/shm/x
7f4030000000-7f4030100000 rw-p 00000000 00:00 0
"""
    spans = parse_anon_ranges(maps)
    assert spans == {0x55a48ecf8000: (0x55a490000000, True), 0x7f4000000000: (0x7f4000600000, False),
                     0x7f4030000000: (0x7f4030100000, False)}
    grown = {**spans, 0x7f4000000000: (0x7f4000a00000, False), 0x7f4050000000: (0x7f4050500000, False)}
    # the whole heap (freed memory there is handed out again), a mapping's new tail and a new mapping,
    # each page-aligned inwards; unchanged and small mappings are left out
    assert new_ranges(spans, grown, MB2) == [(0x55a48ee00000, 0x55a490000000), (0x7f4000600000, 0x7f4000a00000),
                                             (0x7f4050000000, 0x7f4050400000)]
    assert new_ranges(spans, spans, MB2) == [(0x55a48ee00000, 0x55a490000000)]


def _private(n: int) -> mmap.mmap:
    return mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _collapse_works() -> bool:
    """Whether this kernel collapses a resident anonymous span of our own (MADV_COLLAPSE, THP not `never`)."""
    if not sys.platform.startswith("linux"):
        return False
    before = anon_ranges()
    m = _private(3 * MB2)
    m.write(b"\1" * (3 * MB2))                       # resident: every small page touched
    try:
        return collapse_new_memory(before, "probe", "test memory") > 0
    finally:
        m.close()


needs_collapse = pytest.mark.skipif(not _collapse_works(), reason="this kernel does not collapse memory into "
                                    "transparent huge pages (MADV_COLLAPSE needs Linux >= 6.1, THP not 'never')")


def resident_pages(addr: int, n: int) -> int:
    """How many of the small pages in [addr, addr + n) are resident (mincore)."""
    import ctypes

    small = mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    vec = np.zeros(n // small, dtype=np.uint8)
    assert libc.mincore(addr, n, vec.ctypes.data) == 0
    return int((vec & 1).sum())


@needs_collapse
def test_resident_new_memory_is_collapsed_and_keeps_its_contents():
    before = anon_ranges()
    ma = _private(3 * MB2)                           # 6 MiB written (resident): at least two whole huge pages
    a = np.frombuffer(ma, dtype=np.int64)
    a[:] = np.arange(a.size)
    m = _private(8 * MB2)                            # mapped but never touched: must not be collapsed (no RSS)
    b = np.frombuffer(m, dtype=np.uint8)
    lo, hi = a.ctypes.data, a.ctypes.data + a.nbytes
    huge_before = anon_huge_kib(lo, hi)
    done = collapse_new_memory(before, "test", "test memory")
    assert done >= 2 * MB2
    assert anon_huge_kib(lo, hi) - huge_before >= 2 * MB2 // 1024
    assert resident_pages(b.ctypes.data, b.nbytes) == 0
    del b
    m.close()
    np.testing.assert_array_equal(a, np.arange(a.size))


@needs_collapse
def test_llamacpp_backend_puts_what_it_loaded_on_huge_pages_with_the_same_logits(tiny_llama):
    """The weights, KV cache and compute buffers a load adds are collapsed (huge_pages, the default); off
    leaves them on small pages. The model computes the same either way."""
    args = dict(n_ctx=4096, n_threads=1, n_batch=16)
    outs = {}
    for huge in (False, True):
        b = LlamaCppBackend(tiny_llama, BackendArgs(huge_pages=huge, **args))
        try:
            assert b.huge_bytes == 0                    # nothing before the first evaluation (off its path)
            toks = b.tokenizer.tokenize("the cat is on the mat and the dog is", add_bos=False)
            outs[huge] = b.eval(toks)
            if huge:
                assert not b.huge.started               # a short run: not started by its evaluations
                assert b.huge.settle() >= MB2           # the 4096-position KV cache at least, after that
                assert b.huge_bytes >= MB2
            else:
                assert b.huge_bytes == 0
        finally:
            b.close()
    assert BackendArgs().huge_pages is True
    np.testing.assert_array_equal(outs[True], outs[False])


@needs_collapse
def test_the_collapse_starts_when_the_runtime_is_idle_or_the_run_grows_long(tiny_llama, monkeypatch):
    """A short run's evaluations leave the collapse alone (it would share their CPU); Runtime.idle() starts it,
    and so do HUGE_PAGES_AFTER evaluations."""
    from edgerun.backends import llamacpp
    from edgerun.runtime import Runtime

    monkeypatch.setattr(llamacpp, "HUGE_PAGES_AFTER", 3)
    args = BackendArgs(n_ctx=256, n_threads=1, n_batch=16)
    b = LlamaCppBackend(tiny_llama, args)
    try:
        toks = b.tokenizer.tokenize("the cat is on the mat", add_bos=False)
        b.eval(toks)
        b.eval(toks[:1])
        assert not b.huge.started
        b.eval(toks[:1])
        assert b.huge.started
        assert b.huge.settle() >= MB2
    finally:
        b.close()
    monkeypatch.setattr(llamacpp, "HUGE_PAGES_AFTER", 100)
    b = LlamaCppBackend(tiny_llama, args)
    try:
        rt = Runtime(b, model_name="tiny")
        rt.generate("the cat", max_tokens=2, temperature=0)
        assert not b.huge.started
        rt.idle()
        assert b.huge.started
        b.huge.settle()
    finally:
        b.close()
