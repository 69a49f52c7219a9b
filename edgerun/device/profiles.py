"""Device profiles: the schema, strict loading from device_profiles/ and the user's directory, `extends`.


A profile is a strict YAML file (device_profiles/*.yaml, or a user file) read into
frozen dataclasses: an unknown or mistyped key is an error naming the key and the file. User
profiles live in $EDGERUN_PROFILES_DIR (default ~/.config/edgerun/profiles); a user file with the
name of a shipped profile replaces it, and `extends: <name>` starts from another profile and
overrides only the keys given.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import psutil

from ..util import strict_yaml
from ..util.resources import data_dir
from ..config import GAMMA_LIMIT, BackendArgs
from ..errors import EdgerunError, InvalidArgument, ProfileError


log = logging.getLogger(__name__)


GiB = 1024 ** 3
MiB = 1024 ** 2


# ----------------------------------------------------------------------------------------------
# The schema (field defaults are what a profile gets when it leaves a key out)
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Match:
    """How to recognise the device. Every condition given must hold; empty ones are ignored."""

    priority: int = 0                          # higher wins among matching profiles
    system: str | None = None                  # platform.system(): Linux | Darwin | Windows
    machine: tuple[str, ...] = ()              # platform.machine() values (x86_64, aarch64, arm64)
    tegra: bool | None = None                  # True: /etc/nv_tegra_release or 'nvidia,tegra*' in the device tree
    board_any: tuple[str, ...] = ()            # substrings of /proc/device-tree/model or .../compatible
    cpu_brand_any: tuple[str, ...] = ()        # substrings of sysctl machdep.cpu.brand_string (macOS)
    mem_gib: tuple[float, float] | None = None  # total memory range; a tie-break among equal priorities


@dataclass(frozen=True)
class Build:
    """How to build llama-cpp-python for the device (pip install with these environment variables)."""

    cmake_args: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    notes: str = ""


@dataclass(frozen=True)
class LlamaSettings:
    """llama.cpp settings; they fill edgerun.config.BackendArgs."""

    n_ctx: int = 4096
    n_threads: int | None = None               # None: physical cores
    n_batch: int = 512
    n_gpu_layers: int = 0                      # -1: every layer on the GPU
    flash_attn: bool = True                    # needed for bit-identical batched vs single-token logits
    use_mmap: bool = True
    use_mlock: bool = False
    huge_pages: bool = True                    # weights, KV cache on 2 MiB pages after loading (Linux >= 6.1)
    parallel: int = 4                          # sequences `edgerun serve` batches (--parallel; KV cache each)


@dataclass(frozen=True)
class OnnxSettings:
    providers: tuple[str, ...] = ("CPUExecutionProvider",)


@dataclass(frozen=True)
class Memory:
    """Memory the models + KV cache may use. budget_gib None: budget_fraction x total RAM."""

    total_gib: float | None = None             # datasheet total (None: whatever the machine has)
    budget_gib: float | None = None
    budget_fraction: float = 0.75
    unified: bool = False                      # CPU and GPU share it (Jetson, Apple)


@dataclass(frozen=True)
class Priors:
    """Datasheet figures: the roofline the gamma tuner uses before the probes have run."""

    bandwidth_gbs: float | None = None         # DRAM bandwidth, GB/s (1e9 bytes/s)
    peak_gflops: float | None = None           # dense compute of the path llama.cpp uses, GFLOP/s
    compute: str = "cpu"                       # cpu | cuda | metal: which probe variant applies
    source: str = ""


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    description: str = ""
    extends: str | None = None
    match: Match = Match()
    build: Build = Build()
    llama: LlamaSettings = LlamaSettings()
    onnx: OnnxSettings = OnnxSettings()
    memory: Memory = Memory()
    priors: Priors = Priors()
    gamma_max: int = 8
    path: str = ""                             # file it was read from (not a YAML key)

    def backend_args(self, **overrides: Any) -> BackendArgs:
        """BackendArgs from this profile; keyword overrides whose value is None are ignored."""
        known = {f.name for f in dataclasses.fields(BackendArgs)}
        bad = sorted(set(overrides) - known)
        if bad:
            raise InvalidArgument(f"unknown backend option(s) {', '.join(bad)}; expected some of {sorted(known)}")
        values = {f.name: getattr(self.llama, f.name) for f in dataclasses.fields(LlamaSettings) if f.name in known}
        values["providers"] = tuple(self.onnx.providers)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return BackendArgs(**values)

    def budget_bytes(self, total_bytes: int | None = None) -> int:
        """Memory the models may use on this device (profile budget, else a fraction of total RAM)."""
        if self.memory.budget_gib is not None:
            return int(self.memory.budget_gib * GiB)
        total = total_bytes if total_bytes is not None else psutil.virtual_memory().total
        return int(self.memory.budget_fraction * total)

    def to_dict(self) -> dict:
        return _to_plain(self)


_NOT_KEYS = {"path"}


# ----------------------------------------------------------------------------------------------
# Strict YAML -> dataclass conversion
# ----------------------------------------------------------------------------------------------



def _read_yaml(path: Path) -> dict:
    return strict_yaml.read_mapping(path, ProfileError, "profile")


def _build(cls: type, data: dict, where: str, path: Path):
    return strict_yaml.build(cls, data, path=path, error=ProfileError, where=where, exclude=_NOT_KEYS)


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [_to_plain(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: _to_plain(v) for k, v in obj.items()}
    return obj


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# ----------------------------------------------------------------------------------------------
# Finding and loading profiles
# ----------------------------------------------------------------------------------------------

def user_profiles_dir() -> Path:
    env = os.environ.get("EDGERUN_PROFILES_DIR")
    return Path(env).expanduser() if env else Path.home() / ".config" / "edgerun" / "profiles"


def _shipped_dir() -> Path:
    return data_dir("device_profiles")


def _profile_files() -> dict[str, Path]:
    """name -> file; user files replace shipped ones of the same name."""
    files: dict[str, Path] = {}
    for d in (_shipped_dir(), user_profiles_dir()):
        if d.is_dir():
            for p in sorted(d.glob("*.yaml")):
                files[p.stem] = p
    return files


def list_profiles() -> list[str]:
    return sorted(_profile_files())


def _raw_profile(path: Path, files: dict[str, Path], chain: tuple[Path, ...] = ()) -> dict:
    data = _read_yaml(path)
    _build(DeviceProfile, {"name": data.get("name", path.stem), **data}, "", path)   # key check of this file alone
    parent = data.get("extends")
    if parent is None:
        return data
    base_path = files.get(parent)
    if base_path is None or base_path.resolve() == path.resolve():
        # a user file extending the shipped profile of the same name
        shipped = _shipped_dir() / f"{parent}.yaml"
        if not shipped.is_file() or shipped.resolve() == path.resolve():
            raise ProfileError(f"{path}: extends unknown profile {parent!r}; known: {', '.join(sorted(files))}")
        base_path = shipped
    if base_path.resolve() in chain:
        raise ProfileError(f"{path}: 'extends: {parent}' makes a cycle through {base_path}")
    base = _raw_profile(base_path, files, chain + (path.resolve(),))
    merged = _merge(base, {k: v for k, v in data.items() if k != "extends"})
    merged.pop("extends", None)
    merged["name"] = data.get("name", path.stem)     # the name is the file's own, never inherited
    return merged


def _load_file(path: Path, files: dict[str, Path]) -> DeviceProfile:
    raw = _raw_profile(path, files)
    raw.setdefault("name", path.stem)
    prof = _build(DeviceProfile, raw, "", path)
    _validate(prof, path)
    return dataclasses.replace(prof, path=str(path))


def _validate(p: DeviceProfile, path: Path) -> None:
    m = p.memory
    if not 0 < m.budget_fraction <= 1:
        raise ProfileError(f"{path}: memory.budget_fraction must be in (0, 1], got {m.budget_fraction}")
    if m.budget_gib is not None and m.total_gib is not None and m.budget_gib > m.total_gib:
        raise ProfileError(f"{path}: memory.budget_gib {m.budget_gib} exceeds memory.total_gib {m.total_gib}")
    if p.match.mem_gib is not None and p.match.mem_gib[0] > p.match.mem_gib[1]:
        raise ProfileError(f"{path}: match.mem_gib must be [low, high], got {list(p.match.mem_gib)}")
    if p.priors.compute not in ("cpu", "cuda", "metal"):
        raise ProfileError(f"{path}: priors.compute must be cpu, cuda or metal, got {p.priors.compute!r}")
    if not 1 <= p.gamma_max <= GAMMA_LIMIT:
        raise ProfileError(f"{path}: gamma_max must be in 1..{GAMMA_LIMIT}, got {p.gamma_max}")
    try:
        p.backend_args()
    except EdgerunError as e:
        raise ProfileError(f"{path}: llama settings are invalid: {e}") from e


def load_profile(name_or_path: str | os.PathLike) -> DeviceProfile:
    """A profile by name (user dir first, then shipped) or by path to a YAML file."""
    files = _profile_files()
    s = str(name_or_path)
    as_path = Path(s).expanduser()
    if s.endswith((".yaml", ".yml")) or os.sep in s or as_path.is_file():
        if as_path.is_dir():
            raise ProfileError(f"profile {as_path} is a directory; expected a profile YAML file")
        if not as_path.is_file():
            raise ProfileError(f"profile file {as_path} does not exist")
        return _load_file(as_path, files)
    if s not in files:
        raise ProfileError(f"unknown device profile {s!r}; expected one of: {', '.join(sorted(files))} "
                           f"or a path to a profile YAML file")
    return _load_file(files[s], files)


def all_profiles() -> list[DeviceProfile]:
    files = _profile_files()
    return [_load_file(p, files) for _, p in sorted(files.items())]
