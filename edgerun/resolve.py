"""What a user wrote -> a ready model file: registry name, NAME@VARIANT, hub name (hf:ORG/REPO...), path, ONNX
directory or INT4 checkpoint.

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
from .errors import EdgerunError, ModelFormatError, ModelNotFound, QuantizationError
from .quant import pipeline
from .registry import fetch
from .registry.cache import cached_path, is_cached
from .registry.fetch import Progress
from .registry import hub, hub_download
from .registry.manifest import (Manifest, default_draft_for, get_manifest, load_manifests, split_name,
                                unknown_message)

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
    if hub.is_hub_name(spec):
        return hub_model(spec, pull=pull, progress=progress)
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
    if hub.is_hub_name(name):
        return ready_path(pull_hub(name, progress, verify=verify, force=force))
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
    if hub.is_hub_name(spec):           # a float checkpoint on the hub is what quantize is for
        path = hub_model(spec, pull=pull, accept_float=True)
    else:
        path = spec if Path(spec).exists() else resolve_model(spec, pull=pull)
    return pipeline.quantize(path, out, args, progress=progress, n_search=n_search, seed=seed,
                             block_options=block_options)


# ---- hub names: hf:ORG/REPO[@REV][:QUANT|/FILE.gguf] (edgerun.registry.hub; docs/models.md) ----------------------

def hub_model(spec: str, *, pull: bool = True, progress: Progress | None = None, accept_float: bool = False) -> Path:
    """A hub name -> its GGUF (or, for an INT4 checkpoint, its GGUF converted once into the cache). A name pulled
    before is used as recorded, with no network; otherwise it is pulled (or ModelNotFound when ``pull=False``)."""
    name = hub.parse_name(spec)
    pick = hub.cached(name)
    if pick is None:
        if not pull:
            how = "run it without --no-pull" if accept_float else f"run `edgerun pull {name}` first"
            raise ModelNotFound(f"{name} is not in the cache; {how}, on a machine that reaches the hub "
                                f"({hub_download.endpoint()}); {hub.describe_cached(name.repo_id)}")
        pick = pull_hub(name, progress, accept_float=accept_float)
    if pick.kind == "float":
        if not accept_float:
            raise ModelFormatError(f"{name} is a float checkpoint; make an INT4 file of it with "
                                   f"`edgerun quantize {name} OUT.gguf`")
        return pick.model_path
    return ready_path(pick)


def pull_hub(name: str | hub.HubName, progress: Progress | None = None, *, verify: bool = False, force: bool = False,
             accept_float: bool = False) -> hub.Pick:
    """Pull a hub name into the cache: plan (the API), check the architecture, download and verify every file,
    then (GGUF or INT4) check that llama.cpp loads its vocabulary and record its fingerprint. ``verify``
    re-hashes a cached pick first and fetches only what changed; a good one needs no network."""
    name = hub.parse_name(name) if isinstance(name, str) else name
    if verify and not force and (old := hub.cached(name)) is not None:
        bad = hub.verify(old, progress)
        if not bad:
            log.info("%s: every file matches its recorded sha256", name)
            return old
        log.warning("%s: %s changed on disk since it was pulled; fetching it again", name, ", ".join(bad))
        hub.forget(old, bad)
    plan = hub_download.plan(name, accept_float=accept_float, progress=progress)
    if plan.kind in ("int4", "float"):
        _check_checkpoint_arch(name, plan.config)
    pick = hub_download.download(plan, progress=progress, force=force)
    if pick.kind != "float":
        try:
            ready_path(pick)
        except ModelFormatError as e:     # llama.cpp cannot run it: nothing unusable is left looking pulled
            hub.forget(pick, list(pick.files))
            raise ModelFormatError(f"{e}; the downloaded files were removed") from None
    return hub.cached(name) or pick


def _check_checkpoint_arch(name: hub.HubName, config: dict) -> None:
    from .formats.arch import arch_for_hf

    try:
        arch_for_hf(config)
    except QuantizationError as e:
        raise ModelFormatError(f"{name}: {e} (the checkpoint's architecture is not one edgerun converts for "
                               "llama.cpp)") from None


def ready_path(pick: hub.Pick) -> Path:
    """A pulled GGUF or INT4 pick -> the GGUF to load (converting a checkpoint once). The first time, llama.cpp
    loads its vocabulary: an architecture it cannot run fails here, and the vocabulary fingerprint is recorded
    for `--draft auto`."""
    if pick.kind == "int4":
        path = converted_model(pick.directory, name=pick.repo_id.rsplit("/", 1)[-1])
    else:
        path = pick.model_path
    if "vocab_fingerprint" not in pick.extra:
        hub.set_extra(pick, vocab_fingerprint=_vocab_check(pick, path), arch=_gguf_arch(path))
    return path


def _gguf_arch(path: Path) -> str:
    import gguf

    try:
        f = gguf.GGUFReader(path).fields.get("general.architecture")
        return str(f.contents()) if f is not None else ""
    except (ValueError, OSError):
        return ""


def _vocab_check(pick: hub.Pick, path: Path) -> str:
    from .tokenizer import Tokenizer

    try:
        return Tokenizer.from_gguf(path).vocab_fingerprint
    except EdgerunError as e:
        arch = _gguf_arch(path) or "unknown"
        raise ModelFormatError(f"{pick.name}: llama.cpp cannot load {path.name} (architecture {arch!r}): {e}; "
                               "this llama.cpp build does not run that architecture, or the file is not a "
                               "model") from None


def draft_pairs(pick: hub.Pick) -> list[str]:
    """Drafters for a pulled hub model: registry models and other pulled hub models with the same vocabulary
    fingerprint and a smaller file, cached ones first, then smallest first."""
    fp = pick.extra.get("vocab_fingerprint")
    if not fp:
        return []
    found: list[tuple[bool, int, str]] = []
    for m in load_manifests().values():
        if m.vocab_fingerprint == fp and m.size < pick.size:
            found.append((not is_cached(m), m.size, m.name))
    for other in hub.list_pulled():
        if other.name != pick.name and other.extra.get("vocab_fingerprint") == fp and other.size < pick.size:
            found.append((False, other.size, other.name))
    return [n for _, _, n in sorted(found)]


def auto_draft(model: str) -> str:
    """`--draft auto`: the registry's paired drafter for a registry model; for a hub model, a model with the
    same vocabulary (draft_pairs); else (no pair, a local file) the model-free suffix drafter, whose drafts
    cost nothing to make (the gamma tuner turns it off where verifying them does not pay)."""
    model = os.fspath(model)
    if not hub.is_hub_name(model):
        return default_draft_for(model) or "suffix"
    pick = hub.cached(model)
    pairs = draft_pairs(pick) if pick is not None else []
    return pairs[0] if pairs else "suffix"


def hub_rows() -> list[dict]:
    """`edgerun list` rows for the pulled hub models: revision, files, and the drafters `--draft auto` finds."""
    rows = []
    for p in hub.list_pulled():
        pairs = draft_pairs(p) if p.kind != "float" else []
        rows.append({"name": p.name, "kind": f"hub {p.kind}", "arch": p.extra.get("arch", ""),
                     "quant": f"{p.primary if p.kind == 'gguf' else p.kind} @ {p.revision[:12]}", "size": p.size,
                     "cached": True,
                     "draft": (pairs[0] if pairs else "suffix") if p.kind != "float" else None,
                     "draft_pairs": pairs, "path": str(p.model_path), "description": f"{p.repo_id} at {p.revision}",
                     "license": "", "revision": p.revision, "requested_revision": p.requested_revision,
                     "pulled_at": p.pulled_at, "files": sorted(p.files)})
    return rows
