"""Tiny but complete models for tests: GGUF files llama.cpp loads, tokenizes with and generates from.

    write_tiny_model(path, arch="llama", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128,
                     wtype="f32", tied=False, seed=0, hf_dir=None) -> Path

- arch "llama" (Q/K rows permuted as llama.cpp's converter does) or "qwen2" (q/k/v biases, NEOX RoPE).
- Vocabulary: byte-level GPT-2 BPE — all 256 byte tokens in GPT-2's byte->unicode form, a few
  merges (and their merged tokens), then the specials <|endoftext|>, <|im_start|>, <|im_end|>
  (control tokens), and a ChatML chat template. Every string tokenizes.
- Weights: random from np.random.default_rng(seed), float32 in Hugging Face layout; stored as
  wtype f32 / f16 / q8_0 / q4_0 / q4_1 for the 2-D matrices (norms and biases stay F32).
- hf_dir: also write the same float weights as a Hugging Face checkpoint (config.json,
  model.safetensors, tokenizer.json, tokenizer_config.json).
- outlier_channels: multiply a few embedding/norm channels so activations have salient
  channels (what AWQ protects); 0 disables.

`tiny_weights(...)` returns (hf_config, hf_tensors) without writing anything. This module does not
import edgerun: it is the independent ground truth the library is tested against.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Merges in rank order (pairs of already existing tokens, in byte->unicode form; "Ġ" is a space).
MERGES = (
    ("Ġ", "t"), ("h", "e"), ("i", "n"), ("e", "r"), ("Ġ", "a"), ("o", "n"), ("r", "e"),
    ("Ġt", "he"), ("a", "t"), ("e", "n"), ("Ġ", "s"), ("o", "r"), ("Ġ", "w"), ("i", "s"),
    ("Ġ", "c"), ("e", "d"), ("Ġ", "f"), ("i", "t"), ("a", "n"), ("Ġ", "i"), ("Ċ", "Ċ"),
)

ARCH_DEFAULTS = {
    "llama": dict(rope_theta=10000.0, qkv_bias=False, pre="default", hf_class="LlamaForCausalLM"),
    "qwen2": dict(rope_theta=1000000.0, qkv_bias=True, pre="qwen2", hf_class="Qwen2ForCausalLM"),
}


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token_types, merges): 256 bytes, merged tokens, specials. Types: 1 normal, 3 control."""
    b2u = byte_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    merges = []
    for a, b in MERGES:
        assert a in tokens and b in tokens, (a, b)
        merges.append(f"{a} {b}")
        if a + b not in tokens:
            tokens.append(a + b)
    types = [1] * len(tokens)
    tokens += list(SPECIALS)
    types += [3] * len(SPECIALS)
    return tokens, types, merges


def tiny_weights(arch: str = "llama", n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2,
                 n_ff: int = 128, tied: bool = False, seed: int = 0, outlier_channels: int = 0,
                 rms_eps: float = 1e-5, n_ctx: int = 2048) -> tuple[dict, dict[str, np.ndarray]]:
    """Random float32 weights in Hugging Face layout and names, and the matching config.json dict."""
    if arch not in ARCH_DEFAULTS:
        raise ValueError(f"arch must be one of {sorted(ARCH_DEFAULTS)}, got {arch!r}")
    spec = ARCH_DEFAULTS[arch]
    tokens, _, _ = tiny_vocab()
    n_vocab = len(tokens)
    hd = n_embd // n_head
    rng = np.random.default_rng(seed)

    def lin(out: int, inp: int) -> np.ndarray:
        return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t: dict[str, np.ndarray] = {}
    emb = rng.standard_normal((n_vocab, n_embd)).astype(np.float32)
    hot = rng.choice(n_embd, size=outlier_channels, replace=False) if outlier_channels else np.array([], int)
    emb[:, hot] *= 8.0
    t["model.embed_tokens.weight"] = emb
    for i in range(n_layer):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(n_embd)
        t[p + "self_attn.q_proj.weight"] = lin(n_head * hd, n_embd)
        t[p + "self_attn.k_proj.weight"] = lin(n_head_kv * hd, n_embd)
        t[p + "self_attn.v_proj.weight"] = lin(n_head_kv * hd, n_embd)
        if spec["qkv_bias"]:
            for x, n in (("q", n_head * hd), ("k", n_head_kv * hd), ("v", n_head_kv * hd)):
                t[p + f"self_attn.{x}_proj.bias"] = (0.1 * rng.standard_normal(n)).astype(np.float32)
        t[p + "self_attn.o_proj.weight"] = lin(n_embd, n_head * hd)
        ln2 = norm(n_embd)
        ln2[hot] *= 4.0
        t[p + "post_attention_layernorm.weight"] = ln2
        t[p + "mlp.gate_proj.weight"] = lin(n_ff, n_embd)
        t[p + "mlp.up_proj.weight"] = lin(n_ff, n_embd)
        t[p + "mlp.down_proj.weight"] = lin(n_embd, n_ff)
    t["model.norm.weight"] = norm(n_embd)
    if not tied:
        t["lm_head.weight"] = lin(n_vocab, n_embd)
    config = {
        "architectures": [spec["hf_class"]],
        "model_type": arch,
        "vocab_size": n_vocab,
        "hidden_size": n_embd,
        "num_hidden_layers": n_layer,
        "intermediate_size": n_ff,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_head_kv,
        "rms_norm_eps": rms_eps,
        "rope_theta": spec["rope_theta"],
        "max_position_embeddings": n_ctx,
        "tie_word_embeddings": tied,
        "bos_token_id": tokens.index("<|endoftext|>"),
        "eos_token_id": tokens.index("<|im_end|>"),
        "torch_dtype": "float32",
    }
    return config, t


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF rotate-half rows -> llama.cpp adjacent pairs: [n_heads, 2, hd/2, ...] -> [n_heads, hd/2, 2, ...]."""
    s = w.shape
    return w.reshape(n_heads, 2, s[0] // n_heads // 2, *s[1:]).swapaxes(1, 2).reshape(s)


_HF_BLOCK = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_tensors(config: dict, hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF-named float tensors -> GGUF-named float tensors in GGUF layout (llama Q/K permuted), in file order."""
    arch = config["model_type"]
    out = {"token_embd.weight": hf["model.embed_tokens.weight"]}
    for i in range(config["num_hidden_layers"]):
        for hname, gname in _HF_BLOCK.items():
            for kind in ("weight", "bias"):
                k = f"model.layers.{i}.{hname}.{kind}"
                if k not in hf:
                    continue
                a = hf[k]
                if arch == "llama" and gname in ("attn_q", "attn_k"):
                    a = _permute(a, config["num_attention_heads"] if gname == "attn_q"
                                 else config["num_key_value_heads"])
                out[f"blk.{i}.{gname}.{kind}"] = a
    out["output_norm.weight"] = hf["model.norm.weight"]
    if "lm_head.weight" in hf:
        out["output.weight"] = hf["lm_head.weight"]
    return out


