"""Atomic writes: the one way edgerun puts a file (or an export directory) where a user will look for it.

A temporary file in the destination's own folder is written, fsynced, given its final mode, renamed
onto the destination, and the folder is fsynced so the rename survives a power cut. On any error,
KeyboardInterrupt included, the temporary is removed: nothing that looks complete is ever left behind.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import stat
import tempfile
from pathlib import Path
from typing import Any, Iterator

from ..errors import InvalidArgument, StorageError

_stop_signal: int | None = None     # the signal that asked this process to stop; sticky once set


def stop_on_signal(signum: int = signal.SIGTERM) -> None:
    """`signum` ends a long write through SystemExit(128 + signum), so `finally` blocks remove temporaries (the
    default action kills the process with the file left behind). The request is also remembered: a SystemExit
    raised where Python ignores exceptions (a `__del__`, a ctypes callback from llama.cpp) is lost, and then
    `raise_if_stopped` (called before every commit and between long steps) raises it again."""
    def handler(sig, frame):
        global _stop_signal
        _stop_signal = sig
        raise SystemExit(128 + sig)

    signal.signal(signum, handler)


def raise_if_stopped() -> None:
    """Raise SystemExit(128 + signal) if a stop was requested; a no-op otherwise."""
    if _stop_signal is not None:
        raise SystemExit(128 + _stop_signal)


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename inside `directory` durable (POSIX); a no-op where folders cannot be opened."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
    try:
        fd = os.open(directory, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:           # some filesystems refuse fsync on a directory
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def check_destination(dest: Path) -> None:
    """An existing destination must be a regular file: a rename would replace a device node, a FIFO, a
    socket or a symlink (as root, OUT=/dev/null would replace /dev/null)."""
    try:
        st = os.lstat(dest)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a symbolic link" if stat.S_ISLNK(st.st_mode) \
            else "not a regular file (a device, FIFO or socket)"
        raise InvalidArgument(f"{dest} exists and is {kind}; expected a new path or a regular file to replace")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:       # someone else's live process
        return True
    return True


def remove_stale(dest: Path, suffix: str = ".part") -> list[Path]:
    """Remove temporaries of `dest` left by a killed writer: `.{name}.{pid}.*{suffix}` whose process is gone
    (a SIGKILLed quantize or export runs no cleanup). Temporaries of live processes stay."""
    removed = []
    for p in dest.parent.glob(f".{dest.name}.*{suffix}"):
        pid = p.name[len(dest.name) + 2:].split(".", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
    return removed


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, suffix: str = ".part", mode: int = 0o644,
                prefix: str | None = None) -> Iterator[Path]:
    """Yield a temporary path beside `path`; when the block ends normally, the file written there becomes
    `path` (fsync, chmod `mode`, rename, fsync of the folder). An exception removes it and propagates."""
    dest = Path(path)
    check_destination(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if prefix is None:            # the writer's pid in the name: a later writer can tell a dead one's leftovers
        remove_stale(dest, suffix)
    with storage_errors(dest):
        fd, name = tempfile.mkstemp(prefix=prefix or f".{dest.name}.{os.getpid()}.", suffix=suffix, dir=dest.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        with storage_errors(dest, space_only=True):
            yield tmp
            raise_if_stopped()           # a stop whose first SystemExit was swallowed never commits a file
            _fsync_file(tmp)
            os.chmod(tmp, mode)          # mkstemp creates 0600; what edgerun writes is meant to be shared
            os.replace(tmp, dest)
            fsync_dir(dest.parent)
    finally:
        tmp.unlink(missing_ok=True)  # gone already after a successful rename


@contextlib.contextmanager
def storage_errors(dest: Path, *, space_only: bool = False) -> Iterator[None]:
    """A failed write as a StorageError naming the place and, for a full disk, the space left.
    space_only: only a full disk or quota (around a writer's own code, whose other OSErrors are its own)."""
    try:
        yield
    except OSError as e:
        where = dest.parent
        try:
            free = shutil.disk_usage(where).free
        except OSError:
            free = None
        # numpy's tofile reports a full disk as an OSError without an errno: "N requested and M written" after a
        # short write, or "Not enough free space to write N bytes" when it could not reserve N bytes at once
        # (then megabytes may still be free: a 30 MB tensor on a disk with 2 MB left)
        full = e.errno in (errno.ENOSPC, errno.EDQUOT) or (e.errno is None and (
            "not enough free space" in str(e).lower() or (free is not None and free < 2**20)))
        if space_only and not full:
            raise
        if full:
            left = "free space unknown" if free is None else f"{free / 2**20:.1f} MiB free" if free >= 2**20 \
                else f"{free // 1024} KiB free"
            raise StorageError(f"no space left on the disk holding {where} ({left}) while writing {dest.name}; "
                               "free some space or write somewhere else (nothing was left behind)") from None
        raise StorageError(f"cannot write {dest}: {e.strerror or e}") from None


def write_bytes(path: str | os.PathLike, data: bytes, *, mode: int = 0o644) -> None:
    with atomic_path(path, mode=mode) as tmp:
        tmp.write_bytes(data)


def write_json(path: str | os.PathLike, obj: Any, *, indent: int = 1, sort_keys: bool = False) -> None:
    write_bytes(path, (json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n").encode("utf-8"))


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a new temporary folder beside `path`; when the block ends normally its files are fsynced and it
    replaces `path` (an empty folder, an earlier copy, or nothing). An exception removes it."""
    dest = Path(path)
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise InvalidArgument(f"{dest} exists and is not a directory; expected a new or empty directory")
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(dest, ".tmpdir")
    with storage_errors(dest):
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.{os.getpid()}.", suffix=".tmpdir", dir=dest.parent))
    try:
        with storage_errors(dest / "x", space_only=True):
            yield tmp
            raise_if_stopped()
            for f in tmp.iterdir():
                if f.is_file():
                    _fsync_file(f)
            fsync_dir(tmp)
            _replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace_dir(tmp: Path, dest: Path) -> None:
    old = None
    if dest.exists():
        if any(dest.iterdir()):
            old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
            os.rename(dest, old)
        else:
            dest.rmdir()
    os.rename(tmp, dest)
    fsync_dir(dest.parent)
    if old is not None:
        shutil.rmtree(old)
