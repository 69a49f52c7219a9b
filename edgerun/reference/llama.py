"""Numpy forward of llama-like decoders (llama, qwen2): the correctness oracle and the AWQ calibrator.

Weights are a dict of GGUF-named arrays in GGUF layout (linear weights [out, in]; llama Q/K rows
permuted as llama.cpp stores them), driven by the tables of `edgerun.formats.arch`. The computation is
deterministic: same weights, same tokens, same dtype -> the same bits.

Stable API (other modules and the reference backend build on it):

    model = ReferenceModel.from_gguf(path, dtype=np.float64)    # any GGUF `gguf` can dequantize
    model = ReferenceModel.from_weights(cfg, tensors, dtype=np.float64)
    cache = model.new_cache()                                    # KVCache; cache.n_past, cache.truncate(n)
    logits = model.forward(tokens, cache)                        # [len(tokens), n_vocab], appends to cache
    model.forward(tokens)                                        # no cache: a fresh sequence

Lower level (used by the AWQ pipeline, batches of sequences):

    x = model.embed(tokens)                                      # [..., n_embd]
    x = block_forward(cfg, block_weights(tensors, i), x, pos0=0, record=dict)   # x [B, T, d]
    logits = model.head(x)
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, MutableMapping, Sequence

import numpy as np

from ..errors import InvalidArgument
from ..formats.arch import ModelConfig
from ..formats.gguf import GGUFSource


# ----------------------------------------------------------------------------- building blocks

def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x [..., d] * w [d] / rms(x)."""
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(ms + eps) * w


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def rope_cos_sin(pos: np.ndarray, head_dim: int, base: float, dtype) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [T, head_dim/2] for positions pos [T]; theta_i = pos * base^(-2i/head_dim)."""
    inv = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)   # [hd/2]
    ang = pos.astype(np.float64)[:, None] * inv[None, :]                      # [T, hd/2]
    return np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> np.ndarray:
    """Rotate x [B, H, T, hd] by position. style 'norm': pairs (2i, 2i+1); 'neox': pairs (i, i+hd/2)."""
    half = x.shape[-1] // 2
    if style == "norm":
        a, b = x[..., 0::2], x[..., 1::2]                 # [B, H, T, hd/2] each
    else:
        a, b = x[..., :half], x[..., half:]
    ra = a * cos - b * sin
    rb = a * sin + b * cos
    if style == "norm":
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = ra, rb
        return out
    return np.concatenate([ra, rb], axis=-1)


def linear(x: np.ndarray, w: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    """x [..., in] @ W[out, in]^T (+ bias [out])."""
    y = x @ w[name + ".weight"].T
    b = w.get(name + ".bias")
    return y if b is None else y + b


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_past: int) -> np.ndarray:
    """Causal GQA attention. q [B, H, T, hd], k/v [B, Hkv, n_past+T, hd] -> [B, H, T, hd]."""
    B, H, T, hd = q.shape
    hkv = k.shape[1]
    qg = q.reshape(B, hkv, H // hkv, T, hd)                 # [B, Hkv, rep, T, hd]: heads grouped by kv head
    s = np.einsum("bgrtd,bgsd->bgrts", qg, k) / np.sqrt(hd).astype(q.dtype)   # [B, Hkv, rep, T, S]
    S = k.shape[2]
    mask = np.arange(S)[None, :] > (n_past + np.arange(T))[:, None]           # [T, S] True = future
    s = np.where(mask, -np.inf, s)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    o = np.einsum("bgrts,bgsd->bgrtd", p, v)                 # [B, Hkv, rep, T, hd]
    return o.reshape(B, H, T, hd)


def block_weights(tensors: Mapping[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
    """The tensors of block i with the 'blk.i.' prefix removed ('attn_q.weight', ...)."""
    p = f"blk.{i}."
    return {k[len(p):]: v for k, v in tensors.items() if k.startswith(p)}


def block_forward(cfg: ModelConfig, w: Mapping[str, np.ndarray], x: np.ndarray, pos0: int = 0,
                  kv: tuple[np.ndarray, np.ndarray] | None = None,
                  record: MutableMapping[str, np.ndarray] | None = None,
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One decoder block on x [B, T, d] at positions pos0..pos0+T-1.

    kv: cached (k, v) [B, Hkv, pos0, hd] of earlier positions (post-RoPE) or None (pos0 must be 0
    then, or the earlier positions are ignored). Returns (x_out [B, T, d], k_all, v_all) where k_all,
    v_all [B, Hkv, pos0+T, hd] include the new positions. When `record` is given, it receives the
    inputs of the AWQ scale groups: attn_in, attn_out, ffn_in [B, T, *], ffn_out [B, T, n_ff].
    """
    B, T, _ = x.shape
    H, Hkv, hd = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    style = cfg.spec.rope_style

    h = rms_norm(x, w["attn_norm.weight"], cfg.rms_eps)
    q = linear(h, w, "attn_q").reshape(B, T, H, hd).transpose(0, 2, 1, 3)      # [B, H, T, hd]
    k = linear(h, w, "attn_k").reshape(B, T, Hkv, hd).transpose(0, 2, 1, 3)    # [B, Hkv, T, hd]
    v = linear(h, w, "attn_v").reshape(B, T, Hkv, hd).transpose(0, 2, 1, 3)
    cos, sin = rope_cos_sin(np.arange(pos0, pos0 + T), hd, cfg.rope_base, x.dtype)
    q = apply_rope(q, cos, sin, style)
    k = apply_rope(k, cos, sin, style)
    n_past = 0
    if kv is not None:
        n_past = kv[0].shape[2]
        k = np.concatenate([kv[0], k], axis=2)
        v = np.concatenate([kv[1], v], axis=2)
    a = attention(q, k, v, n_past).transpose(0, 2, 1, 3).reshape(B, T, H * hd)   # [B, T, H*hd]
    x = x + linear(a, w, "attn_output")

    h2 = rms_norm(x, w["ffn_norm.weight"], cfg.rms_eps)
    f = silu(linear(h2, w, "ffn_gate")) * linear(h2, w, "ffn_up")                 # [B, T, n_ff]
    x = x + linear(f, w, "ffn_down")
    if record is not None:
        record["attn_in"], record["attn_out"], record["ffn_in"], record["ffn_out"] = h, a, h2, f
    return x, k, v


