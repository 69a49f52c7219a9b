"""edgerun's cache root: $EDGERUN_HOME, default ~/.cache/edgerun (models, converted checkpoints, probes)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of edgerun's cache: $EDGERUN_HOME, default ~/.cache/edgerun."""
    env = os.environ.get("EDGERUN_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "edgerun"
