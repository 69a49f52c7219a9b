"""Hugging Face checkpoints as a Source: config.json + *.safetensors (fp32/fp16/bf16, sharded or not).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from .arch import ModelConfig, arch_for_hf, config_from_hf, hf_name, permute_qk, read_hf_config, tensor_names
from ..errors import ModelFormatError, QuantizationError
from .gguf import KV, sha256_files


log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- Hugging Face source

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


class HFSource:
    """A Hugging Face checkpoint directory: config.json + *.safetensors (fp32/fp16/bf16, sharded or not)."""

    def __init__(self, directory: str | Path):
        self.path = Path(directory)
        config = read_hf_config(self.path)
        self.hf_config = config
        self.arch = arch_for_hf(config)
        cfg = config_from_hf(config, self.path / "config.json")
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise QuantizationError(f"{self.path}: no *.safetensors files; expected a Hugging Face checkpoint")
        self.files = files
        self._index: dict[str, tuple[Path, str, list[int], int, int]] = {}
        for f in files:
            self._read_header(f)
        tied = cfg.tied or "lm_head.weight" not in self._index
        if tied != cfg.tied:
            cfg = ModelConfig(**{**cfg.__dict__, "tied": tied})
        self.cfg = cfg
        missing = [hf_name(cfg, n) for n in tensor_names(cfg) if hf_name(cfg, n) not in self._index]
        if missing:
            raise QuantizationError(f"{self.path}: missing tensors {missing[:4]}; expected every {cfg.arch} tensor")
        self.name = self.path.name
        self._mmaps: dict[Path, np.memmap] = {}

    def _read_header(self, f: Path) -> None:
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise ModelFormatError(f"{f}: truncated safetensors file")
            n = int.from_bytes(head, "little")
            try:
                meta = json.loads(fh.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ModelFormatError(f"{f}: bad safetensors header ({e})") from None
        for name, info in meta.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in _ST_DTYPES:
                raise QuantizationError(f"{f}: tensor {name} has dtype {info['dtype']}; expected F32, F16 or BF16")
            b0, b1 = info["data_offsets"]
            self._index[name] = (f, info["dtype"], list(info["shape"]), 8 + n + b0, 8 + n + b1)

    def tensor_names(self) -> list[str]:
        return tensor_names(self.cfg)

    def _hf_tensor(self, hname: str) -> np.ndarray:
        f, dt, shape, b0, b1 = self._index[hname]
        mm = self._mmaps.get(f)
        if mm is None:
            mm = self._mmaps[f] = np.memmap(f, mode="r", dtype=np.uint8)
        a = np.frombuffer(mm[b0:b1], dtype=_ST_DTYPES[dt])
        if dt == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)   # bf16 is the top half of a float32
        return a.astype(np.float32).reshape(shape)

    def tensor(self, name: str) -> np.ndarray:
        cfg = self.cfg
        a = self._hf_tensor(hf_name(cfg, name))
        if cfg.spec.permute_qk and (".attn_q." in name or ".attn_k." in name):
            a = permute_qk(a, cfg.n_head if ".attn_q." in name else cfg.n_head_kv)
        return a

    def embedding_rows(self, ids: np.ndarray) -> np.ndarray:
        return self.tensor("token_embd.weight")[np.asarray(ids, dtype=np.int64)]

    def get(self, key: str, default: Any = None) -> Any:
        return default

    def tokenizer_kv(self) -> list[KV]:
        """GGUF tokenizer keys from tokenizer.json (GPT-2 byte-level BPE) and tokenizer_config.json."""
        import gguf
        from gguf.vocab import BpeVocab, SpecialVocab
        T = gguf.GGUFValueType
        try:
            vocab = BpeVocab(self.path)
        except (FileNotFoundError, ValueError, KeyError) as e:
            raise QuantizationError(f"{self.path}: no GPT-2 style BPE tokenizer.json/vocab.json ({e}); "
                                    "expected a byte-level BPE tokenizer (SentencePiece is not supported)") from None
        toks, types = [], []
        for text, _score, typ in vocab.all_tokens():
            toks.append(text.decode("utf-8") if isinstance(text, bytes) else text)
            types.append(int(typ))
        for i in range(len(toks), self.cfg.n_vocab):       # the embedding may be padded past the tokenizer
            toks.append(f"[PAD{i}]")
            types.append(int(gguf.TokenType.UNUSED))
        special = SpecialVocab(self.path, load_merges=True, n_vocab=len(toks))
        out = [KV("tokenizer.ggml.model", "gpt2", T.STRING),
               KV("tokenizer.ggml.pre", self.arch.tokenizer_pre, T.STRING),
               KV("tokenizer.ggml.tokens", toks, T.ARRAY, T.STRING),
               KV("tokenizer.ggml.token_type", types, T.ARRAY, T.INT32)]
        if special.merges:
            out.append(KV("tokenizer.ggml.merges", list(special.merges), T.ARRAY, T.STRING))
        for typ, tid in special.special_token_ids.items():
            out.append(KV(f"tokenizer.ggml.{typ}_token_id", int(tid), T.UINT32))
        for typ, val in special.add_special_token.items():
            out.append(KV(f"tokenizer.ggml.add_{typ}_token", bool(val), T.BOOL))
        if isinstance(special.chat_template, str):
            out.append(KV("tokenizer.chat_template", special.chat_template, T.STRING))
        return out

    def sha256(self) -> str:
        return sha256_files([self.path / "config.json", *self.files])
