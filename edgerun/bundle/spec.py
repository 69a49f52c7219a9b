"""What a bundle is for: the request (BundleSpec), the board it describes (Target), what was written
(BundleResult), and the error every step raises."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..device.profiles import load_profile
from ..errors import EdgerunError, InvalidArgument

# glibc of the boards' usual systems: the newest manylinux tag the bundle's wheels may carry
DEFAULT_GLIBC = {"rpi": "2.36",       # Raspberry Pi OS bookworm (Debian 12)
                 "jetson": "2.35",    # JetPack 6 (Ubuntu 22.04)
                 "generic": "2.31"}   # Debian 11 / Ubuntu 20.04 and newer

Progress = Callable[[str, int, int], None]      # (stage, done, total), as edgerun.registry reports
Say = Callable[[str], None]                     # one line of news about a long step


class BundleError(EdgerunError):
    """A bundle cannot be made as asked (no wheel for the target, a pip download failed, ...)."""


@dataclass(frozen=True)
class BundleSpec:
    """What to bundle: a device profile, the models, the board's Python, and where it goes."""

    profile: str
    out: Path
    models: tuple[str, ...] = ()              # registry names or NAME@VARIANT; () = the default model
    draft: str = "auto"                       # auto (the registry's pair, else suffix), none, suffix, lookup, or a name
    python: str = "3.11"
    glibc: str | None = None                  # newest glibc the wheels may need; None = the profile family's
    llama_wheel: Path | None = None
    extras: tuple[str, ...] = ("serve",)


@dataclass(frozen=True)
class BundleResult:
    path: Path
    size: int
    n_files: int
    seconds: float
    manifest: dict = field(repr=False, default_factory=dict)


@dataclass(frozen=True)
class Target:
    """The board the bundle is for."""

    profile: str
    machine: str              # x86_64 | aarch64
    python: str               # "3.11"
    glibc: str                # "2.36"
    tegra: bool

    @property
    def platforms(self) -> list[str]:
        """pip --platform values: every manylinux tag up to this glibc (pip does not expand them), and the
        plain linux tag a wheel built from source carries."""
        major, minor = (int(x) for x in self.glibc.split("."))
        tags = [f"manylinux_{major}_{m}_{self.machine}" for m in range(minor, 16, -1)]
        tags.append(f"manylinux2014_{self.machine}")
        if self.machine == "x86_64":
            tags += ["manylinux2010_x86_64", "manylinux1_x86_64"]
        tags.append(f"linux_{self.machine}")
        return tags


def _normal_machine(m: str) -> str:
    return {"amd64": "x86_64", "x86_64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}.get(m.lower(), m)


def target_for(spec: BundleSpec) -> Target:
    """The board a profile describes: Linux, its CPU architecture, the Python and glibc asked for."""
    prof = load_profile(spec.profile)
    if prof.match.system not in (None, "Linux"):
        raise BundleError(f"profile {prof.name} is for {prof.match.system}; bundles are for Linux boards "
                          "(systemd): install with pip there")
    machines = sorted({_normal_machine(m) for m in prof.match.machine})
    if len(machines) != 1 or machines[0] not in ("x86_64", "aarch64"):
        raise BundleError(f"profile {prof.name} does not name one CPU architecture (match.machine: "
                          f"{list(prof.match.machine)}); expected x86_64 or aarch64")
    if not re.fullmatch(r"3\.(1[0-9]|[2-9][0-9])", spec.python):
        raise InvalidArgument(f"--python {spec.python!r}: expected the board's CPython as MAJOR.MINOR, 3.10 or "
                              "newer (Raspberry Pi OS bookworm: 3.11)")
    family = "rpi" if prof.name.startswith("rpi") else "jetson" if prof.match.tegra else "generic"
    glibc = spec.glibc or DEFAULT_GLIBC[family]
    if not re.fullmatch(r"2\.[0-9]{2}", glibc) or int(glibc.split(".")[1]) < 17:
        raise InvalidArgument(f"--glibc {glibc!r}: expected the board's glibc as 2.NN, 2.17 or newer "
                              "(`ldd --version` on the board)")
    return Target(profile=prof.name, machine=machines[0], python=spec.python, glibc=glibc,
                  tegra=bool(prof.match.tegra))
