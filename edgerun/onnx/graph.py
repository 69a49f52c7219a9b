"""The ONNX decoder graph: MatMulNBits linears, GroupQueryAttention, genai-compatible names.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..formats.arch import get_arch
from .layout import ALIGN, BLOCK, DATA_FILE, INLINE_BYTES, IR_VERSION, LOGITS_TO_KEEP, OPSET, past_key, past_value, present_key, present_value
from .weights import NBits, Source, rope_tables


log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------- graph

# onnx (the optional 'onnx' extra, ~2.4 s to import measured here) is imported inside the methods that build
# the graph, so that importing the exporter does not need it


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
        if a.nbytes < INLINE_BYTES:
            self.inits.append(numpy_helper.from_array(a, name))
            return name
        pad = -self._data.tell() % ALIGN
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
    ins = [x, b, s] if w.zeros is None else [x, b, s, g.init(f"{name}.zero_points", w.zeros)]
    (y,) = g.node("MatMulNBits", ins, domain="com.microsoft", name=f"{name}/MatMulNBits",
                  K=w.k, N=w.n, bits=w.bits, block_size=w.block, accuracy_level=accuracy_level)
    if bias is not None:
        (y,) = g.node("Add", [y, g.init(f"{name}.bias", bias.astype(np.float32))], name=f"{name}/Add")
    return y


def _fuse(ws: list[NBits]) -> NBits | None:
    """Stack the rows of linears that read the same input into one MatMulNBits (same bits and K)."""
    if len({(w.bits, w.k, w.block, w.zeros is None) for w in ws}) != 1:
        return None
    note = ws[0].note if len({w.note for w in ws}) == 1 else "; ".join(w.note for w in ws)
    zeros = None if ws[0].zeros is None else np.concatenate([w.zeros for w in ws])
    return NBits(ws[0].bits, np.concatenate([w.packed for w in ws]), np.concatenate([w.scales for w in ws]), note,
                 ws[0].block, zeros)


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


def _io(helper, TensorProto, cfg, kind: str) -> list:
    """The graph's inputs (kind 'in': ids, mask, past K/V per layer, logits to keep) or outputs ('out': logits,
    present K/V per layer), genai's names and dynamic axes."""
    Hkv, hd, L = cfg.n_head_kv, cfg.head_dim, cfg.n_layer
    if kind == "in":
        out = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
               helper.make_tensor_value_info("attention_mask", TensorProto.INT64,
                                             ["batch_size", "total_sequence_length"])]
        shape, key, value = ["batch_size", Hkv, "past_sequence_length", hd], past_key, past_value
    else:
        out = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "logits_length", cfg.n_vocab])]
        shape, key, value = ["batch_size", Hkv, "total_sequence_length", hd], present_key, present_value
    for i in range(L):
        out.append(helper.make_tensor_value_info(key(i), TensorProto.FLOAT, shape))
        out.append(helper.make_tensor_value_info(value(i), TensorProto.FLOAT, shape))
    if kind == "in":
        out.append(helper.make_tensor_value_info(LOGITS_TO_KEEP, TensorProto.INT64, [1]))
    return out


def _lengths(g: _Graph, TensorProto) -> tuple[str, str]:
    """GQA's lengths from the attention mask: seqlens_k = sum(mask) - 1, total = mask.shape[1]."""
    (msum,) = g.node("ReduceSum", ["attention_mask", g.const("axes_1", [1])], name="mask/ReduceSum", keepdims=0)
    (msub,) = g.node("Sub", [msum, g.const("one_i64", 1)], name="mask/Sub")
    (seqlens_k,) = g.node("Cast", [msub], name="mask/seqlens_k", to=TensorProto.INT32)
    (mshape,) = g.node("Shape", ["attention_mask"], name="mask/Shape")
    (tot64,) = g.node("Gather", [mshape, g.const("idx_1", 1)], name="mask/Gather", axis=0)
    (total,) = g.node("Cast", [tot64], name="mask/total_len", to=TensorProto.INT32)
    return seqlens_k, total


