"""Inference engines behind one protocol (base.Backend). `open_backend` picks one by what a path is."""

from __future__ import annotations

from pathlib import Path

from ..config import BackendArgs
from ..errors import ModelFormatError, ModelNotFound
from ..formats.ggufscan import read_info


def open_backend(path: str | Path, args: BackendArgs | None = None, cluster=None):
    """A .gguf file -> llama.cpp; a directory exported by `edgerun export onnx` -> onnxruntime.
    cluster: an attached edgerun.cluster.head.Cluster (llama.cpp only): the target spreads over its workers."""
    p = Path(path)
    args = args or BackendArgs()
    if not p.exists():
        raise ModelNotFound(f"model not found: {p}")
    if p.is_dir():
        if not (p / "model.onnx").exists():
            raise ModelFormatError(f"{p} is a directory without model.onnx; expected a .gguf file or a "
                                   f"directory written by `edgerun export onnx`")
        # the engines load lazily: onnxruntime is an optional extra, and llama_cpp loads libllama (native)
        from .onnxrt import OnnxBackend

        return OnnxBackend(p, args)
    from .llamacpp import LlamaCppBackend

    return LlamaCppBackend(p, args, cluster=cluster)


def model_memory(path: str | Path, n_ctx: int) -> tuple[int, int]:
    """(weight bytes, KV-cache bytes for n_ctx positions) of a model, read without loading it."""
    p = Path(path)
    if p.is_dir():
        weights = sum(f.stat().st_size for f in p.iterdir() if f.is_file())
        tok = p / "tokenizer.gguf"
        kv = 0
        if tok.exists():
            kv = read_info(tok).kv_cache_bytes(n_ctx, bytes_per_value=4)   # the ONNX backend keeps f32 K/V
        return weights, kv
    info = read_info(p)
    return info.file_size, info.kv_cache_bytes(n_ctx)
