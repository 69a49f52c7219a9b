"""What a user wrote -> a ready model file: registry name, NAME@VARIANT, path, ONNX directory or INT4 checkpoint.

The one place that calls the registry (pull a pinned file), the quantizer (make a variant from it) and
the converter (an INT4 checkpoint directory, converted once into the cache). Nothing below calls up:
registry/ knows manifests and the cache, quant/ and convert/ take paths.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Sequence

from .config import QuantArgs
from .convert import is_int4_checkpoint
from .convert.converted import converted_model
from .errors import ModelFormatError, ModelNotFound
from .quant import pipeline
from .registry import fetch
from .registry.cache import cached_path, is_cached
from .registry.fetch import Progress
from .registry.manifest import Manifest, get_manifest, load_manifests, split_name, unknown_message

log = logging.getLogger(__name__)

_MODEL_SUFFIXES = (".gguf", ".onnx")


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
        if is_int4_checkpoint(path):                 # a published INT4 checkpoint: converted once into the cache
            return converted_model(path)
        raise ModelFormatError(f"{path} is a directory without model.onnx or a quantized config.json; expected a "
                               ".gguf file, an ONNX export directory holding model.onnx, or an INT4 checkpoint "
                               "directory (AutoAWQ, GPTQ, compressed-tensors)")
    raise ModelNotFound(f"no such file or directory: {path}; expected a path to a .gguf file or an ONNX "
                        "export directory, or a registry model name (see `edgerun list`)")


def _unknown_variant(m: Manifest, variant: str) -> ModelNotFound:
    known = ", ".join(f"{m.name}@{v}" for v in m.variants) or "none"
    return ModelNotFound(f"model {m.name} has no variant {variant!r}; its variants: {known}")


def resolve_model(spec: str | os.PathLike, *, pull: bool = True, progress: Progress | None = None) -> Path:
    """Turn what a user wrote into a model path.

    A registry name gives its cached file, pulled first if missing (or ModelNotFound when
    ``pull=False``); NAME@VARIANT gives the variant, made from the registry file on first use; a path to a
    local .gguf file or an ONNX export directory gives that path; an INT4 checkpoint directory gives its
    GGUF in the cache, converted on first use (edgerun.convert.converted).
    """
    spec = os.fspath(spec)
    if _looks_like_path(spec):
        return _local_model(spec)
    manifests = load_manifests()
    name, variant = split_name(spec)
    m = manifests.get(name)
    if m is None:
        if Path(spec).exists():
            return _local_model(spec)
        raise ModelNotFound(unknown_message(spec, manifests))
    if variant is not None and variant not in m.variants:
        raise _unknown_variant(m, variant)
    if is_cached(m, variant):
        return cached_path(m, variant)
    if not pull:
        how = f"edgerun pull {m.name} --variant {variant}" if variant else f"edgerun pull {m.name}"
        raise ModelNotFound(f"model {spec} is not in the cache ({cached_path(m, variant)}); run `{how}` first")
    return pull_model(m.name, progress=progress, variant=variant)


def pull_model(name: str, progress: Progress | None = None, *, verify: bool = False, force: bool = False,
               find_links: Sequence[str | os.PathLike] | None = None, variant: str | None = None) -> Path:
    """Fetch a registry model into the cache (edgerun.registry.pull) and, for ``variant`` (or a name
    NAME@VARIANT), make that variant from it once with the manifest's quantize recipe (progress stage
    'quantize', counted in layers)."""
    base, named = split_name(name)
    m = get_manifest(base)
    variant = variant or named
    if variant is None:
        return fetch.pull_manifest(m, progress=progress, verify=verify, force=force, find_links=find_links)
    return _make_variant(m, variant, progress=progress, verify=verify, force=force, find_links=find_links)


def _make_variant(m: Manifest, variant: str, *, progress: Progress | None, verify: bool, force: bool,
                  find_links: Sequence[str | os.PathLike] | None) -> Path:
    """The registry file first, then its variant made by the manifest's quantize recipe (atomic, cached)."""
    v = m.variants.get(variant)
    if v is None:
        raise _unknown_variant(m, variant)
    src = fetch.pull_manifest(m, progress=progress, verify=verify, find_links=find_links)
    dest = cached_path(m, variant)
    with fetch.pull_lock(dest):
        if not force and is_cached(m, variant):
            log.info("%s@%s is already made: %s", m.name, variant, dest)
            return dest
        fetch.remove_stale(dest)

        def layers(msg: str, done: int, total: int) -> None:
            if progress is not None:
                progress("quantize", done, total)

        t0 = time.perf_counter()
        log.info("making %s@%s from %s: %s", m.name, variant, src.name, v.description)
        pipeline.quantize(src, dest, v.quant_args(), progress=layers)
        log.info("made %s@%s in %.0f s: %s", m.name, variant, time.perf_counter() - t0, dest)
    return dest


def quantize(source: str | os.PathLike, out: str | os.PathLike, args: QuantArgs | None = None, *,
             pull: bool = True, progress: Progress | None = None, n_search: int = 512, seed: int = 0,
             block_options: dict | None = None, **options) -> pipeline.QuantReport:
    """edgerun.quantize: quant.pipeline.quantize on a GGUF / HF checkpoint path, or on a registry model
    resolved first (pulled unless ``pull=False``). The output and format are checked before any pull."""
    args = pipeline.quant_args(args, options)
    pipeline.check_request(out, args)
    spec = os.fspath(source)
    path = spec if Path(spec).exists() else resolve_model(spec, pull=pull)
    return pipeline.quantize(path, out, args, progress=progress, n_search=n_search, seed=seed,
                             block_options=block_options)