class _Builder:
    """What the decoder's parts share while the graph is built: the source, the graph, the conversion notes
    and the weight bytes read per forward."""

    def __init__(self, src: Source, g: _Graph, accuracy_level: int) -> None:
        self.src, self.g, self.acc = src, g, accuracy_level
        self.cfg, self.spec = src.cfg, get_arch(src.arch)
        self.conv: dict[str, str] = {}
        self.weight_bytes = 0

    def load(self, name: str, requant: str = "q4_0") -> NBits:
        w = self.src.nbits(name, requant)
        self.conv[name] = w.note
        return w

    def vec(self, name: str) -> np.ndarray:
        return self.src.float32(name).reshape(-1)

    def embedding(self) -> tuple[NBits, str, str]:
        """GatherBlockQuantized on the MatMulNBits-layout table (shared with a tied LM head): (table, its packed
        initializer, h [B, S, D])."""
        g = self.g
        emb = self.load("token_embd.weight", requant="q8_0")
        emb_q = g.init("token_embd.qweight", emb.packed)                                  # [V, nb, 32*bits/8]
        emb_s = g.init("token_embd.gather_scales", emb.scales[..., None])                 # [V, nb, 1]
        (e,) = g.node("GatherBlockQuantized", [emb_q, "input_ids", emb_s], domain="com.microsoft",
                      name="embed/GatherBlockQuantized", bits=emb.bits, block_size=BLOCK, gather_axis=0,
                      quantize_axis=2)                                                    # [B, S, nb, 32]
        (h,) = g.node("Reshape", [e, g.const("embed_shape", [0, 0, self.cfg.n_embd])], name="embed/Reshape")
        return emb, emb_q, h

    def block(self, i: int, x: str, h: str, lengths: tuple[str, str], rope: tuple[str, str]) -> tuple[str, str]:
        """Layer i: attention (fused QKV, GroupQueryAttention with rotary), the FFN (fused gate/up, SiLU), each
        behind SkipSimplifiedLayerNormalization; returns (the next layer's normed input, the residual)."""
        g, cfg, acc, p = self.g, self.cfg, self.acc, f"blk.{i}."
        names = ("attn_q", "attn_k", "attn_v")
        qkv = [self.load(p + n + ".weight") for n in names]
        self.weight_bytes += sum(w.nbytes for w in qkv)
        bias = None
        if any(p + n + ".bias" in self.src.names for n in names):
            bias = np.concatenate([self.vec(p + n + ".bias") if p + n + ".bias" in self.src.names
                                   else np.zeros(w.n, np.float32) for n, w in zip(names, qkv)])
        y = _linears(g, x, qkv, p + "attn_qkv", acc, bias)                             # [B, S, (H + 2 Hkv) hd]
        attn, _, _ = g.node("GroupQueryAttention", [y, "", "", past_key(i), past_value(i), *lengths, *rope],
                            domain="com.microsoft", name=p + "attn/GroupQueryAttention",
                            outputs=[p + "attn/out", present_key(i), present_value(i)],
                            num_heads=cfg.n_head, kv_num_heads=cfg.n_head_kv, do_rotary=1, local_window_size=-1,
                            rotary_interleaved=1 if self.spec.rope_style == "norm" else 0,
                            scale=float(1.0 / np.sqrt(cfg.head_dim)))                 # [B, S, H hd]
        wo = self.load(p + "attn_output.weight")
        self.weight_bytes += wo.nbytes
        o = _matmul(g, attn, wo, p + "attn_output", acc)
        x, _, _, h = g.node("SkipSimplifiedLayerNormalization",
                            [o, h, g.init(p + "ffn_norm.weight", self.vec(p + "ffn_norm.weight"))],
                            n_out=4, domain="com.microsoft", name=p + "ffn_norm", epsilon=cfg.rms_eps)
        gu = [self.load(p + "ffn_gate.weight"), self.load(p + "ffn_up.weight")]
        wd = self.load(p + "ffn_down.weight")
        self.weight_bytes += sum(w.nbytes for w in gu) + wd.nbytes
        y = _linears(g, x, gu, p + "ffn_gate_up", acc, None)                           # [B, S, 2 n_ff]
        gate, up = g.node("Split", [y, g.const(p + "ffn_split", [gu[0].n, gu[1].n])], n_out=2,
                          name=p + "ffn/Split", axis=-1)
        (sg,) = g.node("Sigmoid", [gate], name=p + "ffn/Sigmoid")
        (silu,) = g.node("Mul", [gate, sg], name=p + "ffn/SiLU")
        (act,) = g.node("Mul", [silu, up], name=p + "ffn/Mul")                          # [B, S, n_ff]
        m = _matmul(g, act, wd, p + "ffn_down", acc)
        nxt = f"blk.{i + 1}.attn_norm.weight" if i + 1 < cfg.n_layer else "output_norm.weight"
        x, _, _, h = g.node("SkipSimplifiedLayerNormalization", [m, h, g.init(nxt, self.vec(nxt))], n_out=4,
                            domain="com.microsoft", name=nxt.rsplit(".", 1)[0], epsilon=cfg.rms_eps)
        return x, h

    def head(self, x: str, emb: NBits, emb_q: str) -> None:
        """The LM head on the last k positions (k = num_logits_to_keep if > 0, else all): 'logits'."""
        g = self.g
        (xshape,) = g.node("Shape", [x], name="head/Shape")
        (s_len,) = g.node("Gather", [xshape, g.const("idx_1b", [1])], name="head/seq_len", axis=0)        # [1]
        k_in = LOGITS_TO_KEEP                                                                           # [1]
        (k_min,) = g.node("Min", [k_in, s_len], name="head/Min")
        (pos,) = g.node("Greater", [k_in, g.const("zero_1", [0])], name="head/Greater")
        (k,) = g.node("Where", [pos, k_min, s_len], name="head/Where")
        (start,) = g.node("Sub", [s_len, k], name="head/start")
        (xs,) = g.node("Slice", [x, start, g.const("int64_max", [np.iinfo(np.int64).max]), g.const("axes_1b", [1])],
                       name="head/Slice")                                                  # [B, k, D]
        if self.cfg.tied:
            lm, b = emb, emb_q
            s = g.init("lm_head.scales", lm.scales)
        else:
            lm = self.load("output.weight", requant="q8_0")
            b = g.init("lm_head.qweight", lm.packed)
            s = g.init("lm_head.scales", lm.scales)
        g.node("MatMulNBits", [xs, b, s], domain="com.microsoft", name="lm_head/MatMulNBits", outputs=["logits"],
               K=lm.k, N=lm.n, bits=lm.bits, block_size=BLOCK, accuracy_level=self.acc)
        self.weight_bytes += lm.nbytes


