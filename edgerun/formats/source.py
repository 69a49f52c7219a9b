"""Opening a float-weights source by what the path is: a GGUF file or a Hugging Face checkpoint directory."""

from __future__ import annotations

from pathlib import Path

from ..errors import QuantizationError
from .gguf import GGUFSource
from .hf import HFSource


def open_source(path: str | Path):
    """A float-weights Source: a GGUF file (formats.gguf.GGUFSource) or a Hugging Face checkpoint directory
    (formats.hf.HFSource)."""
    p = Path(path)
    if p.is_dir():
        return HFSource(p)
    if p.is_file():
        return GGUFSource(p)
    raise QuantizationError(f"{p}: no such file or directory; expected a .gguf file, a Hugging Face "
                            "checkpoint directory or a registry model name")
