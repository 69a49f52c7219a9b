"""Device profiles: what a board is, how to recognise it, and the engine settings that suit it.

A profile is a strict YAML file (edgerun/data/device_profiles/*.yaml, or a user file) read into
frozen dataclasses: an unknown or mistyped key is an error naming the key and the file. User
profiles live in $EDGERUN_PROFILES_DIR (default ~/.config/edgerun/profiles); a user file with the
name of a shipped profile replaces it, and `extends: <name>` starts from another profile and
overrides only the keys given.

`detect(root)` reads the board's identity files below `root` (injectable, so tests can fake any
board) and returns the best matching profile with a sentence saying why.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import subprocess
import types
import typing
from collections import abc
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Mapping

import psutil
import yaml

from . import strict_yaml
from .config import BackendArgs
from .errors import EdgerunError, InvalidArgument, MemoryBudgetError, ProfileError

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
        values = {f.name: getattr(self.llama, f.name) for f in dataclasses.fields(LlamaSettings)}
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
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ProfileError(f"cannot read profile file {path}: {e.strerror}") from e
    try:
        data = strict_yaml.load(text)
    except yaml.YAMLError as e:
        raise ProfileError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: expected a mapping of profile keys at the top level, got {type(data).__name__}")
    return data


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, where: str, path: Path) -> Any:
    """Check `value` against the annotation `tp`; convert where YAML is loose (ints, '1e-5' strings)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise ProfileError(f"{path}: {where} must not be empty (null)")
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, where, path)
            except ProfileError as e:
                errors.append(str(e))
        raise ProfileError(errors[0] if len(errors) == 1 else
                           f"{path}: {where} has the wrong type: expected {_type_name(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ProfileError(f"{path}: {where} must be a mapping of {tp.__name__} keys, got {value!r}")
        return _build(tp, value, where, path)
    if origin is tuple:
        if not isinstance(value, list):
            raise ProfileError(f"{path}: {where} must be a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{where}[{i}]", path) for i, v in enumerate(value))
        if len(value) != len(args):
            raise ProfileError(f"{path}: {where} must be a list of {len(args)} items, got {value!r}")
        return tuple(_convert(v, a, f"{where}[{i}]", path) for i, (v, a) in enumerate(zip(value, args)))
    if origin in (abc.Mapping, dict):
        if not isinstance(value, dict):
            raise ProfileError(f"{path}: {where} must be a mapping, got {value!r}")
        kt, vt = args or (str, str)
        return {_convert(k, kt, f"{where} key", path): _convert(v, vt, f"{where}.{k}", path)
                for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ProfileError(f"{path}: {where} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ProfileError(f"{path}: {where} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):      # PyYAML reads 1e-5 (no dot) as a string: convert explicitly
            try:
                return float(value)
            except ValueError:
                pass
        raise ProfileError(f"{path}: {where} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ProfileError(f"{path}: {where} must be a string, got {value!r}")
    raise ProfileError(f"{path}: {where}: unsupported schema type {_type_name(tp)}")  # a bug in the schema


def _build(cls: type, data: dict, where: str, path: Path):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name not in _NOT_KEYS]
    for key in data:
        if key not in names:
            prefix = f"{where}." if where else ""
            raise ProfileError(f"{path}: unknown key {prefix}{key!r}; expected one of: {', '.join(names)}")
    kwargs = {}
    for name in names:
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], f"{where}.{name}" if where else name, path)
    try:
        return cls(**kwargs)
    except TypeError as e:   # a required key is missing
        raise ProfileError(f"{path}: {where or 'profile'}: {e}") from e


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
    return Path(str(resources.files("edgerun") / "data" / "device_profiles"))


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
    if not 1 <= p.gamma_max <= 32:
        raise ProfileError(f"{path}: gamma_max must be in 1..32, got {p.gamma_max}")
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


