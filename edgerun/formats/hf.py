"""Hugging Face checkpoints as a Source: config.json + *.safetensors (fp32/fp16/bf16, sharded or not).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf.vocab import BpeVocab, SpecialVocab

from .arch import ModelConfig, arch_for_hf, config_from_hf, hf_name, permute_qk, read_hf_config, tensor_names
from ..errors import ModelFormatError, QuantizationError
from .gguf import KV, sha256_files


log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- safetensors files

# safetensors dtype -> numpy dtype (BF16 read as its raw uint16 bits)
ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
             "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "I64": np.int64}
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


@dataclass(frozen=True)
class STEntry:
    """Where one tensor lies: file, dtype name, shape, absolute byte range."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


class SafetensorsFiles:
    """The tensors of one or more *.safetensors files (sharded or not), read lazily through a memory map.

    Headers are checked when opened: a truncated file, a bad header, an unknown dtype or a byte range
    that does not match the shape is a ModelFormatError naming the file and the tensor.
    """

    def __init__(self, files: list[Path]):
        self.files = files
        self.index: dict[str, STEntry] = {}
        self._mmaps: dict[Path, np.memmap] = {}
        for f in files:
            self._read_header(f)

    def _read_header(self, f: Path) -> None:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise ModelFormatError(f"{f}: truncated safetensors file ({size} bytes); expected a header")
            n = int.from_bytes(head, "little")
            if 8 + n > size:
                raise ModelFormatError(f"{f}: truncated safetensors file (header of {n} bytes, file of {size})")
            try:
                meta = json.loads(fh.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ModelFormatError(f"{f}: bad safetensors header ({e})") from None
        for name, info in meta.items():
            if name == "__metadata__":
                continue
            dt = info.get("dtype")
            if dt not in ST_DTYPES:
                raise ModelFormatError(f"{f}: tensor {name} has dtype {dt}; expected one of {sorted(ST_DTYPES)}")
            b0, b1 = info["data_offsets"]
            shape = tuple(int(x) for x in info["shape"])
            if b1 - b0 != int(np.prod(shape)) * np.dtype(ST_DTYPES[dt]).itemsize:
                raise ModelFormatError(f"{f}: tensor {name} has {b1 - b0} bytes for shape {list(shape)} {dt}")
            if 8 + n + b1 > size:
                raise ModelFormatError(f"{f}: truncated safetensors file: tensor {name} ends at byte "
                                       f"{8 + n + b1}, the file has {size}")
            if name in self.index:
                raise ModelFormatError(f"{f}: tensor {name} is also in {self.index[name].file.name}")
            self.index[name] = STEntry(f, dt, shape, 8 + n + b0, 8 + n + b1)

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def raw(self, name: str) -> np.ndarray:
        """The tensor as stored (BF16 as uint16 bits), shaped, read-only."""
        e = self.index[name]
        mm = self._mmaps.get(e.file)
        if mm is None:
            mm = self._mmaps[e.file] = np.memmap(e.file, mode="r", dtype=np.uint8)
        return np.frombuffer(mm[e.start:e.end], dtype=ST_DTYPES[e.dtype]).reshape(e.shape)

    def float32(self, name: str) -> np.ndarray:
        """A float tensor as float32 (bf16 widened exactly)."""
        e = self.index[name]
        if e.dtype not in FLOAT_DTYPES:
            raise QuantizationError(f"{e.file}: tensor {name} has dtype {e.dtype}; expected F32, F16 or BF16")
        a = self.raw(name)
        if e.dtype == "BF16":
            return bf16_to_f32(a)
        return a.astype(np.float32)


def bf16_to_f32(a: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) -> float32: bf16 is the top half of a float32."""
    return (np.asarray(a, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


# ----------------------------------------------------------------------------- Hugging Face source

def open_checkpoint(path: Path, what: str = "a Hugging Face checkpoint"):
    """(config dict, Arch, ModelConfig, safetensors files, SafetensorsFiles) of a checkpoint directory;
    `tied` is set when the checkpoint has no lm_head."""
    config = read_hf_config(path)
    arch = arch_for_hf(config)
    cfg = config_from_hf(config, path / "config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{path}: no *.safetensors files; expected {what}")
    st = SafetensorsFiles(files)
    check_dimensions(cfg, st, path / "config.json")
    tied = cfg.tied or "lm_head.weight" not in st
    if tied != cfg.tied:
        cfg = ModelConfig(**{**cfg.__dict__, "tied": tied})
    return config, arch, cfg, files, st


def check_dimensions(cfg: ModelConfig, st: SafetensorsFiles, where: Path) -> None:
    """config.json's layer count and widths against the tensors the files hold, before anything is
    planned or allocated from them (a config that claims a million layers is refused here)."""
    layers = set()
    for name in st.index:
        parts = name.split(".")
        if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
            layers.add(int(parts[2]))
    if len(layers) != cfg.n_layer or (layers and max(layers) != cfg.n_layer - 1):
        raise ModelFormatError(f"{where}: num_hidden_layers is {cfg.n_layer} but the safetensors files hold "
                               f"tensors of {len(layers)} layers; tensors are missing or the config is wrong")
    emb = st.index.get("model.embed_tokens.weight")
    if emb is None:
        raise ModelFormatError(f"{where.parent}: missing tensor model.embed_tokens.weight")
    if tuple(emb.shape) != (cfg.n_vocab, cfg.n_embd):
        raise ModelFormatError(f"{where}: vocab_size x hidden_size is {cfg.n_vocab} x {cfg.n_embd} but "
                               f"model.embed_tokens.weight has shape {list(emb.shape)}")


class HFSource:
    """A Hugging Face checkpoint directory: config.json + *.safetensors (fp32/fp16/bf16, sharded or not)."""

    def __init__(self, directory: str | Path):
        self.path = Path(directory)
        self.hf_config, self.arch, self.cfg, self.files, self.st = open_checkpoint(self.path)
        cfg = self.cfg
        missing = [hf_name(cfg, n) for n in tensor_names(cfg) if hf_name(cfg, n) not in self.st]
        if missing:
            raise QuantizationError(f"{self.path}: missing tensors {missing[:4]}; expected every {cfg.arch} tensor")
        self.name = self.path.name

    def tensor_names(self) -> list[str]:
        return tensor_names(self.cfg)

    def _hf_tensor(self, hname: str) -> np.ndarray:
        return self.st.float32(hname)

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
        return hf_tokenizer_kv(self.path, self.arch.tokenizer_pre, self.cfg.n_vocab)

    def sha256(self) -> str:
        return sha256_files([self.path / "config.json", *self.files])


def _byte_level(tj: dict) -> bool:
    """Whether a tokenizer.json uses GPT-2 byte-level BPE (a ByteLevel pre-tokenizer or decoder)."""
    def has(node) -> bool:
        if isinstance(node, dict):
            return node.get("type") == "ByteLevel" or any(has(v) for v in node.values())
        if isinstance(node, list):
            return any(has(v) for v in node)
        return False
    return (tj.get("model") or {}).get("type") == "BPE" and (has(tj.get("pre_tokenizer")) or has(tj.get("decoder")))


def _pre_parts(tj: dict) -> list[dict]:
    node = tj.get("pre_tokenizer") or {}
    if node.get("type") == "Sequence":
        return [p for p in node.get("pretokenizers") or [] if isinstance(p, dict)]
    return [node] if node else []


def pre_tokenizer_type(tj: dict, family_default: str) -> str:
    """llama.cpp's pre-tokenizer name for a tokenizer.json's pre_tokenizer: the split llama.cpp must apply
    before BPE for its ids to equal the checkpoint's own tokenizer's. Recognised: GPT-2's ByteLevel regex
    ('gpt-2'), single digits then ByteLevel (SmolLM: 'smollm'), Qwen2's split regex ('qwen2') and Llama 3's
    ('llama-bpe'); anything else keeps the architecture family's default, with a warning."""
    parts = _pre_parts(tj)
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits") and parts[1].get("use_regex", True):
        return "smollm"
    if kinds[:1] == ["Split"]:
        pattern = str((parts[0].get("pattern") or {}).get("Regex", ""))
        if r"\p{N}{1,3}" in pattern:
            return "llama-bpe"
        if "(?i:'s|'t|'re|'ve|'m|'ll|'d)" in pattern and r"\p{N}|" in pattern:
            return "qwen2"
    log.warning("tokenizer.json's pre-tokenizer %s is not one edgerun recognises; using llama.cpp's %r "
                "pre-tokenizer of the architecture (digits and punctuation may split differently from the "
                "checkpoint's own tokenizer)", kinds or "(none)", family_default)
    return family_default


def hf_tokenizer_kv(directory: Path, tokenizer_pre: str, n_vocab: int) -> list[KV]:
    """GGUF tokenizer keys from a checkpoint's tokenizer.json (GPT-2 byte-level BPE) and tokenizer_config.json."""
    T = gguf.GGUFValueType
    directory = Path(directory)
    tj_path = directory / "tokenizer.json"
    if tj_path.is_file():
        try:
            tj = json.loads(tj_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise QuantizationError(f"{tj_path}: not valid JSON ({e}); expected a Hugging Face tokenizer.json") from None
        if not isinstance(tj, dict) or not _byte_level(tj):
            kind = (tj.get("model") or {}).get("type") if isinstance(tj, dict) else None
            raise QuantizationError(f"{tj_path}: tokenizer model {kind!r} is not GPT-2 byte-level BPE; expected a "
                                    "byte-level BPE tokenizer (SentencePiece / WordPiece / Unigram are not supported)")
        tokenizer_pre = pre_tokenizer_type(tj, tokenizer_pre)
    elif (directory / "tokenizer.model").is_file():
        raise QuantizationError(f"{directory}: only a SentencePiece tokenizer.model; expected a byte-level BPE "
                                "tokenizer.json (SentencePiece is not supported)")
    try:
        vocab = BpeVocab(directory)
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise QuantizationError(f"{directory}: no GPT-2 style BPE tokenizer.json/vocab.json ({e}); "
                                "expected a byte-level BPE tokenizer (SentencePiece is not supported)") from None
    toks, types = [], []
    for text, _score, typ in vocab.all_tokens():
        toks.append(text.decode("utf-8") if isinstance(text, bytes) else text)
        types.append(int(typ))
    if len(toks) > n_vocab:
        raise QuantizationError(f"{directory}: the tokenizer has {len(toks)} tokens, more than the model's "
                                f"vocab_size {n_vocab}; expected the checkpoint's own tokenizer")
    for i in range(len(toks), n_vocab):                 # the embedding may be padded past the tokenizer
        toks.append(f"[PAD{i}]")
        types.append(int(gguf.TokenType.UNUSED))
    special = SpecialVocab(directory, load_merges=True, n_vocab=len(toks))
    out = [KV("tokenizer.ggml.model", "gpt2", T.STRING),
           KV("tokenizer.ggml.pre", tokenizer_pre, T.STRING),
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
