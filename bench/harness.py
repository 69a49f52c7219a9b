"""What the bench drivers share: timing a generation, tables, JSON results, child processes, peer servers.

A driver (bench/<name>.py) parses its options, runs what it measures with these pieces and ends with
`print_table` and `write_result` (bench/results/<name>.json). Nothing here imports edgerun at module level,
so a driver can put another source tree first on the path before edgerun is imported.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


# ---- options ---------------------------------------------------------------------------------------------------

_OPTIONS = {   # the options most drivers take: (type, help)
    "model": (str, "registry name or path of the model"),
    "models": (str, "comma-separated models or configurations"),
    "tokens": (int, "tokens generated per run"),
    "threads": (int, "CPU threads"),
    "ctx": (int, "context length in positions"),
    "gamma": (int, "draft length"),
    "gammas": (str, "comma-separated draft lengths"),
    "rounds": (int, "rounds (alternating what is compared)"),
    "repeats": (int, "runs per configuration"),
    "reps": (int, "repetitions per measurement"),
    "clients": (int, "concurrent clients"),
    "windows": (int, "perplexity windows"),
    "work": (str, "working directory for intermediate files"),
    "out": (str, "JSON result file"),
}


def arg_parser(doc: str | None, **defaults: Any) -> argparse.ArgumentParser:
    """An ArgumentParser for a driver (its module docstring as the description) with the shared options it
    names, each with its default: arg_parser(__doc__, model="smollm2-135m-instruct", tokens=128, threads=2).
    An `out` default that is a bare name means bench/results/<name>.json."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in defaults.items():
        kind, what = _OPTIONS[name]
        if name == "out" and default is not None and len(Path(default).parts) == 1:
            default = str(RESULTS / f"{default}.json")
        ap.add_argument(f"--{name}", type=kind, default=default, help=f"{what} (default: {default})")
    return ap


# ---- timing a generation -------------------------------------------------------------------------------------

@dataclass
class Timed:
    """A stream of generated tokens as it arrived: a perf_counter stamp (and process CPU time) per token."""

    t_start: float
    stamps: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.stamps)

    @property
    def rate(self) -> float:
        """Decode tokens/s: tokens after the first over the time since the first (prefill excluded)."""
        return (self.n - 1) / (self.stamps[-1] - self.stamps[0]) if self.n > 1 else 0.0

    @property
    def cpu_per_token(self) -> float:
        """CPU seconds of this process (all its threads) per token after the first."""
        return (self.cpu[-1] - self.cpu[0]) / (self.n - 1) if self.n > 1 else 0.0

    @property
    def ttft(self) -> float:
        return self.stamps[0] - self.t_start if self.stamps else 0.0


def timed_tokens(stream: Iterable[Any], limit: int | None = None) -> Timed:
    """Iterate a token stream (edgerun Steps, or plain token ids as llama_cpp's generate yields), stamping each
    item; stop after `limit` items (for an endless stream)."""
    out = Timed(time.perf_counter())
    for item in stream:
        out.stamps.append(time.perf_counter())
        out.cpu.append(time.process_time())
        out.tokens.append(getattr(item, "token", item))
        out.text.append(getattr(item, "text", ""))
        if limit is not None and out.n >= limit:
            break
    return out


def per_call_us(fn: Callable[[], Any], n: int) -> float:
    """Microseconds per call of fn() over n calls."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


# ---- tables and results --------------------------------------------------------------------------------------

def _cell(v: Any, fmt: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and fmt:
        return format(v, fmt)
    return str(v)


def print_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, fmt: str = ".2f", title: str = "",
                markdown: bool = False, file=None) -> None:
    """A table of rows: floats formatted with `fmt` (a string cell is printed as it is), None shown as '-'.
    Plain text (first column left-aligned, the rest right-aligned) or, with markdown=True, a Markdown table
    as docs/ pages hold them."""
    cells = [[_cell(v, fmt) for v in r] for r in rows]
    if title:
        print(title, file=file)
    if markdown:
        print("| " + " | ".join(headers) + " |", file=file)
        print("|" + "|".join(["---"] + ["---:"] * (len(headers) - 1)) + "|", file=file)
        for r in cells:
            print("| " + " | ".join(r) + " |", file=file)
        return
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(vals: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(vals, widths)))

    print(line(list(headers)), file=file)
    for r in cells:
        print(line(r), file=file)


def write_result(name: str | Path, data: Any, *, indent: int = 1) -> Path:
    """Write a driver's result as JSON: a bare name goes to bench/results/<name>.json, a path as given. The
    file is replaced whole (a temporary beside it, renamed), so a run stopped while saving partial results
    leaves the previous ones."""
    path = Path(name)
    if path.suffix != ".json" and len(path.parts) == 1:
        path = RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=indent, default=str))
    os.replace(tmp, path)
    return path


# ---- child processes -----------------------------------------------------------------------------------------

def run_json_child(fn: Callable[[], Any]) -> None:
    """The child side: print fn()'s result as the last line of stdout."""
    print(json.dumps(fn()))


def child_json(cmd: Sequence[str], *, env: dict | None = None, cwd: str | None = None,
               timeout: float | None = None) -> Any:
    """Run a child that ends with run_json_child; return what it printed (RuntimeError with its stderr on
    failure)."""
    r = subprocess.run(list(cmd), env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd[:3]))} ... failed ({r.returncode}): {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---- peer servers ----------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A server subprocess with its output collected; ready once GET /health answers 200."""

    def __init__(self, name: str, cmd: list[str], url: str, env: dict | None = None, cwd: str | None = None) -> None:
        self.name, self.url = name, url
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     cwd=cwd)
        self.lines: list[str] = []
        threading.Thread(target=lambda: [self.lines.append(line.rstrip()) for line in self.proc.stdout],
                         daemon=True).start()

    def wait_ready(self, timeout: float = 600) -> None:
        import httpx            # the serve extra's client: only drivers that start servers need it

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited:\n" + "\n".join(self.lines[-30:]))
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"{self.name} never became ready:\n" + "\n".join(self.lines[-30:]))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def __enter__(self) -> "Proc":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def llama_server(binary: str | Path, model_path: str | Path, *, threads: int, extra: Sequence[str] = (),
                 env: dict | None = None, name: str = "llama-server") -> Proc:
    """llama.cpp's llama-server on a free local port with `threads` threads (generation and batch); `extra`
    adds its options (-fa on, -ngl 0, -np, -c, -md ...)."""
    port = free_port()
    cmd = [str(binary), "-m", str(model_path), "-t", str(threads), "-tb", str(threads),
           "--host", "127.0.0.1", "--port", str(port), *extra]
    return Proc(name, cmd, f"http://127.0.0.1:{port}", env=env)


def edgerun_cmd(*args: str) -> list[str]:
    """`python -m edgerun ARGS` with this interpreter."""
    return [sys.executable, "-m", "edgerun", *args]


# ---- paired ratios -------------------------------------------------------------------------------------------

def geomean_interval(ratios: Sequence[float]) -> tuple[float, float, float]:
    """Geometric mean of paired ratios and its ~95% interval (mean of the logs +- 2 standard errors)."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.mean(logs)
    half = 2.0 * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else float("nan")
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)
