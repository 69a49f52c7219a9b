"""A published INT4 checkpoint directory: config.json (+ quantization_config), *.safetensors, tokenizer.

`Int4Checkpoint` names tensors the GGUF way (edgerun.formats.arch) and hands out each one on request,
so a conversion holds a few tensors at a time: `weight(name)` is an `Int4` (a quantized linear, in
GGUF layout: llama Q/K rows permuted) or a float32 array (everything the checkpoint keeps in float).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelFormatError, QuantizationError
from ..formats.arch import hf_name, permute_qk, read_hf_config, tensor_names, tensor_shape
from ..formats.gguf import KV, sha256_files
from ..formats.hf import hf_tokenizer_kv, open_checkpoint
from . import unpack
from .scheme import Scheme, read_scheme

log = logging.getLogger(__name__)

# per method: the suffixes that make a module quantized, and those it must have
_QUANT_TENSORS = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales"),
                  "compressed-tensors": ("weight_packed", "weight_scale")}


def is_int4_checkpoint(path: str | Path) -> bool:
    """Cheap test: a directory whose config.json has a quantization_config."""
    p = Path(path)
    if not (p / "config.json").is_file():
        return False
    try:
        return isinstance(read_hf_config(p).get("quantization_config"), dict)
    except QuantizationError:
        return False


class Int4Checkpoint:
    """An AutoAWQ / GPTQ / compressed-tensors checkpoint (llama, qwen2), opened and checked for completeness."""

    def __init__(self, directory: str | Path):
        self.path = Path(directory)
        if not self.path.is_dir():
            raise QuantizationError(f"{self.path}: not a directory; expected a checkpoint directory "
                                    "(config.json, *.safetensors, tokenizer.json)")
        if not (self.path / "config.json").is_file():
            raise QuantizationError(f"{self.path}: no config.json; expected a checkpoint directory "
                                    "(config.json, *.safetensors, tokenizer.json)")
        self.scheme: Scheme = read_scheme(read_hf_config(self.path), self.path / "config.json")
        self.hf_config, self.arch, self.cfg, self.files, self.st = open_checkpoint(
            self.path, f"the weights of a {self.scheme.label} checkpoint")
        cfg = self.cfg
        self.name = self.path.name
        missing = []
        for n in self.tensor_names():
            hn = hf_name(cfg, n)
            module = hn.rsplit(".", 1)[0]
            if self.is_quantized(n):
                missing += [f"{module}.{t}" for t in self._required(module) if f"{module}.{t}" not in self.st]
            elif hn not in self.st:
                missing.append(hn)
        if missing:
            raise ModelFormatError(f"{self.path}: missing tensors {missing[:4]}{' ...' if len(missing) > 4 else ''}; "
                                   f"expected every {cfg.arch} tensor of a {self.scheme.label} checkpoint")

    # ---------------------------------------------------------------- what is where

    def tensor_names(self) -> list[str]:
        return tensor_names(self.cfg)

    def _quantized(self, module: str) -> bool:
        """Whether the checkpoint stores `module` (an HF linear) quantized."""
        first = _QUANT_TENSORS[self.scheme.method][0]
        stored = f"{module}.{first}" in self.st
        planned = self.scheme.group_for(module) is not None
        if stored and not planned:
            log.info("%s is stored quantized though the scheme does not list it", module)
        return stored or planned

    def _required(self, module: str) -> tuple[str, ...]:
        req = _QUANT_TENSORS[self.scheme.method]
        if self.scheme.method == "compressed-tensors":
            g = self.scheme.group_for(module)
            if g is not None and not g.symmetric:
                req = (*req, "weight_zero_point")
        return req

    def is_quantized(self, name: str) -> bool:
        """Whether GGUF tensor `name` is an INT4 weight in this checkpoint."""
        parts = name.split(".")
        if parts[0] != "blk" or parts[-1] != "weight" or parts[2] not in self.cfg.spec.linears:
            return False
        return self._quantized(hf_name(self.cfg, name).rsplit(".", 1)[0])

    def blockwise(self, name: str) -> bool:
        """Whether every input of INT4 tensor `name` belongs to group k // g (not so for GPTQ act-order)."""
        module = hf_name(self.cfg, name).rsplit(".", 1)[0]
        if self.scheme.method != "gptq" or f"{module}.g_idx" not in self.st:
            return True
        gi = self.st.raw(f"{module}.g_idx").astype(np.int64)
        grp = self.scheme.group_for(module) or self.scheme.groups[0]
        g = gi.shape[0] if grp.group_size == -1 else grp.group_size
        return bool(np.array_equal(gi, np.arange(gi.shape[0]) // g))

    def float_dtype(self, name: str) -> str:
        """safetensors dtype of a float tensor ("F16", "BF16", "F32")."""
        return self.st.index[hf_name(self.cfg, name)].dtype

    # ---------------------------------------------------------------- tensors

    def weight(self, name: str) -> unpack.Int4 | np.ndarray:
        """A GGUF-named tensor: Int4 for a quantized linear, float32 otherwise (GGUF layout)."""
        cfg = self.cfg
        want = (cfg.n_embd,) if name == "output_norm.weight" else tensor_shape(cfg, name)
        if self.is_quantized(name):
            w = self._int4(hf_name(cfg, name).rsplit(".", 1)[0], want)
        else:
            hn = hf_name(cfg, name)
            w = self.st.float32(hn)
            if tuple(w.shape) != tuple(want):
                raise ModelFormatError(f"{self.path}: tensor {hn} has shape {list(w.shape)}; expected {list(want)}")
            if not np.isfinite(w).all():
                raise ModelFormatError(f"{self.path}: tensor {hn} has NaN/inf values; expected finite weights")
        if cfg.spec.permute_qk and (".attn_q." in name or ".attn_k." in name):
            n_heads = cfg.n_head if ".attn_q." in name else cfg.n_head_kv
            if isinstance(w, unpack.Int4):
                w = unpack.Int4(permute_qk(w.q, n_heads), permute_qk(w.z, n_heads), permute_qk(w.s, n_heads), w.g,
                                w.symmetric, None if w.m is None else permute_qk(w.m, n_heads), w.g_idx)
            else:
                w = permute_qk(w, n_heads)
        return w

    def float16_stored(self, name: str) -> np.ndarray | None:
        """A float tensor stored as F16 in the checkpoint, as its F16 values read in place (no float32 copy:
        the embedding of a 0.5B model is 272 MB as F16, twice that as float32), or None where the tensor is
        quantized, not F16, or permuted on the way to GGUF. Checked like `weight`."""
        cfg = self.cfg
        if self.is_quantized(name) or self.float_dtype(name) != "F16":
            return None
        if cfg.spec.permute_qk and (".attn_q." in name or ".attn_k." in name):
            return None
        hn = hf_name(cfg, name)
        want = (cfg.n_embd,) if name == "output_norm.weight" else tensor_shape(cfg, name)
        w = self.st.raw(hn)
        if tuple(w.shape) != tuple(want):
            raise ModelFormatError(f"{self.path}: tensor {hn} has shape {list(w.shape)}; expected {list(want)}")
        flat = w.reshape(-1)
        for i in range(0, flat.size, 1 << 22):              # 8 MB at a time
            if not np.isfinite(flat[i:i + (1 << 22)]).all():
                raise ModelFormatError(f"{self.path}: tensor {hn} has NaN/inf values; expected finite weights")
        return w

    def tensor(self, name: str) -> np.ndarray:
        """float32 of any tensor (INT4 weights dequantized)."""
        w = self.weight(name)
        return w.dequantize() if isinstance(w, unpack.Int4) else w

    def _int4(self, module: str, want: tuple[int, int]) -> unpack.Int4:
        st, sch = self.st, self.scheme
        N, K = want
        grp = sch.group_for(module)
        gs = grp.group_size if grp is not None else int(sch.groups[0].group_size)
        g = K if gs == -1 else gs

        def raw(t: str) -> np.ndarray:
            return st.raw(f"{module}.{t}")

        def flt(t: str) -> np.ndarray:
            return st.float32(f"{module}.{t}")

        try:
            if K % g:
                raise ModelFormatError(f"group size {g} does not divide the {K} inputs")
            if sch.method == "awq":
                qw, qz = raw("qweight"), raw("qzeros")
                fn = {"gemm": unpack.awq_gemm, "gemv": unpack.awq_gemv, "gemv_fast": unpack.awq_gemv_fast}[sch.version]
                exp_dt = np.int16 if sch.version == "gemv_fast" else np.int32
                if qw.dtype != exp_dt:
                    raise ModelFormatError(f"qweight has dtype {qw.dtype}; expected {np.dtype(exp_dt)} for {sch.label}")
                if sch.version == "gemv_fast":
                    w = fn(qw, flt("qzeros"), flt("scales"), g)
                else:
                    w = fn(qw, qz, flt("scales"), g)
            elif sch.method == "gptq":
                gi = raw("g_idx") if f"{module}.g_idx" in st else None
                w = unpack.gptq(raw("qweight"), raw("qzeros"), flt("scales"), gi, g, sch.version == "gptq", grp.symmetric)
            else:
                shape = tuple(int(v) for v in raw("weight_shape")) if f"{module}.weight_shape" in st else (N, K)
                if shape != (N, K):
                    raise ModelFormatError(f"weight_shape {list(shape)}; expected {[N, K]}")
                zp = raw("weight_zero_point") if f"{module}.weight_zero_point" in st and not grp.symmetric else None
                w = unpack.ct_pack_quantized(raw("weight_packed"), flt("weight_scale"), zp, (N, K), g, grp.symmetric)
        except ModelFormatError as e:
            raise ModelFormatError(f"{self.path}: {module}: {e}") from None
        except KeyError as e:
            raise ModelFormatError(f"{self.path}: {module}: missing tensor {e.args[0]}") from None
        if w.q.shape != (N, K):
            raise ModelFormatError(f"{self.path}: {module} unpacks to shape {list(w.q.shape)}; expected {[N, K]} "
                                   f"(out, in) for {self.cfg.arch}")
        bad = ~np.isfinite(w.s) | (w.s == 0)
        if bad.any():
            raise ModelFormatError(f"{self.path}: {module} has {int(bad.sum())} NaN, infinite or zero scales; "
                                   "expected finite non-zero scales")
        return w

    # ---------------------------------------------------------------- metadata

    def get(self, key: str, default: Any = None) -> Any:
        return default

    def tokenizer_kv(self) -> list[KV]:
        return hf_tokenizer_kv(self.path, self.arch.tokenizer_pre, self.cfg.n_vocab)

    def source_files(self) -> list[Path]:
        """The files whose bytes define the model (hashed for the cache key and metadata)."""
        extra = [self.path / f for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                                         "special_tokens_map.json", "generation_config.json")
                 if (self.path / f).is_file()]
        return [self.path / "config.json", *self.files, *extra]

    def sha256(self) -> str:
        return sha256_files(self.source_files())