# ----------------------------------------------------------------------------- KV cache

class KVCache:
    """Per-layer K/V of the positions evaluated so far (batch 1). `truncate(n)` rolls back."""

    def __init__(self, n_layer: int):
        self.k: list[np.ndarray | None] = [None] * n_layer   # each [1, Hkv, n_past, hd]
        self.v: list[np.ndarray | None] = [None] * n_layer
        self._n = 0

    @property
    def n_past(self) -> int:
        return self._n

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self._n:
            raise InvalidArgument(f"cannot truncate a cache of {self._n} positions to {n}; "
                                  f"expected 0 <= n <= {self._n}")
        self.k = [None if k is None else k[:, :, :n] for k in self.k]
        self.v = [None if v is None else v[:, :, :n] for v in self.v]
        self._n = n


# ----------------------------------------------------------------------------- model

class ReferenceModel:
    def __init__(self, cfg: ModelConfig, tensors: Mapping[str, np.ndarray], dtype=np.float64):
        self.cfg = cfg
        self.dtype = np.dtype(dtype)
        self.tensors = {k: np.ascontiguousarray(v, dtype=self.dtype) for k, v in tensors.items()}
        self._blocks = [block_weights(self.tensors, i) for i in range(cfg.n_layer)]
        self.n_vocab = self.tensors["token_embd.weight"].shape[0]

    @classmethod
    def from_weights(cls, cfg: ModelConfig, tensors: Mapping[str, np.ndarray], dtype=np.float64) -> "ReferenceModel":
        return cls(cfg, tensors, dtype)

    @classmethod
    def from_gguf(cls, path: str | Path, dtype=np.float64) -> "ReferenceModel":
        src = GGUFSource(path)
        return cls(src.cfg, {n: src.tensor(n) for n in src.tensor_names()}, dtype)

    def new_cache(self) -> KVCache:
        return KVCache(self.cfg.n_layer)

    def embed(self, tokens) -> np.ndarray:
        t = np.asarray(tokens, dtype=np.int64)
        if t.size and (t.min() < 0 or t.max() >= self.n_vocab):
            raise InvalidArgument(f"token ids must be in [0, {self.n_vocab}), got {t.min()}..{t.max()}")
        return self.tensors["token_embd.weight"][t]

    def head(self, x: np.ndarray) -> np.ndarray:
        h = rms_norm(x, self.tensors["output_norm.weight"], self.cfg.rms_eps)
        out = self.tensors.get("output.weight", self.tensors["token_embd.weight"])
        return h @ out.T

    def forward(self, tokens: Sequence[int], cache: KVCache | None = None) -> np.ndarray:
        """Logits [len(tokens), n_vocab] (model dtype); appends the tokens to `cache` if given."""
        tokens = list(tokens)
        if not tokens:
            return np.zeros((0, self.n_vocab), self.dtype)
        pos0 = 0 if cache is None else cache.n_past
        x = self.embed(tokens)[None]                               # [1, T, d]
        for i, w in enumerate(self._blocks):
            kv = None
            if cache is not None and cache.k[i] is not None and pos0 > 0:
                kv = (cache.k[i], cache.v[i])
            x, k, v = block_forward(self.cfg, w, x, pos0, kv)
            if cache is not None:
                cache.k[i], cache.v[i] = k, v
        if cache is not None:
            cache._n = pos0 + len(tokens)
        return self.head(x[0])
