"""Detection: read a board's identity files below a root path and pick the profile that fits.

Every file is read below one root (`device_root()`: "/" unless $EDGERUN_DEVICE_ROOT names another
directory), so a test, `edgerun profile detect --root DIR`, deploy/install.sh --root and the emulated
Pi (bench/boards/) can point detection at a copy of a real board's files
(tests/fixtures/boards/ holds five, with their sources).
"""

from __future__ import annotations

import logging
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil

from ..errors import ProfileError
from .profiles import DeviceProfile, all_profiles, list_profiles, load_profile, user_profiles_dir


log = logging.getLogger(__name__)


GiB = 1024 ** 3
MiB = 1024 ** 2

# The identity files, relative to the root (the device-tree pair also under /sys/firmware/devicetree/base).
TEGRA_RELEASE = "etc/nv_tegra_release"
DT_MODEL = "proc/device-tree/model"
DT_COMPATIBLE = "proc/device-tree/compatible"
CPUINFO = "proc/cpuinfo"
MEMINFO = "proc/meminfo"
_DT_ALT = "sys/firmware/devicetree/base/"


def device_root() -> str:
    """Where the board's identity files are read: $EDGERUN_DEVICE_ROOT, else "/"."""
    return os.environ.get("EDGERUN_DEVICE_ROOT") or "/"

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
    cpu_model: str | None = None     # /proc/cpuinfo "Model" line (Raspberry Pi kernels write the board name)
    cpu_features: tuple[str, ...] = ()   # /proc/cpuinfo "Features" of the first CPU (arm64: asimd, asimddp, ...)
    missing: tuple[str, ...] = ()    # identity files that could not be read, as "/proc/device-tree/model"

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


def gather_facts(root: str | os.PathLike | None = None, *, system: str | None = None, machine: str | None = None,
                 sysctl: Callable[[str], str | None] | None = None) -> DeviceFacts:
    """Read the identity files under `root` (default device_root()). system/machine/sysctl default to
    this machine's."""
    r = Path(device_root() if root is None else root)
    system = system or platform.system()
    machine = machine or platform.machine()
    if sysctl is None:
        sysctl = _sysctl if system == "Darwin" else (lambda key: None)
    missing: list[str] = []

    def read(rel: str, alt: str | None = None) -> str | None:
        text = _read_text(r / rel)
        if text is None and alt is not None:
            text = _read_text(r / alt)
        if text is None:
            missing.append("/" + rel)
        return text

    rel = read(TEGRA_RELEASE)
    model = read(DT_MODEL, _DT_ALT + "model")
    compat = read(DT_COMPATIBLE, _DT_ALT + "compatible") or ""
    cpuinfo = read(CPUINFO) or ""
    meminfo = read(MEMINFO)
    fields: dict[str, str] = {}
    for ln in cpuinfo.splitlines():          # the first occurrence of each key (CPU 0, then the board lines)
        key, sep, value = ln.partition(":")
        if sep:
            fields.setdefault(key.strip().lower(), value.strip())
    cpu_brand = sysctl("machdep.cpu.brand_string")
    if cpu_brand is None:
        cpu_brand = fields.get("model name") or fields.get("hardware")
    mem = None
    for ln in (meminfo or "").splitlines():
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
        cpu_brand=cpu_brand, mem_total_bytes=mem,
        cpu_model=fields.get("model"), cpu_features=tuple(fields.get("features", "").split()),
        missing=tuple(missing) if system == "Linux" else ())


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
        hay = [("device tree", s) for s in (f.dt_model, *f.dt_compatible) if s]
        if f.cpu_model and not hay:            # only without a device tree: the device tree speaks first
            hay.append(("/proc/cpuinfo Model", f.cpu_model))
        hit = next(((s, where, h) for s in m.board_any for where, h in hay if s.lower() in h.lower()), None)
        if hit is None:
            return False, False, 0.0, []
        why.append(f"{hit[1]} {hit[2]!r} contains {hit[0]!r}")
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


def _warnings(best: DeviceProfile, f: DeviceFacts) -> list[str]:
    """What the caller should know about this choice: files that were missing, a build the CPU can't run."""
    out = []
    generic = best.match.priority == 0 and not best.match.board_any and not best.match.cpu_brand_any
    board_files = [m for m in f.missing if m in ("/" + DT_MODEL, "/" + DT_COMPATIBLE)]
    if generic and f.machine in ("aarch64", "arm64") and board_files:
        tegra = " (a Tegra board: /etc/nv_tegra_release is there)" if f.tegra_release is not None else ""
        out.append(f"{' and '.join(board_files)} missing{tegra}: the board cannot be identified, so the "
                   f"generic profile {best.name} is used; pass --profile NAME for the board's build flags")
    if generic and f.machine not in ("aarch64", "arm64") and (f.is_tegra or f.dt_model):
        # a copy of a board's files read on another machine (--root / EDGERUN_DEVICE_ROOT on an x86 host)
        board = f.dt_model or "a Tegra board"
        out.append(f"the identity files read describe {board!r}, but this machine is {f.machine}: the board "
                   f"profiles match aarch64 only, so the generic profile {best.name} is used; pass --profile NAME "
                   f"for the board's profile")
    if "/" + MEMINFO in f.missing:
        out.append(f"/{MEMINFO} missing: total memory taken from the machine running edgerun")
    if "dotprod" in best.build.cmake_args and f.cpu_features and "asimddp" not in f.cpu_features:
        out.append(f"profile {best.name} builds llama.cpp with dotprod, but /{CPUINFO} Features lack 'asimddp': "
                   f"that build would die with SIGILL on this CPU")
    return out


def detect(root: str | os.PathLike | None = None, *, system: str | None = None, machine: str | None = None,
           sysctl: Callable[[str], str | None] | None = None) -> tuple[DeviceProfile, str]:
    """The profile that fits this device (or the one whose files are copied under `root`), and why.

    Warnings (a missing identity file, a CPU the profile's build can't run on) are logged and end the reason."""
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
    warnings = _warnings(best, facts)
    for w in warnings:
        log.warning("device detection: %s", w)
    if warnings:
        reason += "; warning: " + "; warning: ".join(warnings)
    log.info("device profile %s: %s", best.name, reason)
    return best, reason


def resolve(spec: str | os.PathLike | None = "auto", root: str | os.PathLike | None = None) -> tuple[DeviceProfile, str]:
    """'auto'/None -> detect(); a name or path -> that profile. $EDGERUN_PROFILE overrides 'auto'."""
    if spec is None or str(spec) == "auto":
        forced = os.environ.get("EDGERUN_PROFILE")
        if forced:
            return load_profile(forced), f"chosen by EDGERUN_PROFILE={forced}"
        return detect(root)
    return load_profile(spec), "chosen explicitly"
