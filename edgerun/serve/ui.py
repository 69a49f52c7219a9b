"""The page at / (a chat and a status panel; off with --no-ui) and the JSON /status it reads.

The page is three static files shipped in the package (edgerun/serve/static/): no build step, nothing
fetched from elsewhere (the board is offline; a Content-Security-Policy of 'self' holds the page to it).
They are served without the API key (they hold no secret); every call the page makes (/status,
/v1/chat/completions) sends the key the user typed once, kept in the tab's sessionStorage. The Host and
Origin rules of the app's middleware apply to the page as to the API.

/status (behind the key like the API): the model and drafter with their files, the device profile,
tokens/s of the last generation, acceptance rate and γ, the queue and slots, the process's memory against
the profile's budget, and the board's temperatures (/sys/class/thermal) and, on a Raspberry Pi, the
firmware's throttling flags (read below $EDGERUN_DEVICE_ROOT like the board's other identity files).
"""

from __future__ import annotations

import logging
from importlib import resources
from pathlib import Path

from fastapi.responses import JSONResponse, Response

log = logging.getLogger(__name__)

FILES = {"/": ("index.html", "text/html; charset=utf-8"),
         "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
         "/ui/style.css": ("style.css", "text/css; charset=utf-8")}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

# The Pi firmware's get_throttled bits (the same as `vcgencmd get_throttled`)
THROTTLE_BITS = {0: "under-voltage now", 1: "ARM frequency capped now", 2: "throttled now",
                 3: "soft temperature limit now", 16: "under-voltage has occurred", 17: "frequency capping has occurred",
                 18: "throttling has occurred", 19: "soft temperature limit has occurred"}
PI_THROTTLED = "devices/platform/soc/soc:firmware/get_throttled"


def install(app, state) -> None:
    """Register /status and, unless --no-ui, the page's files (answered without the API key)."""
    if state.config.ui:
        for path, (name, ctype) in FILES.items():
            # HEAD answers like GET without the body: Ollama's clients and health checkers probe `HEAD /`
            app.add_api_route(path, _file_route(name, ctype), methods=["GET", "HEAD"], include_in_schema=False)
            state.open_paths.add(path)

    @app.get("/status")
    async def status():
        return JSONResponse(status_of(state), headers={"Cache-Control": "no-store"})


def _file_route(name: str, ctype: str):
    data = resources.files("edgerun.serve").joinpath("static", name).read_bytes()   # read once, at start

    async def serve_file():
        return Response(data, media_type=ctype, headers={"Cache-Control": "no-cache", "Content-Security-Policy": CSP,
                                                         "X-Content-Type-Options": "nosniff"})
    return serve_file


def status_of(state, sysfs: Path | None = None) -> dict:
    """What the status panel shows, as JSON-ready values (None where not known). sysfs: the board's /sys
    (default: below $EDGERUN_DEVICE_ROOT, where device detection reads the board too)."""
    import os

    import psutil

    from ..device.detect import device_root

    sysfs = sysfs if sysfs is not None else Path(device_root()) / "sys"

    sch = state.scheduler
    runtime = sch.runtime
    m = state.metrics
    if sch.load_error is not None:
        phase = "error"
    elif sch.draining:
        phase = "shutting_down"
    elif not sch.ready.is_set():
        phase = "loading"
    else:
        phase = "ready"
    profile = getattr(runtime, "profile", None)
    files = []
    target_path = getattr(getattr(runtime, "target", None), "path", None)
    draft_backend = getattr(getattr(runtime, "drafter", None), "backend", None)
    for role, path in (("target", target_path), ("drafter", getattr(draft_backend, "path", None))):
        if path is not None:
            try:
                size = Path(path).stat().st_size if Path(path).is_file() else None
            except OSError:
                size = None
            files.append({"role": role, "path": str(path), "bytes": size})
    vm = psutil.virtual_memory()
    budget = None
    if profile is not None:
        try:
            budget = profile.budget_bytes(vm.total)
        except Exception:                           # noqa: BLE001 - a profile without a budget: none shown
            budget = None
    rate = m.accepted / m.drafted if m.drafted else None
    return {
        "status": phase,
        "model": state.model_id,
        "drafter": getattr(runtime, "draft_name", None) if runtime is not None else state.config.draft,
        "profile": None if profile is None else {"name": profile.name, "description": profile.description},
        "files": files,
        "n_ctx": getattr(runtime, "n_ctx", None) if runtime is not None else None,
        "speed": {"tokens_per_s": round(m.last_tokens_per_s, 2), "acceptance_rate": None if rate is None else round(rate, 4),
                  "gamma": m.gamma, "tokens_total": m.tokens, "generations": sum(m.generations.values())},
        "queue": {"depth": sch.depth, "limit": sch.queue_limit, "slots": sch.n_slots, "running": len(sch.running_jobs)},
        "memory": {"rss_bytes": psutil.Process(os.getpid()).memory_info().rss, "budget_bytes": budget,
                   "total_bytes": vm.total, "available_bytes": vm.available},
        "thermal": thermal_zones(sysfs),
        "throttled": pi_throttled(sysfs),
        "integrity": dict(state.integrity),
    }


def thermal_zones(sysfs: Path = Path("/sys")) -> list[dict]:
    """Each /sys/class/thermal/thermal_zone*/temp (millidegrees Celsius) with its zone's type."""
    out = []
    for zone in sorted((sysfs / "class/thermal").glob("thermal_zone*"),
                       key=lambda p: int(p.name[12:]) if p.name[12:].isdigit() else 0):
        try:
            milli = int((zone / "temp").read_text().strip())
        except (OSError, ValueError):
            continue                              # a zone without a readable temperature (some are write-only)
        try:
            kind = (zone / "type").read_text().strip()
        except OSError:
            kind = ""
        out.append({"zone": zone.name, "type": kind, "celsius": round(milli / 1000, 1)})
    return out


def pi_throttled(sysfs: Path = Path("/sys")) -> dict | None:
    """The Raspberry Pi firmware's throttled word and its flags; None off a Pi."""
    try:
        raw = (sysfs / PI_THROTTLED).read_text().strip()
        value = int(raw, 16)
    except (OSError, ValueError):
        return None
    return {"raw": hex(value), "flags": [text for bit, text in THROTTLE_BITS.items() if value >> bit & 1]}