# ----------------------------------------------------------------------------------------------
# Detection
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DeviceFacts:
    """What detection looked at."""

    system: str
    machine: str
    tegra_release: str | None        # first line of /etc/nv_tegra_release
    dt_model: str | None             # /proc/device-tree/model
    dt_compatible: tuple[str, ...]   # /proc/device-tree/compatible entries
    cpu_brand: str | None            # macOS machdep.cpu.brand_string, or /proc/cpuinfo model name
    mem_total_bytes: int

    @property
    def is_tegra(self) -> bool:
        return self.tegra_release is not None or any(c.startswith("nvidia,tegra") for c in self.dt_compatible)


def _read_text(p: Path) -> str | None:
    try:
        return p.read_bytes().decode("utf-8", "replace")
    except OSError:
        return None


def _sysctl(key: str) -> str | None:
    try:
        out = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def gather_facts(root: str | os.PathLike = "/", *, system: str | None = None, machine: str | None = None,
                 sysctl: Callable[[str], str | None] | None = None) -> DeviceFacts:
    """Read the identity files under `root`. system/machine/sysctl default to this machine's."""
    r = Path(root)
    system = system or platform.system()
    machine = machine or platform.machine()
    if sysctl is None:
        sysctl = _sysctl if system == "Darwin" else (lambda key: None)
    rel = _read_text(r / "etc/nv_tegra_release")
    model = _read_text(r / "proc/device-tree/model") or _read_text(r / "sys/firmware/devicetree/base/model")
    compat = (_read_text(r / "proc/device-tree/compatible")
              or _read_text(r / "sys/firmware/devicetree/base/compatible") or "")
    cpu_brand = sysctl("machdep.cpu.brand_string")
    if cpu_brand is None:
        cpuinfo = _read_text(r / "proc/cpuinfo") or ""
        cpu_brand = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines()
                          if ln.lower().startswith(("model name", "hardware"))), None)
    mem = None
    meminfo = _read_text(r / "proc/meminfo")
    if meminfo:
        for ln in meminfo.splitlines():
            if ln.startswith("MemTotal:"):
                mem = int(ln.split()[1]) * 1024
    if mem is None:
        memsize = sysctl("hw.memsize")
        mem = int(memsize) if memsize and memsize.isdigit() else psutil.virtual_memory().total
    return DeviceFacts(
        system=system, machine=machine,
        tegra_release=None if rel is None else (rel.strip().splitlines() or [""])[0],
        dt_model=model.strip("\x00\n ") if model else None,
        dt_compatible=tuple(c for c in compat.split("\x00") if c.strip()),
        cpu_brand=cpu_brand, mem_total_bytes=mem)


def _match(p: DeviceProfile, f: DeviceFacts) -> tuple[bool, bool, float, list[str]]:
    """(hardware matches, memory in range, distance to memory range in GiB, evidence)."""
    m, why = p.match, []
    if m.system is not None:
        if f.system != m.system:
            return False, False, 0.0, []
        why.append(f"system {f.system}")
    if m.machine:
        if f.machine not in m.machine:
            return False, False, 0.0, []
        why.append(f"machine {f.machine}")
    if m.tegra is not None:
        if f.is_tegra != m.tegra:
            return False, False, 0.0, []
        if m.tegra:
            why.append(f"/etc/nv_tegra_release {f.tegra_release!r}" if f.tegra_release is not None
                       else "'nvidia,tegra*' in /proc/device-tree/compatible")
    if m.board_any:
        hay = [s for s in (f.dt_model, *f.dt_compatible) if s]
        hit = next(((s, h) for s in m.board_any for h in hay if s.lower() in h.lower()), None)
        if hit is None:
            return False, False, 0.0, []
        why.append(f"device tree {hit[1]!r} contains {hit[0]!r}")
    if m.cpu_brand_any:
        brand = f.cpu_brand or ""
        hit = next((s for s in m.cpu_brand_any if s.lower() in brand.lower()), None)
        if hit is None:
            return False, False, 0.0, []
        why.append(f"CPU {brand!r} contains {hit!r}")
    gib = f.mem_total_bytes / GiB
    if m.mem_gib is None:
        return True, True, 0.0, why
    lo, hi = m.mem_gib
    dist = max(lo - gib, gib - hi, 0.0)
    why.append(f"memory {gib:.1f} GiB {'in' if dist == 0 else 'OUTSIDE'} [{lo:g}, {hi:g}] GiB")
    return True, dist == 0, dist, why


