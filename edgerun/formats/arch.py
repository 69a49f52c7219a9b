"""Per-architecture tables: tensor names (GGUF and Hugging Face), RoPE style, AWQ scale groups.

Adding a model family that is built like llama (pre-norm decoder, RMSNorm, RoPE, GQA, SwiGLU)
is one more `Arch` entry in `ARCHS`, not new code. Weights are always held in GGUF layout and
GGUF names: `[out, in]` linear matrices, llama Q/K rows permuted for llama.cpp's RoPE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ..errors import InvalidArgument, QuantizationError
from ..util import jsontext


@dataclass(frozen=True)
class ScaleGroup:
    """Linears that share one input, and the operator whose output channels produce that input.

    AWQ multiplies the group's input channels by s and divides `prev`'s output channels by s
    (a norm weight [in], or the rows of a linear [in, *] plus its bias), so the float model's
    function is unchanged.
    """

    name: str
    prev: str                     # block tensor (without "blk.N." and ".weight")
    prev_kind: str                # "norm" | "linear"
    linears: tuple[str, ...]      # block tensors quantized together, all reading the same input
    repeat_kv: bool = False       # prev has n_head_kv*head_dim rows, the input n_head*head_dim (GQA)


# Block tensors: GGUF suffix -> Hugging Face suffix (under "model.layers.N.").
LLAMA_BLOCK = (
    ("attn_norm", "input_layernorm"),
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"),
    ("ffn_norm", "post_attention_layernorm"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
)

LLAMA_GROUPS = (
    ScaleGroup("attn_in", "attn_norm", "norm", ("attn_q", "attn_k", "attn_v")),
    ScaleGroup("attn_out", "attn_v", "linear", ("attn_output",), repeat_kv=True),
    ScaleGroup("ffn_in", "ffn_norm", "norm", ("ffn_gate", "ffn_up")),
    ScaleGroup("ffn_out", "ffn_up", "linear", ("ffn_down",)),
)

# Hugging Face config.json key -> ModelConfig field (the keys every llama-like config has).
HF_CONFIG_KEYS = (
    ("vocab_size", "n_vocab"),
    ("hidden_size", "n_embd"),
    ("num_hidden_layers", "n_layer"),
    ("intermediate_size", "n_ff"),
    ("num_attention_heads", "n_head"),
    ("rms_norm_eps", "rms_eps"),
)


@dataclass(frozen=True)
class Arch:
    name: str                         # GGUF general.architecture
    hf_classes: tuple[str, ...]       # config.json "architectures"
    hf_model_types: tuple[str, ...]   # config.json "model_type"
    rope_style: str                   # "norm": adjacent pairs (llama.cpp LLAMA_ROPE_TYPE_NORM) | "neox": halves
    permute_qk: bool                  # HF -> GGUF permutes Q/K rows (llama's convert does, qwen2's does not)
    block: tuple[tuple[str, str], ...]
    biases: tuple[str, ...]           # block linears that carry a bias
    groups: tuple[ScaleGroup, ...]
    default_rope_base: float = 10000.0
    tokenizer_pre: str = "default"    # llama.cpp pre-tokenizer for an HF BPE tokenizer of this family

    @property
    def linears(self) -> tuple[str, ...]:
        return tuple(n for g in self.groups for n in g.linears)

    @property
    def norms(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.block if n.endswith("_norm"))


ARCHS: dict[str, Arch] = {
    "llama": Arch(
        name="llama",
        hf_classes=("LlamaForCausalLM",),
        hf_model_types=("llama",),
        rope_style="norm",
        permute_qk=True,
        block=LLAMA_BLOCK,
        biases=(),
        groups=LLAMA_GROUPS,
    ),
    "qwen2": Arch(
        name="qwen2",
        hf_classes=("Qwen2ForCausalLM",),
        hf_model_types=("qwen2",),
        rope_style="neox",
        permute_qk=False,
        block=LLAMA_BLOCK,
        biases=("attn_q", "attn_k", "attn_v"),
        groups=LLAMA_GROUPS,
        default_rope_base=1000000.0,
        tokenizer_pre="qwen2",
    ),
}


def get_arch(name: str) -> Arch:
    try:
        return ARCHS[name]
    except KeyError:
        raise QuantizationError(
            f"unsupported architecture {name!r}; expected one of {sorted(ARCHS)}") from None


def arch_for_hf(config: Mapping[str, Any]) -> Arch:
    """The Arch of a Hugging Face config.json (by `architectures`, then `model_type`)."""
    for a in ARCHS.values():
        if any(c in a.hf_classes for c in config.get("architectures") or ()):
            return a
        if config.get("model_type") in a.hf_model_types:
            return a
    raise QuantizationError(
        f"unsupported architecture {config.get('architectures') or config.get('model_type')!r}; "
        f"expected one of {[c for a in ARCHS.values() for c in a.hf_classes]}")


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a llama-like decoder."""

    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rms_eps: float
    rope_base: float
    n_ctx_train: int = 4096
    tied: bool = False                # output head shares token_embd

    def __post_init__(self) -> None:
        for f in ("n_vocab", "n_embd", "n_layer", "n_ff", "n_head", "n_head_kv", "head_dim"):
            v = getattr(self, f)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise QuantizationError(f"model config {f} must be a positive integer, got {v!r}")
        if self.n_head % self.n_head_kv:
            raise QuantizationError(
                f"n_head ({self.n_head}) must be a multiple of n_head_kv ({self.n_head_kv})")
        if self.head_dim % 2:
            raise QuantizationError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def spec(self) -> Arch:
        return get_arch(self.arch)

    @property
    def n_rep(self) -> int:
        return self.n_head // self.n_head_kv


