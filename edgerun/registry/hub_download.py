"""The hub's network side for `hf:` names: what a name resolves to on the hub (`plan`: the commit and the files
picked by registry/hub.py's rule) and the download into the verified cache (`download`: each file hashed
against the hub's LFS sha256 or git blob id before it is renamed into place, resumable, space checked
first). Everything offline (names, picking, the cache, re-verification) is registry/hub.py.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from ..errors import ChecksumError, HubError, InvalidArgument, ModelNotFound
from ..util import jsontext
from ..util.atomic import fsync_dir, write_json
from .fetch import Progress, pull_lock
from .hub import (HubName, Pick, describe_cached, hash_file, is_model_gguf, load_pick, pick_gguf, pick_path,
                  quant_tags, read_json, repo_dir, split_parts)

log = logging.getLogger(__name__)

_CHECKPOINT_FILES = re.compile(r"^(config\.json|generation_config\.json|.*\.safetensors|.*\.safetensors\.index\.json"
                               r"|tokenizer\.json|tokenizer_config\.json|tokenizer\.model|special_tokens_map\.json"
                               r"|added_tokens\.json|vocab\.json|merges\.txt|chat_template\.(jinja|json))$")
LOGIN_HINT = "log in with `hf auth login` (older clients: `huggingface-cli login`) or set HF_TOKEN"


@dataclass(frozen=True)
class HubFile:
    """One file of a repo as the hub lists it (sizes and hashes from the API, files_metadata)."""
    path: str
    size: int | None = None
    sha256: str | None = None      # LFS files: the sha256 of the content
    blob_id: str | None = None     # every file: its git blob id (sha1 over "blob SIZE\\0" + content)


@dataclass(frozen=True)
class Plan:
    """What a pull of `name` will fetch: the commit it resolved to and the files picked."""
    name: HubName
    commit: str
    kind: str                      # "gguf", "int4" (a quantized checkpoint) or "float" (for edgerun quantize)
    files: tuple[HubFile, ...]
    primary: str                   # the GGUF (first part of a split one) or "config.json" for a checkpoint
    config: dict = field(default_factory=dict, compare=False)



def _client():
    try:
        import huggingface_hub
    except ImportError:
        raise HubError("hub names (hf:ORG/REPO) need the huggingface_hub package: pip install 'edgerun[hub]'") \
            from None
    return huggingface_hub


def endpoint() -> str:
    """The hub edgerun talks to: $HF_ENDPOINT (a mirror, or a test stand-in), read at each call."""
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def _token() -> str | None:
    return os.environ.get("HF_TOKEN") or None     # None: huggingface_hub's own lookup (a stored login)


def _network_errors() -> tuple[type[BaseException], ...]:
    _client()
    from huggingface_hub import errors as e_

    kinds: list[type[BaseException]] = [ConnectionError, TimeoutError, e_.OfflineModeIsEnabled,
                                        e_.LocalEntryNotFoundError]
    for mod in ("httpx2", "httpx", "requests"):
        with contextlib.suppress(ImportError, AttributeError):
            m = __import__(mod)
            kinds.append(m.TransportError if hasattr(m, "TransportError") else m.ConnectionError)
    return tuple(kinds)


@contextlib.contextmanager
def _hub_errors(name: HubName) -> Iterator[None]:
    """huggingface_hub's exceptions -> edgerun's, each saying what to do."""
    _client()
    from huggingface_hub import errors as e_

    try:
        yield
    except e_.GatedRepoError as e:
        msg = (getattr(e, "server_message", "") or "").strip().replace("\n", " ").rstrip(".")
        raise HubError(f"{name}: {name.repo_id} is a gated repository and this request was not let in"
                       f"{': ' + msg if msg else ''}; accept its terms on its page at {endpoint()}/{name.repo_id} "
                       f"and {LOGIN_HINT}") from None
    except e_.RevisionNotFoundError:
        raise ModelNotFound(f"{name}: {name.repo_id} has no revision {name.revision!r} on {endpoint()}; expected "
                            "a branch, tag or commit of the repository") from None
    except e_.RepositoryNotFoundError:
        auth = "" if _token() else f" (if it is private, {LOGIN_HINT})"
        raise ModelNotFound(f"{name}: no repository {name.repo_id} on {endpoint()}{auth}") from None
    except _network_errors() as e:
        why = "HF_HUB_OFFLINE is set" if isinstance(e, e_.OfflineModeIsEnabled) else \
            f"no network, or a proxy or firewall in the way: {type(e).__name__}"
        raise HubError(f"{name}: cannot reach the hub at {endpoint()} ({why}); {describe_cached(name.repo_id)}") \
            from None
    except e_.HfHubHTTPError as e:
        msg = (getattr(e, "server_message", "") or str(e)).strip().splitlines()[0]
        raise HubError(f"{name}: the hub at {endpoint()} answered an error: {msg}") from None


def _listing(info) -> list[HubFile]:
    files = []
    for s in info.siblings or ():
        lfs = s.lfs
        files.append(HubFile(s.rfilename, s.size if s.size is not None else (lfs.size if lfs else None),
                             lfs.sha256 if lfs else None, s.blob_id))
    return sorted(files, key=lambda f: f.path)


def plan(name: HubName, *, accept_float: bool = False, progress: Progress | None = None) -> Plan:
    """Ask the hub what `name` is (one API call, plus config.json for a checkpoint repo) and pick its files."""
    hh = _client()
    with _hub_errors(name):
        info = hh.HfApi(endpoint=endpoint(), token=_token()).model_info(
            name.repo_id, revision=name.revision, files_metadata=True)
    commit = info.sha
    if not commit:
        raise HubError(f"{name}: the hub at {endpoint()} gave no commit for {name.repo_id}; expected a Hugging Face "
                       "hub (is HF_ENDPOINT right?)")
    files = _listing(info)
    by_path = {f.path: f for f in files}
    paths = list(by_path)
    ggufs = [p for p in paths if is_model_gguf(p)]
    if name.file is not None:
        hit = next((p for p in paths if p.lower() == name.file.lower()), None)
        if hit is None:
            raise ModelNotFound(f"{name}: {name.repo_id} has no file {name.file}; {_offer(paths)}")
        parts = split_parts(paths, hit)
        return Plan(name, commit, "gguf", tuple(by_path[p] for p in parts), parts[0])
    if ggufs:
        first = pick_gguf(paths, name.quant)
        if first is None:
            raise ModelNotFound(f"{name}: no GGUF in {name.repo_id} has the quant tag {name.quant}; {_offer(paths)}")
        parts = split_parts(paths, first)
        return Plan(name, commit, "gguf", tuple(by_path[p] for p in parts), parts[0])
    if name.quant is not None:
        raise ModelNotFound(f"{name}: {name.repo_id} holds no GGUF file, so a quant tag names nothing; "
                            f"{_offer(paths)}")
    if "config.json" not in by_path or not any(p.endswith(".safetensors") for p in paths):
        raise ModelNotFound(f"{name}: {name.repo_id} holds neither a GGUF file nor a safetensors checkpoint; "
                            f"{_offer(paths)}")
    repo_dir(name.repo_id).mkdir(parents=True, exist_ok=True)
    with pull_lock(repo_dir(name.repo_id) / "repo"):
        config_dir = _fetch(name, commit, by_path["config.json"], progress)
    try:        # from the network: nested too deep or not UTF-8 is refused as not JSON, and so is a non-object
        config = jsontext.loads((config_dir / "config.json").read_text(encoding="utf-8"), "config.json")
    except (ValueError, InvalidArgument) as e:
        raise HubError(f"{name}: config.json is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise HubError(f"{name}: config.json is a JSON {type(config).__name__}; expected a JSON object")
    picked = tuple(f for f in files if "/" not in f.path and _CHECKPOINT_FILES.match(f.path))
    if isinstance(config.get("quantization_config"), dict):
        return Plan(name, commit, "int4", picked, "config.json", config)
    if not accept_float:
        stem = name.repo_id.rsplit("/", 1)[-1].lower()
        raise HubError(f"{name}: {name.repo_id} holds float weights (its config.json has no quantization_config) "
                       f"and edgerun runs INT4 files; make one with `edgerun quantize {name} {stem}-q4.gguf`, "
                       f"then run that file, or name a GGUF or AWQ/GPTQ repository of the same model")
    return Plan(name, commit, "float", picked, "config.json", config)


def _offer(paths: Sequence[str], most: int = 40) -> str:
    def some(xs: Sequence[str]) -> str:
        return ", ".join(xs[:most]) + (f" and {len(xs) - most} more" if len(xs) > most else "") or "none"

    ggufs = [p for p in paths if p.lower().endswith(".gguf")]
    if ggufs:
        tags = quant_tags(paths)
        return f"its GGUF files: {some(ggufs)}" + (f" (quant tags: {', '.join(tags)})" if tags else "")
    return f"its files: {some(list(paths))}"


def _bar(progress: Progress | None, path: str):
    """A tqdm class for huggingface_hub's downloads that reports through edgerun's progress callback."""
    from tqdm.auto import tqdm

    class Bar(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)
            self._total, self._done = kwargs.get("total") or 0, kwargs.get("initial") or 0
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            self._done += n or 0
            if progress is not None:
                progress(f"download {path}", self._done, self._total)
            return super().update(n)

    return Bar


def _known(directory: Path) -> dict:
    return read_json(directory / ".files.json") or {}


def _fetch(name: HubName, commit: str, f: HubFile, progress: Progress | None, *, force: bool = False,
           link: bool = True) -> Path:
    """One file into COMMIT/PATH: streamed by huggingface_hub's http_get into .staging/PATH.HASH.part (a part
    left by a killed pull is resumed with a Range request), hashed, compared with the hub's hash, then renamed
    into place. Returns the commit directory. A file that another commit of the repo already holds verified
    (same hub hash and size) is hard-linked into the staging name instead and hashed the same way.

    Not hf_hub_download: since huggingface_hub 1.x it writes each download to a process-unique temporary that
    a later run never reuses (a killed pull starts over), and it checks no hash."""
    hh = _client()
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    from ..version import __version__

    root = repo_dir(name.repo_id)
    final_dir = root / commit
    final = final_dir / f.path
    known = _known(final_dir)
    if not force and f.path in known and final.is_file() and final.stat().st_size == known[f.path]["size"]:
        return final_dir
    part = root / ".staging" / f"{f.path}.{(f.sha256 or f.blob_id or commit)[:16]}.part"
    part.parent.mkdir(parents=True, exist_ok=True)
    have = part.stat().st_size if part.is_file() else 0
    if force or (f.size is not None and have > f.size):
        part.unlink(missing_ok=True)
        have = 0
    same = _same_file_elsewhere(root, commit, f) if link and not force else None
    if same is not None:          # unchanged since a commit pulled before: linked (one copy on disk), then hashed
        part.unlink(missing_ok=True)
        try:
            os.link(same, part)
        except OSError:
            shutil.copyfile(same, part)
        log.info("%s: %s is unchanged since commit %s; linked, not downloaded", name, f.path, same.parts[-1 - len(
            Path(f.path).parts)][:12])
    elif f.size is None or have < f.size:
        if have:
            log.info("%s: resuming %s at byte %d of %s", name, f.path, have, f.size)
        url = hh.hf_hub_url(name.repo_id, f.path, revision=commit, endpoint=endpoint())
        headers = build_hf_headers(token=_token(), library_name="edgerun", library_version=__version__)
        with _hub_errors(name), _drop_if_empty(part), open(part, "ab") as out:
            try:
                accepts = inspect.signature(http_get).parameters     # 1.x: a bar class; 0.x: a bar (private)
                bar = {"tqdm_class": _bar(progress, f.path)} if "tqdm_class" in accepts else \
                    {"_tqdm_bar": _bar(progress, f.path)(total=f.size, initial=have)} if "_tqdm_bar" in accepts else {}
                http_get(url, out, resume_size=have, headers=headers, expected_size=f.size,
                         displayed_filename=f.path, **bar)
            except OSError as e:        # a size mismatch or a write error: the part is kept for the next try
                from huggingface_hub.errors import HfHubHTTPError

                if isinstance(e, (HfHubHTTPError, *_network_errors())):
                    raise                # the hub's answer or the network: said by _hub_errors
                raise HubError(f"{name}: downloading {f.path} failed ({e}); run the pull again to resume it") \
                    from None
    sha, blob = hash_file(part, progress, f"verify {f.path}")
    want, got, kind = (f.sha256, sha, "sha256") if f.sha256 else (f.blob_id, blob, "git blob id")
    size = part.stat().st_size
    if (want is not None and got != want) or (f.size is not None and size != f.size):
        part.unlink(missing_ok=True)
        if same is not None:     # the copy of the earlier commit changed on disk since: download it after all
            log.warning("%s: %s of an earlier commit no longer matches its hash; downloading it", name, f.path)
            return _fetch(name, commit, f, progress, link=False)
        raise ChecksumError(f"{name}: {f.path} as downloaded ({size} bytes, {kind} {got}) does not match the hub's "
                            f"({f.size} bytes, {kind} {want}); it was deleted. Pull again; if it fails again, a "
                            "proxy, a mirror or the disk is corrupting data")
    if want is None:
        log.warning("%s: the hub gave no hash for %s; only its size was checked", name, f.path)
    final.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(part, 0o644)
    os.replace(part, final)
    fsync_dir(final.parent)
    known = _known(final_dir)
    known[f.path] = {"size": size, "sha256": sha, "hub_hash": f"{kind}:{want}" if want else None}
    write_json(final_dir / ".files.json", known)
    for stale in part.parent.glob(f"{Path(f.path).name}.*.part"):      # parts of other revisions of this file
        stale.unlink(missing_ok=True)
    return final_dir


def _same_file_elsewhere(root: Path, commit: str, f: HubFile) -> Path | None:
    """A file verified under another commit of this repo with the hash and size the hub gives for `f` now (a
    new commit that changed only a README leaves the weights as they were): linked instead of downloaded."""
    if f.size is None or not (f.sha256 or f.blob_id):
        return None
    want = f"sha256:{f.sha256}" if f.sha256 else f"git blob id:{f.blob_id}"
    for d in sorted(root.iterdir()) if root.is_dir() else ():
        if d.name == commit or d.name.startswith(".") or d.name == "picks" or not d.is_dir():
            continue
        for path, rec in _known(d).items():
            if rec.get("hub_hash") == want and rec.get("size") == f.size:
                p = d / path
                if p.is_file() and p.stat().st_size == f.size:
                    return p
    return None


def _drop_unused_commits(root: Path) -> None:
    """Remove the commit directories of a repo that no pick names any more (a name pulled again moved on):
    files still in use were linked into the new commit, so only changed or dropped files go."""
    used = {d.get("revision") for f in (root / "picks").glob("*.json") if (d := read_json(f)) is not None}
    unreadable = [f for f in (root / "picks").glob("*.json") if read_json(f) is None]
    if unreadable:               # a record being written or damaged: keep everything
        return
    for d in root.iterdir():
        if d.is_dir() and not d.name.startswith(".") and d.name != "picks" and d.name not in used:
            log.info("%s: removing commit %s, which no pulled name uses any more", root.relative_to(root.parents[1]),
                     d.name[:12])
            shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def _drop_if_empty(part: Path) -> Iterator[None]:
    """A download that failed before its first byte leaves no empty part behind."""
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if part.stat().st_size == 0:
                part.unlink()


def _check_space(plan: Plan) -> None:
    """Free disk space for the files still to fetch (sizes from the API), and for a checkpoint's conversion."""
    root = repo_dir(plan.name.repo_id)
    known = _known(root / plan.commit)
    todo = [f for f in plan.files if f.path not in known and _same_file_elsewhere(root, plan.commit, f) is None]
    need = sum(f.size or 0 for f in todo)     # files an earlier commit holds unchanged are linked: no room needed
    if plan.kind == "int4":                # the converted GGUF is about as large as the INT4 weights
        need += sum(f.size or 0 for f in plan.files if f.path.endswith(".safetensors"))
    probe = root
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need > free:
        what = f"{len(todo)} file{'' if len(todo) == 1 else 's'}" + (", and its conversion" if plan.kind == "int4" else "")
        raise HubError(f"{plan.name}: not enough free disk space in {root}: the download needs {need / 1e6:.0f} MB "
                       f"({what}), {free / 1e6:.0f} MB free")


def download(plan: Plan, *, progress: Progress | None = None, force: bool = False) -> Pick:
    """Fetch the planned files (each verified before it is renamed into place), then write the pick record."""
    root = repo_dir(plan.name.repo_id)
    root.mkdir(parents=True, exist_ok=True)
    with pull_lock(root / "repo"):
        _check_space(plan)
        t0 = time.perf_counter()
        for f in plan.files:
            _fetch(plan.name, plan.commit, f, progress, force=force)
        known = _known(root / plan.commit)
        old = load_pick(pick_path(plan.name))
        record = {"name": str(plan.name), "repo_id": plan.name.repo_id, "requested_revision": plan.name.revision,
                  "revision": plan.commit, "kind": plan.kind, "primary": plan.primary,
                  "files": {f.path: known[f.path] for f in plan.files}, "endpoint": endpoint(),
                  "pulled_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "extra": old.extra if old is not None and old.revision == plan.commit else {}}
        write_json(pick_path(plan.name), record)
        _drop_unused_commits(root)
        log.info("pulled %s (%s, %d files) in %.1f s", plan.name, plan.commit[:12], len(plan.files),
                 time.perf_counter() - t0)
    pick = load_pick(pick_path(plan.name))
    assert pick is not None
    return pick
