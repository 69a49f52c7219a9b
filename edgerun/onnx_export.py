"""Export a llama-like GGUF (llama, qwen2) to an ONNX decoder directory that onnxruntime runs.

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
import os
import shutil
import tempfile
from dataclasses import MISSING, asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .arch import ModelConfig, get_arch
from .errors import InvalidArgument, ModelFormatError, ModelNotFound
from .quant.formats import q4_0_to_matmulnbits

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
_INLINE_BYTES = 1024                    # tensors smaller than this stay inside model.onnx
_ALIGN = 4096                           # offsets of external tensors (lets onnxruntime mmap them)


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

    architecture: str
    n_vocab: int                      # rows of the logits
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ctx: int                        # positions the graph supports (rows of its RoPE table)
    n_ctx_train: int
    rms_eps: float
    rope_base: float
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
    names = set(OnnxModelConfig.__dataclass_fields__)
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ModelFormatError(f"{p}: unknown keys {unknown}; expected only {sorted(names)}")
    required = [n for n, f in OnnxModelConfig.__dataclass_fields__.items()
                if f.default is MISSING and f.default_factory is MISSING]
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
    cfg = OnnxModelConfig(**raw)
    for f in (cfg.model_file, cfg.tokenizer_file):
        if not (d / f).is_file():
            raise ModelFormatError(f"{d} lacks {f}, which {CONFIG_FILE} names; re-export the model")
    return cfg


# ---------------------------------------------------------------------------------- weights

@dataclass(frozen=True)
class NBits:
    """One linear weight in MatMulNBits layout: packed uint8 [N, K/32, 32*bits/8], scales f32 [N, K/32]."""

    bits: int
    packed: np.ndarray
    scales: np.ndarray
    note: str                          # "Q4_0->int4 (lossless)" etc.

    @property
    def n(self) -> int:
        return self.packed.shape[0]

    @property
    def k(self) -> int:
        return self.packed.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes


def q8_0_to_nbits(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q8_0 rows -> MatMulNBits int8 (packed, scales); lossless (value = (u - 128) * d)."""
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, -1, 34)     # [N, nb, 2 + 32]
    d = blocks[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)    # [N, nb]
    q = blocks[:, :, 2:].view(np.int8).astype(np.int16) + 128                  # [N, nb, 32] in 1..255
    return q.astype(np.uint8), d


def nbits_dequantize(w: NBits) -> np.ndarray:
    """Float32 [N, K] of a MatMulNBits weight (tests and diagnostics)."""
    if w.bits == 4:
        q = np.stack([w.packed & 0x0F, w.packed >> 4], axis=-1).reshape(w.n, -1, BLOCK)   # [N, nb, 32]
    else:
        q = w.packed
    zero = 1 << (w.bits - 1)
    return ((q.astype(np.float32) - zero) * w.scales[..., None]).reshape(w.n, w.k)


class _Source:
    """The exporter's view of a model (edgerun.gguf_io): metadata, and each weight as MatMulNBits."""

    def __init__(self, path: Path) -> None:
        from .gguf_io import GGUFSource, open_source
        from .llama_lib import check_gguf

        if not path.exists():
            raise ModelNotFound(f"model not found: {path}; expected a .gguf file or a Hugging Face "
                                f"checkpoint directory")
        if path.is_file():
            check_gguf(path)                 # clear errors for truncated / non-GGUF files
        self.path = path
        self.src = open_source(path)
        self.is_gguf = isinstance(self.src, GGUFSource)
        self.cfg: ModelConfig = self.src.cfg
        self.arch = self.cfg.arch
        self.names = set(self.src.tensor_names())

    def get(self, key: str, default: Any = None) -> Any:
        return self.src.get(key, default)

    def edgerun_metadata(self) -> dict:
        if not self.is_gguf:
            return {}
        return {kv.key: kv.value for kv in self.src.kv() if kv.key.startswith("edgerun.")}

    def float32(self, name: str) -> np.ndarray:
        """A tensor as float32 in GGUF layout ([out, in] for matrices), dequantized if stored quantized."""
        return np.ascontiguousarray(self.src.tensor(name), dtype=np.float32)

    def nbits(self, name: str, requant: str = "q4_0") -> NBits:
        """A 2-D weight as MatMulNBits: Q4_0/Q8_0 blocks as they are, anything else re-quantized to `requant`."""
        import gguf

        from .quant.formats import pack

        T = gguf.GGMLQuantizationType
        kind = self.src.tensor_type(name) if self.is_gguf else None
        if kind == T.Q4_0:
            packed, d = q4_0_to_matmulnbits(np.asarray(self.src.raw(name)))
            return NBits(4, packed, d, "Q4_0->int4 (lossless)")
        if kind == T.Q8_0:
            packed, d = q8_0_to_nbits(np.asarray(self.src.raw(name)))
            return NBits(8, packed, d, "Q8_0->int8 (lossless)")
        w = self.float32(name)                                       # [N, K]
        if w.ndim != 2 or w.shape[1] % BLOCK:
            raise ModelFormatError(f"{self.path}: {name} has shape {w.shape}; MatMulNBits needs a matrix whose "
                                   f"rows are a multiple of {BLOCK} long")
        raw = pack(requant, w)
        what = kind.name if kind is not None else "float"
        log.info("%s: %s re-quantized to %s for MatMulNBits", name, what, requant.upper())
        if requant == "q4_0":
            packed, d = q4_0_to_matmulnbits(raw)
            return NBits(4, packed, d, f"{what}->Q4_0->int4 (requantized)")
        packed, d = q8_0_to_nbits(raw)
        return NBits(8, packed, d, f"{what}->Q8_0->int8 (requantized)")