def write_tiny_model(path: str | Path, arch: str = "llama", n_layer: int = 2, n_embd: int = 64,
                     n_head: int = 4, n_head_kv: int = 2, n_ff: int = 128, wtype: str = "f32",
                     tied: bool = False, seed: int = 0, outlier_channels: int = 0,
                     hf_dir: str | Path | None = None, n_ctx: int = 2048, name: str | None = None) -> Path:
    """Write a complete tiny GGUF model (and optionally the HF checkpoint of the same float weights)."""
    import gguf

    qtypes = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
              "q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
              "q4_1": gguf.GGMLQuantizationType.Q4_1}
    if wtype not in qtypes:
        raise ValueError(f"wtype must be one of {sorted(qtypes)}, got {wtype!r}")
    config, hf = tiny_weights(arch, n_layer, n_embd, n_head, n_head_kv, n_ff, tied, seed, outlier_channels,
                              n_ctx=n_ctx)
    tokens, types, merges = tiny_vocab()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name or f"tiny-{arch}-{wtype}-s{seed}")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_rope_freq_base(config["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(len(tokens))
    ftype = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7}[wtype]
    w.add_file_type(ftype)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(ARCH_DEFAULTS[arch]["pre"])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"])
    w.add_pad_token_id(config["bos_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)
    for gname, a in gguf_tensors(config, hf).items():
        if a.ndim == 2 and wtype != "f32":
            q = qtypes[wtype]
            if q == qtypes["f16"]:
                w.add_tensor(gname, a.astype(np.float16))
            else:
                w.add_tensor(gname, gguf.quants.quantize(a, q), raw_dtype=q)
        else:
            w.add_tensor(gname, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if hf_dir is not None:
        write_hf_checkpoint(hf_dir, config, hf)
    return path


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], dtype: str = "F32") -> None:
    """Minimal safetensors writer: 8-byte header length, JSON header, raw little-endian data."""
    np_dt = {"F32": np.float32, "F16": np.float16}
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        if dtype == "BF16":
            b = (np.ascontiguousarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
        else:
            b = np.ascontiguousarray(a, np_dt[dtype]).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def write_hf_checkpoint(directory: str | Path, config: dict, hf: dict[str, np.ndarray], dtype: str = "F32",
                        shards: int = 1) -> Path:
    """config.json, model.safetensors (or model-0000k-of-0000n), tokenizer.json, tokenizer_config.json."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config, indent=1))
    names = list(hf)
    if shards == 1:
        write_safetensors(d / "model.safetensors", hf, dtype)
    else:
        for k, part in enumerate(np.array_split(np.arange(len(names)), shards)):
            write_safetensors(d / f"model-{k + 1:05d}-of-{shards:05d}.safetensors",
                              {names[j]: hf[names[j]] for j in part}, dtype)
    tokens, types, merges = tiny_vocab()
    n_base = types.index(3)
    tok = {
        "version": "1.0",
        "added_tokens": [{"id": n_base + j, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for j, s in enumerate(SPECIALS)],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "vocab": {t: i for i, t in enumerate(tokens[:n_base])}, "merges": merges},
    }
    (d / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": False, "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE,
    }))
    return d
