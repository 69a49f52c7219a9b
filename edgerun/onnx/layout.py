"""The ONNX directory contract: file names, graph IO names, edgerun.json (the model config) and reading it.


The graph is what onnxruntime-genai expects of a decoder: inputs `input_ids`, `attention_mask`,
`past_key_values.N.key/value` (BNSH), outputs `logits`, `present.N.key/value`. Inside:

    GatherBlockQuantized embedding -> per layer [SimplifiedLayerNorm -> MatMulNBits QKV (fused)
    -> GroupQueryAttention (RoPE inside, grouped KV heads, past KV) -> MatMulNBits out -> residual
    -> SkipSimplifiedLayerNorm -> MatMulNBits gate|up (fused) -> SiLU * up -> MatMulNBits down]
    -> final norm -> slice the last `num_logits_to_keep` positions -> MatMulNBits LM head

Every linear weight is `com.microsoft::MatMulNBits`, block 32, no zero points. GGUF Q4_0 and Q8_0
blocks map onto it without loss (the nibbles are re-paired, the fp16 scales widened to fp32);
any other tensor type is dequantized and re-quantized (Q4_0 for block linears, Q8_0 for the LM
head and the embedding), which is logged and recorded in the config.

The directory holds:
    model.onnx, model.onnx.data    graph + weights (external data, so any size loads)
    model.genai.onnx               the same graph for onnxruntime-genai (all logits; same weights file)
    tokenizer.gguf                 the source's metadata without tensors: edgerun.tokenizer loads it
    edgerun.json                   what the directory is (architecture, shapes, vocabulary fingerprint,
                                   context length, source, edgerun.* metadata) -- read by backends/onnxrt.py
    genai_config.json              so onnxruntime-genai can run the same graph
"""

from __future__ import annotations

import json
import logging
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path


from ..errors import EdgerunError, ModelFormatError, ModelNotFound
from ..formats.arch import ModelConfig


log = logging.getLogger(__name__)


FORMAT = "edgerun-onnx"
FORMAT_VERSION = 1
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
CONFIG_FILE = "edgerun.json"
TOKENIZER_FILE = "tokenizer.gguf"
GENAI_CONFIG_FILE = "genai_config.json"
GENAI_MODEL_FILE = "model.genai.onnx"  # the same graph and weights with num_logits_to_keep fixed to 0

LOGITS_TO_KEEP = "num_logits_to_keep"   # edgerun's input: logits for the last k positions (0 = all)
BLOCK = 32                              # MatMulNBits block size: GGUF's Q4_0/Q8_0 block
OPSET = 17                              # default-domain opset; onnxruntime >= 1.14 runs it
IR_VERSION = 8                          # the IR version of opset 17 (older onnxruntimes refuse newer)
MAX_ROPE_POSITIONS = 32768              # default cap of the exported context (RoPE table rows)
INLINE_BYTES = 1024                    # tensors smaller than this stay inside model.onnx
ALIGN = 4096                           # offsets of external tensors (lets onnxruntime mmap them)


def past_key(i: int) -> str:
    return f"past_key_values.{i}.key"


def past_value(i: int) -> str:
    return f"past_key_values.{i}.value"


def present_key(i: int) -> str:
    return f"present.{i}.key"


def present_value(i: int) -> str:
    return f"present.{i}.value"


# ---------------------------------------------------------------------------------- config