def detect(root: str | os.PathLike = "/", *, system: str | None = None, machine: str | None = None,
           sysctl: Callable[[str], str | None] | None = None) -> tuple[DeviceProfile, str]:
    """The profile that fits this device (or the one whose files are faked under `root`), and why."""
    facts = gather_facts(root, system=system, machine=machine, sysctl=sysctl)
    ranked = []
    for p in all_profiles():
        ok, mem_ok, dist, why = _match(p, facts)
        if ok:
            ranked.append(((p.match.priority, mem_ok, -dist), p, why))
    if not ranked:
        raise ProfileError(
            f"no device profile matches this machine ({facts.system} {facts.machine}); "
            f"pass --profile NAME (one of {', '.join(list_profiles())}) or add a profile YAML to {user_profiles_dir()}")
    ranked.sort(key=lambda r: r[0], reverse=True)
    _, best, why = ranked[0]
    if best.match.priority == 0 and not best.match.board_any and not best.match.cpu_brand_any:
        reason = f"no board-specific profile matched; generic profile by {'; '.join(why) or 'default'}"
    else:
        reason = "; ".join(why)
    log.info("device profile %s: %s", best.name, reason)
    return best, reason


def resolve(spec: str | os.PathLike | None = "auto", root: str | os.PathLike = "/") -> tuple[DeviceProfile, str]:
    """'auto'/None -> detect(); a name or path -> that profile. $EDGERUN_PROFILE overrides 'auto'."""
    if spec is None or str(spec) == "auto":
        forced = os.environ.get("EDGERUN_PROFILE")
        if forced:
            return load_profile(forced), f"chosen by EDGERUN_PROFILE={forced}"
        return detect(root)
    return load_profile(spec), "chosen explicitly"


# ----------------------------------------------------------------------------------------------
# Memory budget
# ----------------------------------------------------------------------------------------------

def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.0f} MiB"


def check_memory_fit(profile: DeviceProfile, *, target_bytes: int, draft_bytes: int = 0, kv_bytes: int = 0,
                     n_ctx: int | None = None, overhead_bytes: int = 256 * MiB,
                     available_bytes: int | None = None) -> None:
    """Refuse (MemoryBudgetError) when target + drafter + KV cache exceed what the device can hold.

    The limit is the smaller of the profile's budget and what psutil says is available now
    (pages of an already-mapped model file count as available: the kernel can drop them).
    """
    vm = psutil.virtual_memory()
    available = vm.available if available_bytes is None else available_bytes
    budget = profile.budget_bytes(vm.total)
    limit = min(budget, available)
    need = target_bytes + draft_bytes + kv_bytes + overhead_bytes
    if need <= limit:
        log.debug("memory fit: need %s of %s (budget %s, available %s)", _gib(need), _gib(limit),
                  _gib(budget), _gib(available))
        return
    over = need - limit
    which = "the profile budget" if budget <= available else "the memory available now"
    tips = []
    if n_ctx and kv_bytes > 0:
        per_pos = kv_bytes / n_ctx
        fit_ctx = int((kv_bytes - over) / per_pos) if kv_bytes > over else 0
        if fit_ctx >= 256:
            tips.append(f"a smaller context (--n-ctx {fit_ctx // 256 * 256} or less)")
    if draft_bytes > 0:
        tips.append(f"a smaller drafter or none (--draft none saves {_gib(draft_bytes)})"
                    + (" -- enough" if draft_bytes >= over else ""))
    tips.append("a smaller or more strongly quantized target model")
    raise MemoryBudgetError(
        f"the models do not fit on {profile.name}: target {_gib(target_bytes)} + drafter {_gib(draft_bytes)} "
        f"+ KV cache {_gib(kv_bytes)} + runtime {_gib(overhead_bytes)} = {_gib(need)}, but {which} is "
        f"{_gib(limit)} (profile budget {_gib(budget)}, available now {_gib(available)}); "
        f"{_gib(over)} too much. Try {'; or '.join(tips)}")