def build(src: Source, n_ctx: int, accuracy_level: int, data_path: Path
          ) -> tuple[Any, int, dict[str, str]]:
    """The ONNX ModelProto, weight bytes per forward, and the per-tensor conversion notes."""
    from onnx import TensorProto, helper

    cfg = src.cfg
    g = _Graph(data_path)
    b = _Builder(src, g, accuracy_level)
    inputs = _io(helper, TensorProto, cfg, "in")
    lengths = _lengths(g, TensorProto)
    cos, sin = rope_tables(src, cfg, n_ctx)
    rope = (g.init("rope.cos_cache", cos), g.init("rope.sin_cache", sin))
    emb, emb_q, h = b.embedding()
    norm0 = g.init("blk.0.attn_norm.weight", b.vec("blk.0.attn_norm.weight"))
    (x,) = g.node("SimplifiedLayerNormalization", [h, norm0], name="blk.0/attn_norm", axis=-1, epsilon=cfg.rms_eps,
                  stash_type=1)
    for i in range(cfg.n_layer):
        x, h = b.block(i, x, h, lengths, rope)
    b.head(x, emb, emb_q)
    g.close()
    graph = helper.make_graph(g.nodes, f"edgerun-{src.arch}", inputs, _io(helper, TensorProto, cfg, "out"),
                              initializer=g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid("com.microsoft", 1)],
                              producer_name="edgerun")
    model.ir_version = IR_VERSION
    return model, b.weight_bytes, b.conv
