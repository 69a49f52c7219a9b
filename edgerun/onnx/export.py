"""Export a llama-like GGUF (llama, qwen2) or HF checkpoint to an ONNX decoder directory (atomic).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

import gguf
import numpy as np

from ..formats.arch import get_arch
from ..formats.gguf import source_kv
from ..tokenizer import Tokenizer
from ..util.atomic import atomic_dir
from ..errors import InvalidArgument, ModelFormatError
from .graph import build
from .layout import BLOCK, CONFIG_FILE, DATA_FILE, GENAI_CONFIG_FILE, GENAI_MODEL_FILE, LOGITS_TO_KEEP, MAX_ROPE_POSITIONS, MODEL_FILE, OnnxModelConfig, TOKENIZER_FILE, is_onnx_dir
from .weights import Source


log = logging.getLogger(__name__)

# onnx (the optional 'onnx' extra, ~2.4 s to import measured here) is imported inside the functions that write
# a graph: importing this module (edgerun convert, the CLI) does not need it


# ---------------------------------------------------------------------------------- side files

def _write_tokenizer_gguf(src: Source, path: Path) -> None:
    """The source's metadata (tokenizer.*, hyperparameters, general.*) and no tensors."""
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


def _genai_config(ocfg: OnnxModelConfig, eos_ids: list[int]) -> dict:
    cfg = ocfg.model
    return {
        "model": {
            "bos_token_id": ocfg.bos_id,
            "context_length": ocfg.n_ctx,
            "eos_token_id": eos_ids if len(eos_ids) > 1 else eos_ids[0],
            "pad_token_id": ocfg.eos_id,
            "type": cfg.arch,
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
                   "max_length": ocfg.n_ctx, "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
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


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=False) + "\n")


# ---------------------------------------------------------------------------------- entry point

def export_onnx(src: str | Path, out_dir: str | Path, *, n_ctx: int | None = None, accuracy_level: int = 4,
                force: bool = False, progress: Callable[[str], None] | None = None, source: Source | None = None) -> Path:
    """Write the ONNX decoder of GGUF `src` into `out_dir` (created atomically); return out_dir.

    n_ctx: positions the graph supports (default: the model's training context, at most 32768).
    accuracy_level: MatMulNBits' activation precision (4 = int8, onnxruntime's fast CPU path;
    1 = fp32, the exact product of the dequantized weights). force: replace an existing export.
    source: an already opened Source of `src` (edgerun.convert passes its view of an INT4 checkpoint).
    """
    src_path = Path(src)
    out = Path(out_dir)
    if accuracy_level not in (0, 1, 2, 3, 4):
        raise InvalidArgument(f"accuracy_level must be 0..4 (4 = int8, 1 = fp32), got {accuracy_level!r}")
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        if not (force and is_onnx_dir(out)):
            raise InvalidArgument(f"{out} already exists; expected a new or empty directory "
                                  f"(pass force=True / --force to replace an earlier export)")
    s = source if source is not None else Source(src_path)
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
    with atomic_dir(out) as tmp:
        say(f"reading {src_path.name} ({cfg.arch}, {cfg.n_layer} layers, d {cfg.n_embd}, vocab {cfg.n_vocab})")
        _write_tokenizer_gguf(s, tmp / TOKENIZER_FILE)
        tok = Tokenizer.from_gguf(tmp / TOKENIZER_FILE)
        say("building the graph (MatMulNBits int4, GroupQueryAttention)")
        model, weight_bytes, conv = build(s, n_ctx, accuracy_level, tmp / DATA_FILE)
        _save(model, tmp / MODEL_FILE)
        _save(_genai_variant(model), tmp / GENAI_MODEL_FILE)
        lossy = sorted(k for k, v in conv.items() if not v.endswith("(lossless)"))
        if lossy:
            log.warning("%d of %d weight tensors were re-quantized (not lossless), e.g. %s: %s",
                        len(lossy), len(conv), lossy[0], conv[lossy[0]])
        ocfg = OnnxModelConfig(
            model=cfg, n_ctx=n_ctx, rope_style=get_arch(s.arch).rope_style, vocab_fingerprint=tok.vocab_fingerprint,
            weight_bytes=int(weight_bytes), accuracy_level=accuracy_level,
            bos_id=int(tok.bos_id), eos_id=int(tok.eos_id),
            source={"file": src_path.name, "sha256": s.src.sha256(),
                    "name": s.get("general.name", None) or src_path.stem},
            metadata=_jsonable(s.edgerun_metadata()), conversions=conv)
        _write_json(tmp / CONFIG_FILE, ocfg.to_json())
        eos = sorted({int(tok.eos_id)} | {t for t in range(tok.n_vocab) if tok.is_eog(t)})
        _write_json(tmp / GENAI_CONFIG_FILE, _genai_config(ocfg, eos))
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



__all__ = ["export_onnx"]