def _rope_tables(src: _Source, cfg: ModelConfig, n_ctx: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [n_ctx, head_dim/2] float32 as llama.cpp rotates (base, linear scaling, freq factors)."""
    arch = src.arch
    n_rot = int(src.get(f"{arch}.rope.dimension_count", cfg.head_dim))
    if n_rot != cfg.head_dim:
        raise ModelFormatError(f"{src.path}: partial RoPE ({n_rot} of {cfg.head_dim} dims) is not supported; "
                               f"expected rope.dimension_count == head_dim")
    scaling = src.get(f"{arch}.rope.scaling.type", "none")
    factor = float(src.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    if scaling not in ("none", "linear") and factor != 1.0:
        raise ModelFormatError(f"{src.path}: RoPE scaling {scaling!r} is not supported by the ONNX export; "
                               f"expected none or linear")
    inv = cfg.rope_base ** (-np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim)   # [hd/2]
    if "rope_freqs.weight" in src.names:
        inv = inv / src.float32("rope_freqs.weight").astype(np.float64).reshape(-1)
    pos = np.arange(n_ctx, dtype=np.float64) / (factor if scaling == "linear" else 1.0)
    ang = pos[:, None] * inv[None, :]                                                             # [n_ctx, hd/2]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


# ---------------------------------------------------------------------------------- graph

class _Graph:
    """Nodes, initializers (big ones streamed to the external data file) and value infos."""

    def __init__(self, data_path: Path) -> None:
        self.nodes: list = []
        self.inits: list = []
        self._data = open(data_path, "wb")
        self._names: set[str] = set()
        self._n = 0

    def close(self) -> None:
        self._data.flush()
        os.fsync(self._data.fileno())
        self._data.close()

    def init(self, name: str, a: np.ndarray) -> str:
        from onnx import TensorProto, helper, numpy_helper

        if name in self._names:
            raise AssertionError(f"duplicate initializer {name}")
        self._names.add(name)
        a = np.ascontiguousarray(a)
        if a.nbytes < _INLINE_BYTES:
            self.inits.append(numpy_helper.from_array(a, name))
            return name
        pad = -self._data.tell() % _ALIGN
        self._data.write(b"\0" * pad)
        off = self._data.tell()
        self._data.write(a.tobytes())
        t = TensorProto()
        t.name = name
        t.data_type = helper.np_dtype_to_tensor_dtype(a.dtype)
        t.dims.extend(a.shape)
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", DATA_FILE), ("offset", str(off)), ("length", str(a.nbytes))):
            e = t.external_data.add()
            e.key, e.value = k, v
        self.inits.append(t)
        return name

    def node(self, op: str, inputs: list[str], n_out: int = 1, domain: str = "", name: str | None = None,
             outputs: list[str] | None = None, **attrs) -> list[str]:
        from onnx import helper

        self._n += 1
        name = name or f"{op}_{self._n}"
        outs = outputs or [f"{name}/out{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=name, domain=domain or None, **attrs))
        return outs

    def const(self, name: str, values, dtype=np.int64) -> str:
        return self.init(name, np.asarray(values, dtype=dtype))


def _matmul(g: _Graph, x: str, w: NBits, name: str, accuracy_level: int, bias: np.ndarray | None = None) -> str:
    b = g.init(f"{name}.qweight", w.packed)
    s = g.init(f"{name}.scales", w.scales)
    (y,) = g.node("MatMulNBits", [x, b, s], domain="com.microsoft", name=f"{name}/MatMulNBits",
                  K=w.k, N=w.n, bits=w.bits, block_size=BLOCK, accuracy_level=accuracy_level)
    if bias is not None:
        (y,) = g.node("Add", [y, g.init(f"{name}.bias", bias.astype(np.float32))], name=f"{name}/Add")
    return y


def _fuse(ws: list[NBits]) -> NBits | None:
    """Stack the rows of linears that read the same input into one MatMulNBits (same bits and K)."""
    if len({(w.bits, w.k) for w in ws}) != 1:
        return None
    note = ws[0].note if len({w.note for w in ws}) == 1 else "; ".join(w.note for w in ws)
    return NBits(ws[0].bits, np.concatenate([w.packed for w in ws]), np.concatenate([w.scales for w in ws]), note)


def _linears(g: _Graph, x: str, ws: list[NBits], name: str, acc: int, bias: np.ndarray | None) -> str:
    """y [.., sum N] = x @ [W1; W2; ...]^T (+ bias): one fused matmul, or one per weight and a Concat."""
    fused = _fuse(ws)
    if fused is not None:
        return _matmul(g, x, fused, name, acc, bias)
    ys = [_matmul(g, x, w, f"{name}.{j}", acc) for j, w in enumerate(ws)]
    (y,) = g.node("Concat", ys, name=f"{name}/Concat", axis=-1)
    if bias is not None:
        (y,) = g.node("Add", [y, g.init(f"{name}.bias", bias.astype(np.float32))], name=f"{name}/Add")
    return y


def _build(src: _Source, n_ctx: int, accuracy_level: int, data_path: Path
           ) -> tuple[Any, int, dict[str, str]]:
    """The ONNX ModelProto, weight bytes per forward, and the per-tensor conversion notes."""
    from onnx import TensorProto, helper

    cfg = src.cfg
    spec = get_arch(src.arch)
    D, H, Hkv, hd, L = cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_layer
    V = cfg.n_vocab
    conv: dict[str, str] = {}
    weight_bytes = 0
    g = _Graph(data_path)

    def load(name: str, requant: str = "q4_0") -> NBits:
        w = src.nbits(name, requant)
        conv[name] = w.note
        return w

    def vec(name: str) -> np.ndarray:
        return src.float32(name).reshape(-1)

    # graph inputs
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64,
                                            ["batch_size", "total_sequence_length"])]
    kv_shape = ["batch_size", Hkv, "past_sequence_length", hd]
    present_shape = ["batch_size", Hkv, "total_sequence_length", hd]
    for i in range(L):
        inputs.append(helper.make_tensor_value_info(past_key(i), TensorProto.FLOAT, kv_shape))
        inputs.append(helper.make_tensor_value_info(past_value(i), TensorProto.FLOAT, kv_shape))
    inputs.append(helper.make_tensor_value_info(LOGITS_TO_KEEP, TensorProto.INT64, [1]))

    # GQA's lengths from the attention mask: seqlens_k = sum(mask) - 1, total = mask.shape[1]
    (msum,) = g.node("ReduceSum", ["attention_mask", g.const("axes_1", [1])], name="mask/ReduceSum", keepdims=0)
    (msub,) = g.node("Sub", [msum, g.const("one_i64", 1)], name="mask/Sub")
    (seqlens_k,) = g.node("Cast", [msub], name="mask/seqlens_k", to=TensorProto.INT32)
    (mshape,) = g.node("Shape", ["attention_mask"], name="mask/Shape")
    (tot64,) = g.node("Gather", [mshape, g.const("idx_1", 1)], name="mask/Gather", axis=0)
    (total,) = g.node("Cast", [tot64], name="mask/total_len", to=TensorProto.INT32)
    cos, sin = _rope_tables(src, cfg, n_ctx)
    cos_n, sin_n = g.init("rope.cos_cache", cos), g.init("rope.sin_cache", sin)

    # embedding: GatherBlockQuantized on the MatMulNBits-layout table (shared with a tied LM head)
    emb = load("token_embd.weight", requant="q8_0")
    emb_q = g.init("token_embd.qweight", emb.packed)                                  # [V, nb, 32*bits/8]
    emb_s = g.init("token_embd.gather_scales", emb.scales[..., None])                 # [V, nb, 1]
    (e,) = g.node("GatherBlockQuantized", [emb_q, "input_ids", emb_s], domain="com.microsoft",
                  name="embed/GatherBlockQuantized", bits=emb.bits, block_size=BLOCK, gather_axis=0,
                  quantize_axis=2)                                                    # [B, S, nb, 32]
    (h,) = g.node("Reshape", [e, g.const("embed_shape", [0, 0, D])], name="embed/Reshape")

    (x,) = g.node("SimplifiedLayerNormalization", [h, g.init("blk.0.attn_norm.weight", vec("blk.0.attn_norm.weight"))],
                  name="blk.0/attn_norm", axis=-1, epsilon=cfg.rms_eps, stash_type=1)
    for i in range(L):
        p = f"blk.{i}."
        qkv = [load(p + n + ".weight") for n in ("attn_q", "attn_k", "attn_v")]
        weight_bytes += sum(w.nbytes for w in qkv)
        bias = None
        if any(p + n + ".bias" in src.names for n in ("attn_q", "attn_k", "attn_v")):
            bias = np.concatenate([vec(p + n + ".bias") if p + n + ".bias" in src.names
                                   else np.zeros(w.n, np.float32) for n, w in zip(("attn_q", "attn_k", "attn_v"), qkv)])
        y = _linears(g, x, qkv, p + "attn_qkv", accuracy_level, bias)                 # [B, S, (H + 2 Hkv) hd]
        attn, _, _ = g.node("GroupQueryAttention", [y, "", "", past_key(i), past_value(i), seqlens_k, total,
                                                    cos_n, sin_n],
                            domain="com.microsoft", name=p + "attn/GroupQueryAttention",
                            outputs=[p + "attn/out", present_key(i), present_value(i)],
                            num_heads=H, kv_num_heads=Hkv, do_rotary=1, local_window_size=-1,
                            rotary_interleaved=1 if spec.rope_style == "norm" else 0,
                            scale=float(1.0 / np.sqrt(hd)))                             # [B, S, H hd]
        wo = load(p + "attn_output.weight")
        weight_bytes += wo.nbytes
        o = _matmul(g, attn, wo, p + "attn_output", accuracy_level)
        x, _, _, h = g.node("SkipSimplifiedLayerNormalization", [o, h, g.init(p + "ffn_norm.weight", vec(p + "ffn_norm.weight"))],
                            n_out=4, domain="com.microsoft", name=p + "ffn_norm", epsilon=cfg.rms_eps)
        gu = [load(p + "ffn_gate.weight"), load(p + "ffn_up.weight")]
        wd = load(p + "ffn_down.weight")
        weight_bytes += sum(w.nbytes for w in gu) + wd.nbytes
        y = _linears(g, x, gu, p + "ffn_gate_up", accuracy_level, None)               # [B, S, 2 n_ff]
        gate, up = g.node("Split", [y, g.const(p + "ffn_split", [gu[0].n, gu[1].n])], n_out=2,
                          name=p + "ffn/Split", axis=-1)
        (sg,) = g.node("Sigmoid", [gate], name=p + "ffn/Sigmoid")
        (silu,) = g.node("Mul", [gate, sg], name=p + "ffn/SiLU")
        (act,) = g.node("Mul", [silu, up], name=p + "ffn/Mul")                          # [B, S, n_ff]
        m = _matmul(g, act, wd, p + "ffn_down", accuracy_level)
        nxt = f"blk.{i + 1}.attn_norm.weight" if i + 1 < L else "output_norm.weight"
        x, _, _, h = g.node("SkipSimplifiedLayerNormalization", [m, h, g.init(nxt, vec(nxt))], n_out=4,
                            domain="com.microsoft", name=nxt.rsplit(".", 1)[0], epsilon=cfg.rms_eps)

    # keep the last k positions: k = num_logits_to_keep if > 0 else all
    (xshape,) = g.node("Shape", [x], name="head/Shape")
    (s_len,) = g.node("Gather", [xshape, g.const("idx_1b", [1])], name="head/seq_len", axis=0)        # [1]
    k_in = LOGITS_TO_KEEP                                                                           # [1]
    (k_min,) = g.node("Min", [k_in, s_len], name="head/Min")
    (pos,) = g.node("Greater", [k_in, g.const("zero_1", [0])], name="head/Greater")
    (k,) = g.node("Where", [pos, k_min, s_len], name="head/Where")
    (start,) = g.node("Sub", [s_len, k], name="head/start")
    (xs,) = g.node("Slice", [x, start, g.const("int64_max", [np.iinfo(np.int64).max]), g.const("axes_1b", [1])],
                   name="head/Slice")                                                  # [B, k, D]
    if cfg.tied:
        lm = emb
        lm_b = g.init("lm_head.scales", lm.scales)
        (logits,) = g.node("MatMulNBits", [xs, emb_q, lm_b], domain="com.microsoft", name="lm_head/MatMulNBits",
                           outputs=["logits"], K=lm.k, N=lm.n, bits=lm.bits, block_size=BLOCK,
                           accuracy_level=accuracy_level)
    else:
        lm = load("output.weight", requant="q8_0")
        b = g.init("lm_head.qweight", lm.packed)
        s = g.init("lm_head.scales", lm.scales)
        (logits,) = g.node("MatMulNBits", [xs, b, s], domain="com.microsoft", name="lm_head/MatMulNBits",
                           outputs=["logits"], K=lm.k, N=lm.n, bits=lm.bits, block_size=BLOCK,
                           accuracy_level=accuracy_level)
    weight_bytes += lm.nbytes
    g.close()

    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "logits_length", V])]
    for i in range(L):
        outputs.append(helper.make_tensor_value_info(present_key(i), TensorProto.FLOAT, present_shape))
        outputs.append(helper.make_tensor_value_info(present_value(i), TensorProto.FLOAT, present_shape))
    graph = helper.make_graph(g.nodes, f"edgerun-{src.arch}", inputs, outputs, initializer=g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid("com.microsoft", 1)],
                              producer_name="edgerun")
    model.ir_version = IR_VERSION
    return model, weight_bytes, conv


# ---------------------------------------------------------------------------------- side files

def _write_tokenizer_gguf(src: _Source, path: Path) -> None:
    """The source's metadata (tokenizer.*, hyperparameters, general.*) and no tensors."""
    import gguf

    from .gguf_io import source_kv

    w = gguf.GGUFWriter(str(path), src.arch)
    for kv in source_kv(src.src):
        if kv.sub_type == gguf.GGUFValueType.ARRAY:
            log.warning("skipping nested-array metadata key %s", kv.key)
            continue
        w.add_key_value(kv.key, kv.value, kv.vtype, sub_type=kv.sub_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _genai_config(cfg: OnnxModelConfig, eos_ids: list[int]) -> dict:
    return {
        "model": {
            "bos_token_id": cfg.bos_id,
            "context_length": cfg.n_ctx,
            "eos_token_id": eos_ids if len(eos_ids) > 1 else eos_ids[0],
            "pad_token_id": cfg.eos_id,
            "type": cfg.architecture,
            "vocab_size": cfg.n_vocab,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": GENAI_MODEL_FILE,
                "head_size": cfg.head_dim,
                "hidden_size": cfg.n_embd,
                "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                           "past_key_names": "past_key_values.%d.key",
                           "past_value_names": "past_key_values.%d.value"},
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
                "num_attention_heads": cfg.n_head,
                "num_hidden_layers": cfg.n_layer,
                "num_key_value_heads": cfg.n_head_kv,
            },
        },
        "search": {"diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
                   "max_length": cfg.n_ctx, "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
                   "num_return_sequences": 1, "past_present_share_buffer": False, "repetition_penalty": 1.0,
                   "temperature": 1.0, "top_k": 1, "top_p": 1.0},
    }


