"""Model file formats: GGUF read/write and header scan, Hugging Face checkpoints, architecture tables."""

from __future__ import annotations

from pathlib import Path


def open_source(path: str | Path):
    """A float-weights Source: a GGUF file (formats.gguf.GGUFSource) or a Hugging Face checkpoint directory
    (formats.hf.HFSource)."""
    from ..errors import QuantizationError

    p = Path(path)
    if p.is_dir():
        from .hf import HFSource

        return HFSource(p)
    if p.is_file():
        from .gguf import GGUFSource

        return GGUFSource(p)
    raise QuantizationError(f"{p}: no such file or directory; expected a .gguf file, a Hugging Face "
                            "checkpoint directory or a registry model name")
