"""Where probe results live: $EDGERUN_HOME/probes/<kind>-<key>.json, written atomically.

A key is a sha256 over what makes a measurement valid: the device's identity (CPU, core count,
memory, architecture), the model files' content hashes and the engine settings.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from pathlib import Path
from typing import Any

import psutil

from ..util import atomic
from ..util.home import cache_dir

log = logging.getLogger(__name__)


def probes_dir() -> Path:
    return cache_dir() / "probes"


def cpu_brand() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_identity() -> dict[str, Any]:
    """What distinguishes one machine's measurements from another's."""
    return {
        "machine": platform.machine(),
        "system": platform.system(),
        "cpu": cpu_brand(),
        "cores": psutil.cpu_count(logical=False) or psutil.cpu_count(),
        "logical_cores": psutil.cpu_count(),
        "mem_total": psutil.virtual_memory().total,
    }


def key_of(*parts: Any) -> str:
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def atomic_write_json(path: Path, data: Any) -> None:
    atomic.write_json(path, data, sort_keys=True)


def read_json(path: Path) -> Any | None:
    """The cached document, or None if absent or unreadable (a broken cache entry is re-measured)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable probe cache %s: %s", path, e)
        return None


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's content, memoised in the probe cache by (real path, size, mtime)."""
    p = Path(path).resolve()
    st = p.stat()
    memo_path = probes_dir() / "file-hashes.json"
    memo = read_json(memo_path) or {}
    tag = f"{p}|{st.st_size}|{st.st_mtime_ns}"
    if tag in memo:
        return memo[tag]
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for block in iter(lambda: f.read(8 * 1024 * 1024), b""):
            h.update(block)
    digest = h.hexdigest()
    memo = {k: v for k, v in memo.items() if not k.startswith(f"{p}|")}
    memo[tag] = digest
    atomic_write_json(memo_path, memo)
    return digest
