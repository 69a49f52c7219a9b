"""Calibration and evaluation texts that exist offline, and their cutting into token sequences.

- "builtin" / "pydoc": the Python language reference prose shipped with CPython
  (`pydoc_data.topics`), the default AWQ calibration text.
- "stdlib-code": CPython standard library source (*.py, without test directories), sorted by path.
- any other string: a UTF-8 text file.
"""

from __future__ import annotations

import hashlib
import logging
import sysconfig
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import QuantizationError

log = logging.getLogger(__name__)

BUILTIN = ("builtin", "pydoc", "stdlib-code")


def pydoc_text() -> str:
    """The Python reference prose of this interpreter (~465k characters), topics in sorted order."""
    from pydoc_data.topics import topics        # lazily: 465k characters of data, read only for this text
    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def stdlib_code_text(max_chars: int = 4_000_000) -> str:
    """CPython stdlib source files (no test dirs, no site-packages), sorted by path, up to max_chars."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, n = [], 0
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).parts
        if any(part in ("test", "tests", "site-packages", "idlelib", "lib2to3") for part in rel):
            continue
        try:
            t = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.append(t)
        n += len(t)
        if n >= max_chars:
            break
    return "\n".join(out)[:max_chars]


def load_text(spec: str) -> tuple[str, str]:
    """(name, text) of a builtin text name or a file path."""
    if spec in ("builtin", "pydoc"):
        return "builtin:pydoc_topics", pydoc_text()
    if spec == "stdlib-code":
        return "builtin:stdlib_code", stdlib_code_text()
    p = Path(spec)
    try:
        return p.name, p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise QuantizationError(f"calibration text {spec!r} not found; expected 'builtin', "
                                "'stdlib-code' or a path to a UTF-8 text file") from None
    except (UnicodeDecodeError, IsADirectoryError) as e:
        raise QuantizationError(f"{p}: not a UTF-8 text file ({e})") from None


def token_sequences(text: str, tokenize: Callable[[str], list[int]], n_tokens: int, seq_len: int,
                    bos: int | None = None) -> np.ndarray:
    """Cut about n_tokens calibration tokens into [n_seq, seq_len] windows spread evenly over the text.

    Window k is tokenized from a line start near k/n_seq of the way through the text, so only the
    characters needed are tokenized. With `bos`, every window starts with it (counted in seq_len).
    Raises QuantizationError if the text cannot fill the windows.
    """
    body = seq_len - (bos is not None)
    n_seq = max(1, -(-n_tokens // seq_len))
    span = body * 8                                   # characters that surely hold `body` tokens
    short = QuantizationError(f"calibration text is too short ({len(text)} characters); expected at least "
                              f"{n_seq * body} tokens ({n_seq} sequences of {seq_len}); use a longer text "
                              "or fewer --calib-tokens")
    last = max(0, len(text) - span)
    seqs = []
    for k in range(n_seq):
        start = int(round(k * last / max(1, n_seq - 1))) if n_seq > 1 else 0
        nl = text.rfind("\n", 0, start)
        start = nl + 1 if nl >= 0 and start - nl < span // 4 else start
        ids = tokenize(text[start:start + span])
        if len(ids) < body:
            ids = tokenize(text[start:])
        if len(ids) < body:
            raise short
        seqs.append(ids[:body])
    out = np.asarray(seqs, dtype=np.int64)                      # [n_seq, body]
    if bos is not None:
        out = np.concatenate([np.full((n_seq, 1), bos, np.int64), out], axis=1)
    return out


def tokens_sha256(seqs: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(seqs, dtype="<u4").tobytes()).hexdigest()