def _genai_variant(model):
    """The graph without the num_logits_to_keep input (a constant 0: logits for every position).

    onnxruntime-genai feeds only the inputs it knows; both files read the same model.onnx.data.
    """
    from onnx import numpy_helper

    m = type(model)()
    m.CopyFrom(model)
    keep = [i for i in m.graph.input if i.name != LOGITS_TO_KEEP]
    del m.graph.input[:]
    m.graph.input.extend(keep)
    m.graph.initializer.append(numpy_helper.from_array(np.zeros(1, np.int64), LOGITS_TO_KEEP))
    return m


def _save(model, path: Path) -> None:
    import onnx

    onnx.save_model(model, str(path))
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------- entry point

def is_onnx_dir(path: str | Path) -> bool:
    """True when `path` is a directory holding an edgerun ONNX export (edgerun.json)."""
    p = Path(path)
    return p.is_dir() and (p / CONFIG_FILE).is_file()


def export_onnx(src: str | Path, out_dir: str | Path, *, n_ctx: int | None = None, accuracy_level: int = 4,
                force: bool = False, progress: Callable[[str], None] | None = None) -> Path:
    """Write the ONNX decoder of GGUF `src` into `out_dir` (created atomically); return out_dir.

    n_ctx: positions the graph supports (default: the model's training context, at most 32768).
    accuracy_level: MatMulNBits' activation precision (4 = int8, onnxruntime's fast CPU path;
    1 = fp32, the exact product of the dequantized weights). force: replace an existing export.
    """
    from .tokenizer import Tokenizer

    src_path = Path(src)
    out = Path(out_dir)
    if accuracy_level not in (0, 1, 2, 3, 4):
        raise InvalidArgument(f"accuracy_level must be 0..4 (4 = int8, 1 = fp32), got {accuracy_level!r}")
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        if not (force and is_onnx_dir(out)):
            raise InvalidArgument(f"{out} already exists; expected a new or empty directory "
                                  f"(pass force=True / --force to replace an earlier export)")
    s = _Source(src_path)
    cfg = s.cfg
    if n_ctx is None:
        n_ctx = min(cfg.n_ctx_train or MAX_ROPE_POSITIONS, MAX_ROPE_POSITIONS)
    if not isinstance(n_ctx, int) or n_ctx < 16:
        raise InvalidArgument(f"n_ctx must be an integer >= 16, got {n_ctx!r}")
    for name, v in (("n_embd", cfg.n_embd), ("n_ff", cfg.n_ff), ("n_head*head_dim", cfg.n_head * cfg.head_dim)):
        if v % BLOCK:
            raise ModelFormatError(f"{src_path}: {name} = {v} is not a multiple of {BLOCK}; "
                                   f"MatMulNBits blocks need that")
    say = progress or (lambda msg: None)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        say(f"reading {src_path.name} ({cfg.arch}, {cfg.n_layer} layers, d {cfg.n_embd}, vocab {cfg.n_vocab})")
        _write_tokenizer_gguf(s, tmp / TOKENIZER_FILE)
        tok = Tokenizer.from_gguf(tmp / TOKENIZER_FILE)
        say("building the graph (MatMulNBits int4, GroupQueryAttention)")
        model, weight_bytes, conv = _build(s, n_ctx, accuracy_level, tmp / DATA_FILE)
        _save(model, tmp / MODEL_FILE)
        _save(_genai_variant(model), tmp / GENAI_MODEL_FILE)
        lossy = sorted(k for k, v in conv.items() if not v.endswith("(lossless)"))
        if lossy:
            log.warning("%d of %d weight tensors were re-quantized (not lossless), e.g. %s: %s",
                        len(lossy), len(conv), lossy[0], conv[lossy[0]])
        ocfg = OnnxModelConfig(
            architecture=s.arch, n_vocab=cfg.n_vocab, n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_ff=cfg.n_ff,
            n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, head_dim=cfg.head_dim, n_ctx=n_ctx,
            n_ctx_train=cfg.n_ctx_train, rms_eps=cfg.rms_eps, rope_base=cfg.rope_base,
            rope_style=get_arch(s.arch).rope_style, vocab_fingerprint=tok.vocab_fingerprint,
            weight_bytes=int(weight_bytes), accuracy_level=accuracy_level,
            bos_id=int(tok.bos_id), eos_id=int(tok.eos_id),
            source={"file": src_path.name, "sha256": s.src.sha256(),
                    "name": s.get("general.name", None) or src_path.stem},
            metadata=_jsonable(s.edgerun_metadata()), conversions=conv)
        _write_json(tmp / CONFIG_FILE, asdict(ocfg))
        eos = sorted({int(tok.eos_id)} | {t for t in range(tok.n_vocab) if tok.is_eog(t)})
        _write_json(tmp / GENAI_CONFIG_FILE, _genai_config(ocfg, eos))
        _fsync_dir(tmp)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"wrote {out} ({(out / DATA_FILE).stat().st_size / 1e6:.1f} MB of weights)")
    log.info("exported %s -> %s (%d weight bytes per forward)", src_path, out, weight_bytes)
    return out


def _jsonable(d: dict) -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, (np.generic,)):
            v = v.item()
        out[k] = v if isinstance(v, (str, int, float, bool, list, type(None))) else str(v)
    return out


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished temp directory to `out`, replacing an empty dir or an earlier export."""
    old = None
    if out.exists():
        if any(out.iterdir()):
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.rename(out, old)
        else:
            out.rmdir()
    os.rename(tmp, out)
    _fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old)


__all__ = ["export_onnx", "read_config", "is_onnx_dir", "OnnxModelConfig", "q8_0_to_nbits",
           "nbits_dequantize", "NBits"]