@dataclass(frozen=True)
class OnnxModelConfig:
    """The contents of edgerun.json: what an exported directory holds."""

    model: ModelConfig                # the decoder's hyperparameters (flat keys in edgerun.json: MODEL_KEYS)
    n_ctx: int                        # positions the graph supports (rows of its RoPE table)
    rope_style: str                   # "norm" (adjacent pairs) | "neox" (halves)
    vocab_fingerprint: str
    weight_bytes: int                 # bytes of weights read per forward pass (cost model)
    accuracy_level: int
    bos_id: int
    eos_id: int
    source: dict = field(default_factory=dict)      # file name, size, sha256 of the source GGUF
    metadata: dict = field(default_factory=dict)    # edgerun.* keys of the source
    conversions: dict = field(default_factory=dict) # tensor -> "Q4_0->int4 (lossless)" | "...->int4 (requantized)"
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    model_file: str = MODEL_FILE
    tokenizer_file: str = TOKENIZER_FILE

    @property
    def lossless(self) -> bool:
        return all(v.endswith("(lossless)") for v in self.conversions.values())

    def to_json(self) -> dict:
        """edgerun.json's object: the model's hyperparameters flat beside the export's own keys."""
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "model"}
        return {**{key: getattr(self.model, attr) for key, attr in MODEL_KEYS.items()}, **own}


# edgerun.json key -> ModelConfig field (format_version 1 keeps them at the top level)
MODEL_KEYS = {"architecture": "arch", "n_vocab": "n_vocab", "n_embd": "n_embd", "n_layer": "n_layer", "n_ff": "n_ff",
              "n_head": "n_head", "n_head_kv": "n_head_kv", "head_dim": "head_dim", "n_ctx_train": "n_ctx_train",
              "rms_eps": "rms_eps", "rope_base": "rope_base"}


def read_config(directory: str | Path) -> OnnxModelConfig:
    """Read and check edgerun.json of an exported directory; ModelFormatError says what is wrong."""
    d = Path(directory)
    p = d / CONFIG_FILE
    if not d.is_dir():
        raise ModelNotFound(f"ONNX model directory not found: {d}")
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        raise ModelFormatError(f"{d} has no {CONFIG_FILE}; expected a directory written by "
                               f"`edgerun export onnx`") from None
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{p} is not valid JSON ({e}); re-export the model") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ModelFormatError(f"{p}: 'format' is {raw.get('format') if isinstance(raw, dict) else raw!r}, "
                               f"expected {FORMAT!r}")
    if raw.get("format_version") != FORMAT_VERSION:
        raise ModelFormatError(f"{p}: format_version {raw.get('format_version')!r} is not supported; "
                               f"expected {FORMAT_VERSION} (re-export with this edgerun)")
    own = {f.name: f for f in fields(OnnxModelConfig) if f.name != "model"}
    names = set(own) | set(MODEL_KEYS)
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ModelFormatError(f"{p}: unknown keys {unknown}; expected only {sorted(names)}")
    required = [*MODEL_KEYS, *(n for n, f in own.items() if f.default is MISSING and f.default_factory is MISSING)]
    missing = [n for n in required if n not in raw]
    if missing:
        raise ModelFormatError(f"{p}: missing keys {missing}; re-export the model")
    ints = ("n_vocab", "n_embd", "n_layer", "n_ff", "n_head", "n_head_kv", "head_dim", "n_ctx", "n_ctx_train",
            "weight_bytes", "accuracy_level", "bos_id", "eos_id")
    bad = [k for k in ints if not isinstance(raw[k], int) or isinstance(raw[k], bool)]
    if bad:
        raise ModelFormatError(f"{p}: {bad} must be integers, got {[raw[k] for k in bad]}")
    if raw["rope_style"] not in ("norm", "neox"):
        raise ModelFormatError(f"{p}: rope_style {raw['rope_style']!r}, expected 'norm' or 'neox'")
    try:
        model = ModelConfig(**{attr: raw.pop(key) for key, attr in MODEL_KEYS.items()})
    except EdgerunError as e:
        raise ModelFormatError(f"{p}: {e}; re-export the model") from None
    cfg = OnnxModelConfig(model=model, **raw)
    for f in (cfg.model_file, cfg.tokenizer_file):
        if not (d / f).is_file():
            raise ModelFormatError(f"{d} lacks {f}, which {CONFIG_FILE} names; re-export the model")
    return cfg




def is_onnx_dir(path: str | Path) -> bool:
    """True when `path` is a directory holding an edgerun ONNX export (edgerun.json)."""
    p = Path(path)
    return p.is_dir() and (p / CONFIG_FILE).is_file()
