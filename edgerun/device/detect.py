"""Detection: read a board's identity files below a root path and pick the profile that fits.
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
