"""GGUF: read float weights from a GGUF file (the Source interface), write a GGUF atomically.


Both readers present one interface (`Source`): `cfg` (edgerun.formats.arch.ModelConfig), `tensor_names()`,
`tensor(name) -> float32 [out, in]` in GGUF layout (llama Q/K permuted), `embedding_rows(ids)`,
`tokenizer_kv()` (the GGUF key/values describing the tokenizer and chat template), `sha256()`.
A tensor is read (and dequantized) only when asked for, so a pipeline can stream block by block.

This module owns the `edgerun.*` metadata keys written into quantized files (see `EDGERUN_KEYS`).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import gguf
import numpy as np

from .arch import ModelConfig, config_from_gguf_fields, get_arch, tensor_names
from ..util.atomic import atomic_path
from ..errors import ModelFormatError, QuantizationError


log = logging.getLogger(__name__)



# edgerun.* metadata written into every quantized file.
EDGERUN_KEYS = (
    "edgerun.quant.method",          # "awq" | "rtn"
    "edgerun.quant.format",          # "q4_0" | "q4_1" | "iq4_nl"
    "edgerun.quant.block_size",      # 32
    "edgerun.quant.grid",            # number of scale exponents searched (0 for rtn)
    "edgerun.quant.embed_type",      # "q8_0" | "q4_0" | "iq4_nl" | "f16"
    "edgerun.calib.sha256",          # sha256 of the calibration token ids (uint32 LE), "" for rtn
    "edgerun.calib.n_tokens",
    "edgerun.calib.name",            # "builtin:pydoc_topics" or the file name
    "edgerun.source.sha256",         # sha256 of the source file (GGUF) or of the sorted safetensors files
    "edgerun.source.name",
    "edgerun.version",
)

# Source metadata never copied into a written file.
_SKIP_KV_PREFIXES = ("GGUF.", "general.alignment", "general.file_type", "general.quantization_version",
                     "split.", "edgerun.")


def sha256_files(paths: Iterable[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class KV:
    """One GGUF key/value with its type (sub_type for arrays)."""

    key: str
    value: Any
    vtype: Any
    sub_type: Any = None


# ----------------------------------------------------------------------------- GGUF source

class GGUFSource:
    """A GGUF model whose tensors `gguf.quants` can dequantize (F32/F16/BF16/Q8_0/Q4_K/...)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFormatError(f"{self.path}: no such file; expected a .gguf model file")
        try:
            self.reader = gguf.GGUFReader(self.path)
        except (ValueError, OSError, IndexError) as e:
            raise ModelFormatError(f"{self.path}: not a readable GGUF file ({e})") from None
        self._tensors = {t.name: t for t in self.reader.tensors}
        arch = self.get("general.architecture", None)
        if arch is None:
            raise ModelFormatError(f"{self.path}: no general.architecture key; expected a GGUF model")
        get_arch(arch)
        if "token_embd.weight" not in self._tensors:
            raise QuantizationError(f"{self.path}: no token_embd.weight tensor; expected a {arch} model")
        n_vocab = int(self._tensors["token_embd.weight"].shape[1])   # reader shape is ne: [in, out]
        try:
            self.cfg = config_from_gguf_fields(arch, self.get, n_vocab, "output.weight" not in self._tensors)
        except KeyError as e:
            raise QuantizationError(f"{self.path}: missing metadata key {e.args[0]!r}; "
                                    f"expected a complete {arch} GGUF") from None
        missing = [n for n in tensor_names(self.cfg) if n not in self._tensors]
        if missing:
            raise QuantizationError(f"{self.path}: missing tensors {missing[:4]}{'...' if len(missing) > 4 else ''}; "
                                    f"expected every {arch} tensor")
        self.name = self.path.name

    _REQUIRED = object()

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        f = self.reader.get_field(key)
        if f is None:
            if default is GGUFSource._REQUIRED:
                raise KeyError(key)
            return default
        return f.contents()

    def kv(self) -> list[KV]:
        """Every metadata key/value of the file with its type (for copying)."""
        out = []
        for key, f in self.reader.fields.items():
            if not f.types:
                continue
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            out.append(KV(key, f.contents(), f.types[0], sub))
        return out

    def tokenizer_kv(self) -> list[KV]:
        return [kv for kv in self.kv() if kv.key.startswith("tokenizer.")]

    def tensor_names(self) -> list[str]:
        names = tensor_names(self.cfg)
        if "rope_freqs.weight" in self._tensors:
            names.insert(1, "rope_freqs.weight")
        return names

    def tensor_type(self, name: str):
        return self._tensors[name].tensor_type

    def raw(self, name: str) -> np.ndarray:
        return self._tensors[name].data

    def tensor(self, name: str) -> np.ndarray:
        """float32 [out, in] (or [n] for vectors); dequantized if stored quantized."""
        t = self._tensors[name]
        try:
            a = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        except NotImplementedError:
            raise QuantizationError(f"{self.path}: tensor {name} has type {t.tensor_type.name}, which "
                                    "gguf cannot dequantize; expected F32/F16/BF16/Q4_0..Q8_0/K-quants") from None
        shape = tuple(int(x) for x in reversed(t.shape))
        return np.asarray(a, dtype=np.float32).reshape(shape)

    def embedding_rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows of token_embd for token ids [n] -> float32 [n, n_embd], dequantizing only those rows."""
        t = self._tensors["token_embd.weight"]
        uniq, inv = np.unique(np.asarray(ids, dtype=np.int64), return_inverse=True)
        rows = np.asarray(t.data)[uniq]                         # [n_uniq, row_bytes or n_embd]
        a = gguf.quants.dequantize(rows, t.tensor_type).reshape(len(uniq), -1).astype(np.float32)
        return a[inv]

    def sha256(self) -> str:
        return sha256_files([self.path])




def hparam_kv(cfg: ModelConfig) -> list[KV]:
    """The architecture keys llama.cpp reads for a llama-like model."""
    T = gguf.GGUFValueType
    a = cfg.arch
    return [
        KV(f"{a}.context_length", cfg.n_ctx_train, T.UINT32),
        KV(f"{a}.embedding_length", cfg.n_embd, T.UINT32),
        KV(f"{a}.block_count", cfg.n_layer, T.UINT32),
        KV(f"{a}.feed_forward_length", cfg.n_ff, T.UINT32),
        KV(f"{a}.attention.head_count", cfg.n_head, T.UINT32),
        KV(f"{a}.attention.head_count_kv", cfg.n_head_kv, T.UINT32),
        KV(f"{a}.attention.key_length", cfg.head_dim, T.UINT32),
        KV(f"{a}.attention.value_length", cfg.head_dim, T.UINT32),
        KV(f"{a}.rope.dimension_count", cfg.head_dim, T.UINT32),
        KV(f"{a}.attention.layer_norm_rms_epsilon", float(cfg.rms_eps), T.FLOAT32),
        KV(f"{a}.rope.freq_base", float(cfg.rope_base), T.FLOAT32),
        KV(f"{a}.vocab_size", cfg.n_vocab, T.UINT32),
    ]


def source_kv(src) -> list[KV]:
    """Metadata to copy into a file derived from `src`: its own keys (GGUF) or hparams + tokenizer (HF)."""
    if isinstance(src, GGUFSource):
        return [kv for kv in src.kv() if not kv.key.startswith(_SKIP_KV_PREFIXES)
                and kv.key != "general.architecture"]
    return [KV("general.name", src.name, gguf.GGUFValueType.STRING), *hparam_kv(src.cfg), *src.tokenizer_kv()]




# ----------------------------------------------------------------------------- writer

@dataclass(frozen=True)
class TensorPlan:
    """One tensor to write: name, numpy shape [out, in], ggml type."""

    name: str
    shape: tuple[int, ...]
    qtype: Any          # gguf.GGMLQuantizationType


def tensor_nbytes(shape: Sequence[int], qtype) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape))
    if shape[-1] % block:
        raise QuantizationError(f"row length {shape[-1]} is not a multiple of the {qtype.name} block size {block}")
    return n // block * size


def write_gguf(path: str | Path, arch: str, kvs: Sequence[KV], plan: Sequence[TensorPlan],
               data: Iterator[np.ndarray], file_type: int | None = None) -> Path:
    """Write a GGUF atomically, streaming tensor data in `plan` order from `data`.

    `data` yields, for each plan entry in order, the raw array to store (float32/float16 for
    F32/F16, uint8 blocks for quantized types). The file appears at `path` only when complete:
    written to a temporary file in the same directory, fsynced, renamed. On any error (or
    KeyboardInterrupt) the temporary file is removed and nothing is left at `path`.
    """
    path = Path(path)
    with atomic_path(path) as tmp:
        _write_gguf(tmp, arch, kvs, plan, data, file_type)
    return path


def _write_gguf(tmp: Path, arch: str, kvs: Sequence[KV], plan: Sequence[TensorPlan], data: Iterator[np.ndarray],
                file_type: int | None) -> None:
    w = None
    try:
        w = gguf.GGUFWriter(tmp, arch)
        for kv in kvs:
            w.add_key_value(kv.key, kv.value, kv.vtype, sub_type=kv.sub_type)
        if file_type is not None:
            w.add_file_type(file_type)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for t in plan:
            nbytes = tensor_nbytes(t.shape, t.qtype)
            if t.qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                dt = np.float32 if t.qtype == gguf.GGMLQuantizationType.F32 else np.float16
                w.add_tensor_info(t.name, t.shape, np.dtype(dt), nbytes)
            else:
                # shape given in elements: tell the writer it is already the element shape
                w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), nbytes, raw_dtype=t.qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        if not plan:                      # no tensors: still pad to where the data section would start
            for f in w.fout:
                w.write_padding(f, f.tell())
        for t in plan:
            try:
                arr = next(data)
            except StopIteration:
                raise QuantizationError(f"internal: no data for tensor {t.name}") from None
            arr = np.ascontiguousarray(arr)
            if arr.nbytes != tensor_nbytes(t.shape, t.qtype):
                raise QuantizationError(f"internal: tensor {t.name} has {arr.nbytes} bytes, "
                                        f"expected {tensor_nbytes(t.shape, t.qtype)}")
            w.write_tensor_data(arr)
        w.close()
        w = None
    finally:
        if w is not None and w.fout is not None:
            for f in w.fout:
                f.close()


def read_edgerun_metadata(path: str | Path) -> dict[str, Any]:
    """The edgerun.* keys of a GGUF file."""
    r = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items() if k.startswith("edgerun.")}