def config_from_gguf_fields(arch: str, get, n_vocab: int, tied: bool) -> ModelConfig:
    """ModelConfig from GGUF metadata; `get(key, default=<required>)` reads one scalar."""
    a = get_arch(arch)
    n_embd = int(get(f"{arch}.embedding_length"))
    n_head = int(get(f"{arch}.attention.head_count"))
    return ModelConfig(
        arch=arch,
        n_vocab=n_vocab,
        n_embd=n_embd,
        n_layer=int(get(f"{arch}.block_count")),
        n_ff=int(get(f"{arch}.feed_forward_length")),
        n_head=n_head,
        n_head_kv=int(get(f"{arch}.attention.head_count_kv", n_head)),
        head_dim=int(get(f"{arch}.attention.key_length", n_embd // n_head)),
        rms_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_base=float(get(f"{arch}.rope.freq_base", a.default_rope_base)),
        n_ctx_train=int(get(f"{arch}.context_length", 4096)),
        tied=tied,
    )


_GGUF_U32 = 2**32 - 1


def _positive_f32(v: Any) -> bool:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    with np.errstate(over="ignore"):
        f = float(np.float32(float(v))) if abs(v) < 1e300 else float("inf")
    return math.isfinite(f) and f > 0


def config_from_hf(config: Mapping[str, Any], path: Path | str = "config.json") -> ModelConfig:
    """ModelConfig from a Hugging Face config.json dict; missing keys are a QuantizationError, and so
    is any value of the wrong kind (a dimension that is not a positive integer or does not fit GGUF)."""
    a = arch_for_hf(config)
    missing = [k for k, _ in HF_CONFIG_KEYS if k not in config]
    if missing:
        raise QuantizationError(f"{path}: missing config keys {missing}; a {a.name} config needs "
                                f"{[k for k, _ in HF_CONFIG_KEYS]}")
    if config.get("rope_scaling"):
        raise QuantizationError(f"{path}: rope_scaling {config['rope_scaling']!r} is not supported; "
                                "expected a model without RoPE scaling")
    vals = {f: config[k] for k, f in HF_CONFIG_KEYS}
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings"):
        v = config.get(key)
        if key in config and v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            raise QuantizationError(f"{path}: {key} must be a positive integer, got {v!r:.40}")
        if isinstance(v, int) and v > _GGUF_U32:             # GGUF stores these as uint32
            raise QuantizationError(f"{path}: {key} is {v}; at most {_GGUF_U32} fits a GGUF file")
    for key in ("rms_norm_eps", "rope_theta"):               # GGUF float32, and both must be > 0
        v = config.get(key)
        if (key == "rms_norm_eps" or v is not None) and not _positive_f32(v):
            raise QuantizationError(f"{path}: {key} must be a positive finite number, got {v!r:.40}")
    if not isinstance(config.get("tie_word_embeddings", False), bool):
        raise QuantizationError(f"{path}: tie_word_embeddings must be true or false, "
                                f"got {config['tie_word_embeddings']!r:.40}")
    n_head = int(vals["n_head"])
    n_embd = int(vals["n_embd"])
    return ModelConfig(
        arch=a.name,
        n_vocab=int(vals["n_vocab"]),
        n_embd=n_embd,
        n_layer=int(vals["n_layer"]),
        n_ff=int(vals["n_ff"]),
        n_head=n_head,
        n_head_kv=int(config.get("num_key_value_heads") or n_head),
        head_dim=int(config.get("head_dim") or n_embd // n_head),
        rms_eps=float(np.float32(vals["rms_eps"])),            # as GGUF stores them (f32)
        rope_base=float(np.float32(config.get("rope_theta") or a.default_rope_base)),
        n_ctx_train=int(config.get("max_position_embeddings", 4096)),
        tied=bool(config.get("tie_word_embeddings", False)),
    )


def read_hf_config(directory: Path) -> dict:
    p = Path(directory) / "config.json"
    try:
        config = jsontext.loads(p.read_text(encoding="utf-8"), str(p))
    except FileNotFoundError:
        raise QuantizationError(f"{directory}: no config.json; expected a Hugging Face checkpoint "
                                "directory (config.json + *.safetensors)") from None
    except UnicodeDecodeError:
        raise QuantizationError(f"{p}: not UTF-8 text; expected a JSON object") from None
    except InvalidArgument as e:
        raise QuantizationError(str(e)) from None
    except ValueError as e:
        raise QuantizationError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise QuantizationError(f"{p}: a JSON {type(config).__name__}; expected a JSON object")
    for key in ("architectures", "model_type"):
        v = config.get(key)
        if v is not None and not (isinstance(v, str) if key == "model_type" else
                                  isinstance(v, list) and all(isinstance(x, str) for x in v)):
            raise QuantizationError(f"{p}: {key} is {v!r:.40}; expected "
                                    f"{'a string' if key == 'model_type' else 'a list of class names'}")
    return config


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF rotate-half row order -> llama.cpp adjacent-pair order, per head.

    w [n_heads*hd, ...] -> [n_heads, 2, hd/2, ...] -> swap -> [n_heads, hd/2, 2, ...] -> flat.
    """
    shape = w.shape
    return w.reshape(n_heads, 2, shape[0] // n_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of permute_qk: llama.cpp order -> HF rotate-half order."""
    shape = w.shape
    return w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def block_name(i: int, suffix: str, kind: str = "weight") -> str:
    return f"blk.{i}.{suffix}.{kind}"


def tensor_names(cfg: ModelConfig) -> list[str]:
    """GGUF tensor names of a model in writing order (embeddings, blocks, final norm, head)."""
    a = cfg.spec
    names = ["token_embd.weight"]
    for i in range(cfg.n_layer):
        for suffix, _ in a.block:
            names.append(block_name(i, suffix))
            if suffix in a.biases:
                names.append(block_name(i, suffix, "bias"))
    names.append("output_norm.weight")
    if not cfg.tied:
        names.append("output.weight")
    return names


def hf_name(cfg: ModelConfig, gguf_name: str) -> str:
    """Hugging Face tensor name of a GGUF tensor name."""
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if gguf_name in top:
        return top[gguf_name]
    _, i, suffix, kind = gguf_name.split(".")
    return f"model.layers.{i}.{dict(cfg.spec.block)[suffix]}.{kind}"


def tensor_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    """numpy shape of a GGUF-named tensor ([out, in] for matrices, [n] for norms and biases)."""
    d, hd = cfg.n_embd, cfg.head_dim
    q, kv = cfg.n_head * hd, cfg.n_head_kv * hd
    if name in ("token_embd.weight", "output.weight"):
        return (cfg.n_vocab, d)
    suffix, kind = name.split(".")[2:]
    if kind == "bias":
        return ({"attn_q": q, "attn_k": kv, "attn_v": kv}[suffix],)
    return {"attn_norm": (d,), "ffn_norm": (d,), "attn_q": (q, d), "attn_k": (kv, d), "attn_v": (kv, d),
            "attn_output": (d, q), "ffn_gate": (cfg.n_ff, d), "ffn_up": (cfg.n_ff, d),
            "ffn_down": (d, cfg.n_ff)}[suffix]
