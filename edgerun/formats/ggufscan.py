"""Fast GGUF header scan: metadata scalars and tensor extents, without loading arrays or weights.

gguf.GGUFReader parses every array element into numpy views, which takes seconds on a
150k-token vocabulary; loading only needs the header checked (is the file complete?) and a few
scalars (layers, KV heads) to size the KV cache. Arrays are skipped, not decoded.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import ModelFormatError, ModelNotFound

# GGUF value types -> struct format of a scalar (8 = string, 9 = array)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
_cache: dict[tuple, "GGUFInfo"] = {}         # (path, device, inode, size, mtime) -> the scan: one per file and process


@dataclass
class GGUFInfo:
    path: Path
    version: int
    metadata: dict = field(default_factory=dict)        # scalars and strings only; arrays -> their length
    tensors: dict = field(default_factory=dict)          # name -> (ggml type, shape, offset in data section)
    data_offset: int = 0
    data_end: int = 0                                    # byte where the last tensor ends
    file_size: int = 0

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_int(self, key: str, default: int = 0) -> int:
        v = self.metadata.get(f"{self.arch}.{key}", default)
        return int(v) if isinstance(v, (int, float)) else default

    def kv_cache_bytes(self, n_ctx: int, bytes_per_value: int = 2) -> int:
        """K and V for n_ctx positions in f16 (llama.cpp's default cache type)."""
        n_layer = self.arch_int("block_count")
        n_head = self.arch_int("attention.head_count", 1) or 1
        n_head_kv = self.arch_int("attention.head_count_kv", n_head) or n_head
        n_embd = self.arch_int("embedding_length")
        k_dim = self.arch_int("attention.key_length", n_embd // n_head)
        v_dim = self.arch_int("attention.value_length", n_embd // n_head)
        return n_layer * n_ctx * n_head_kv * (k_dim + v_dim) * bytes_per_value


class _Cursor:
    def __init__(self, buf, path: Path) -> None:     # buf: bytes or a read-only mmap
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise ModelFormatError(f"{self.path} is a truncated GGUF file: its header ends before byte "
                                   f"{self.pos + n:,} (file has {len(self.buf):,} bytes)")
        b = self.buf[self.pos:self.pos + n]
        self.pos += n
        return b

    def unpack(self, fmt: str):
        s = struct.calcsize("<" + fmt)
        return struct.unpack("<" + fmt, self.take(s))[0]

    def string(self) -> str:
        n = self.unpack("Q")
        return self.take(n).decode("utf-8", "replace")

    def value(self, vtype: int):
        if vtype in _SCALAR:
            return self.unpack(_SCALAR[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.unpack("I"), self.unpack("Q")
            if etype in _SCALAR:
                self.take(n * struct.calcsize("<" + _SCALAR[etype]))
            elif etype == _STRING:            # a vocabulary: skipped in one tight loop (150k strings: ~40 ms)
                buf, pos, end, unpack_from = self.buf, self.pos, len(self.buf), _U64.unpack_from
                for _ in range(n):
                    if pos + 8 > end:
                        pos = end + 8              # past the end: take() reports the truncation
                        break
                    pos += 8 + unpack_from(buf, pos)[0]
                self.take(pos - self.pos)          # raises if the strings run past the header read
            else:
                raise ModelFormatError(f"{self.path}: unsupported GGUF array element type {etype}")
            return n
        raise ModelFormatError(f"{self.path}: unknown GGUF value type {vtype}; the file is damaged")


def read_info(path: str | Path) -> GGUFInfo:
    """Parse the header of a GGUF file and check that all tensor data lies inside the file. The scan is
    kept for the process, keyed by the file's identity (device, inode, size, mtime): the memory check,
    the loader's check and the cluster planner read one scan."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ModelNotFound(f"model file not found: {p}") from None
    if p.is_dir():
        raise ModelFormatError(f"{p} is a directory, expected a .gguf file")
    key = (str(p.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    info = _cache.get(key)
    if info is None:
        info = _scan(p, st.st_size)
        if len(_cache) > 16:
            _cache.clear()
        _cache[key] = info
    return info if info.path == p else replace(info, path=p)


def _header(c: _Cursor, p: Path, size: int) -> GGUFInfo:
    """The metadata and the tensor table; c.pos ends where the header does."""
    c.take(4)
    info = GGUFInfo(path=p, version=c.unpack("I"), file_size=size)
    if info.version not in (2, 3):
        raise ModelFormatError(f"{p}: GGUF version {info.version} is not supported (expected 2 or 3)")
    n_tensors, n_kv = c.unpack("Q"), c.unpack("Q")
    for _ in range(n_kv):
        key = c.string()
        info.metadata[key] = c.value(c.unpack("I"))
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.unpack("I")
        shape = [c.unpack("Q") for _ in range(n_dims)]
        ttype, offset = c.unpack("I"), c.unpack("Q")
        info.tensors[name] = (ttype, shape, offset)
    return info


def _scan(p: Path, size: int) -> GGUFInfo:
    # lazily: importing gguf-py costs ~0.3 s (measured here, beside numpy) and this scan runs before every load
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(p, "rb") as f:
        magic = f.read(4)
        if magic != b"GGUF":
            raise ModelFormatError(f"{p} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")
        # mapped, not read: only the header's pages are touched (a read of the first 64 MiB copied most of a
        # small model's file on every load)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as head:
            c = _Cursor(head, p)
            try:
                info = _header(c, p, size)
            finally:
                c.buf = b""                  # no view of the map outlives it
    align = int(info.metadata.get("general.alignment", 32))
    info.data_offset = (c.pos + align - 1) // align * align
    end = info.data_offset
    for name, (ttype, shape, offset) in info.tensors.items():
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        except (ValueError, KeyError) as e:
            raise ModelFormatError(f"{p}: tensor {name} has unknown type {ttype}") from e
        n = 1
        for d in shape:
            n *= d
        end = max(end, info.data_offset + offset + n // block * type_size)
    info.data_end = end
    if end > size:
        raise ModelFormatError(f"{p} is truncated: its tensors need {end:,} bytes but the file has {size:,}; "
                               f"pull or copy it again")
    return info
