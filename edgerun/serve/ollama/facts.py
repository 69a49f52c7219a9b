"""What /api/tags, /api/show and /api/ps say about the served model: its file, size, digest and the details
read once from its GGUF header."""

from __future__ import annotations

import hashlib
import logging
import time
from datetime import datetime, timezone
from pathlib import Path

from ...errors import EdgerunError
from ...formats.ggufscan import read_info
from ...registry.manifest import get_manifest
from ...resolve import resolve_model
from .translate import served_name

log = logging.getLogger(__name__)

# llama.cpp's general.file_type values (the common ones)
_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
               11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M",
               18: "Q6_K", 32: "BF16"}


def iso(t: float | None = None) -> str:
    """A time (default: now) as Ollama writes it: ISO 8601 in UTC with a Z."""
    return datetime.fromtimestamp(time.time() if t is None else t, timezone.utc).isoformat().replace("+00:00", "Z")


def _model_file(state) -> Path | None:
    runtime = state.scheduler.runtime
    path = getattr(getattr(runtime, "target", None), "path", None)
    if path is not None:
        return Path(path)
    try:
        return Path(resolve_model(state.model_id, pull=False))
    except (EdgerunError, OSError):
        return None


class Facts:
    """The served model's file facts, read once from its file's header."""

    def __init__(self, state) -> None:
        self.path = _model_file(state)
        self.size, self.modified, self.meta = 0, time.time(), {}
        if self.path is not None and self.path.is_file():
            st = self.path.stat()
            self.size, self.modified = st.st_size, st.st_mtime
            try:
                self.meta = read_info(self.path).metadata
            except Exception as e:                # noqa: BLE001 - a header we cannot read leaves the details empty
                log.info("could not read the GGUF header of %s: %s", self.path, e)
        pinned = None
        try:
            pinned = get_manifest(state.model_id).sha256
        except EdgerunError:
            pass
        # Ollama's digest names a manifest; here: the file's pinned sha256, else a hash of its path, size and time
        self.digest = pinned or hashlib.sha256(f"{self.path}|{self.size}|{self.modified}".encode()).hexdigest()

    def details(self) -> dict:
        arch = str(self.meta.get("general.architecture", ""))
        ftype = self.meta.get("general.file_type")
        quant = _FILE_TYPES.get(ftype, str(ftype) if ftype is not None else "")
        n = self.meta.get("general.size_label") or ""
        return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch] if arch else [],
                "parameter_size": str(n), "quantization_level": quant}


def facts(state) -> Facts:
    """The served model's Facts, kept on the state (read again while the model has not loaded)."""
    f = getattr(state, "_ollama_facts", None)
    if f is None or (f.path is None and state.scheduler.runtime is not None):
        f = state._ollama_facts = Facts(state)
    return f


def model_entry(state) -> dict:
    """The served model as one entry of /api/tags."""
    f = facts(state)
    name = served_name(state) + ":latest"
    return {"name": name, "model": name, "modified_at": iso(f.modified), "size": f.size, "digest": f.digest,
            "details": f.details()}


def running_entry(state) -> dict:
    """The served model as one entry of /api/ps (loaded for the server's lifetime)."""
    f = facts(state)
    entry = model_entry(state)
    entry.update(expires_at="9999-12-31T23:59:59Z", size_vram=0, size=f.size,
                 context_length=getattr(state.scheduler.runtime, "n_ctx", 0))
    entry.pop("modified_at", None)
    return entry


def show(state) -> dict:
    """/api/show's answer for the served model."""
    f = facts(state)
    runtime = state.scheduler.runtime
    tok = getattr(runtime, "tokenizer", None)
    template = getattr(tok, "chat_template", None) or ""
    info = {k: v for k, v in f.meta.items() if k.startswith("general.") or "." in k and not k.startswith("tokenizer.")}
    caps = ["completion"] + (["tools"] if template and "tools" in template else [])
    return {"modelfile": f"# served by edgerun\nFROM {f.path or state.model_id}\n",
            "parameters": f"num_ctx {getattr(runtime, 'n_ctx', 0)}", "template": template, "license": "",
            "details": f.details(), "model_info": info, "capabilities": caps, "modified_at": iso(f.modified)}
