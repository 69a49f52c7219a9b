"""Run the real `edgerun serve` for tests: as a subprocess (real signals, real exit status) or
in-process on a thread (so a test can hold a generation at a gate and observe the queue).

Both listen on a free loopback port (port 0); nothing here imitates the server.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from edgerun.engine import blocking

TINY_ARGS = ("--draft", "none", "--profile", "generic-x86_64-cpu", "--threads", "1", "--ctx", "256")


def clean_env(home: Path, **extra: str) -> dict:
    """os.environ without the developer's EDGERUN_* / systemd variables, with EDGERUN_HOME=home."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("EDGERUN_") and k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    env["EDGERUN_HOME"] = str(home)
    env.update(extra)
    return env


class ServerProcess:
    """`python -m edgerun serve ARGS --port 0` with stdout+stderr collected line by line."""

    def __init__(self, args, *, env: dict, wait_listening: bool = True, timeout: float = 60) -> None:
        args = [str(a) for a in args]
        cmd = [sys.executable, "-m", "edgerun", "serve", *args, *(() if "--port" in args else ("--port", "0"))]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.url = ""
        if wait_listening:
            m = self.wait_for_line(r"listening on (http://\S+)", timeout)
            self.url = m.group(1)

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    @property
    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def wait_for_line(self, pattern: str, timeout: float = 60) -> re.Match:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    m = rx.search(line)
                    if m:
                        return m
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"no line matching {pattern!r}; server output:\n" + "\n".join(self.lines))
                self._cond.wait(min(left, 0.2))

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                status = httpx.get(self.url + "/health", timeout=5).status_code
            except httpx.TransportError:
                status = None          # not accepting yet: poll again
            if status == 200:
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        if self.proc.poll() is None:        # a fixture that fails here runs no teardown: leave no server behind
            self.proc.kill()
            self.proc.wait()
        raise AssertionError("server never became ready; output:\n" + self.output)

    def wait_exit(self, timeout: float = 60) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("server did not exit in time; output:\n" + self.output) from None
        self._reader.join(5)
        return rc

    def terminate(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait_exit(timeout)


class InProcessServer:
    """create_app() served by uvicorn on a thread of the test process, on a pre-bound free port."""

    def __init__(self, config, load) -> None:
        import uvicorn

        from edgerun.serve.run import bind_socket
        from edgerun.serve.app import create_app

        self.app = create_app(config, load=load)
        self.state = self.app.state.edgerun
        self._sock = bind_socket("127.0.0.1", 0)
        self.url = "http://127.0.0.1:%d" % self._sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_config=None, lifespan="on", access_log=False))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self) -> "InProcessServer":
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self._thread.is_alive(), "in-process server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(60)
        self._sock.close()
        assert not self._thread.is_alive(), "in-process server did not stop"


class Meter:
    """A semaphore of token permits that records when a generation had to wait for one (`blocked`): a test
    that sees `blocked` knows the generation is inside its next-token wait, not between two tokens."""

    def __init__(self, n: int) -> None:
        self._sem = threading.Semaphore(n)
        self.blocked = threading.Event()

    def acquire(self, timeout: float) -> bool:
        if self._sem.acquire(blocking=False):
            return True
        self.blocked.set()
        return self._sem.acquire(timeout=timeout)

    def release(self, n: int = 1) -> None:
        self._sem.release(n)


class GatedRuntime:
    """A real Runtime whose generations wait at `gate` before their first token and, when `meter`
    is set, take one permit of it before each further token.

    Lets a test hold the generation slots, or pause a stream mid-way, for as long as it likes;
    everything else (tokenizer, decode loop, caches, rollback, batching) is the real Runtime's. With a
    Runtime loaded with parallel N, `slots()` gives N gated slots that share this one's gate, meter
    and records."""

    def __init__(self, runtime, parent: "GatedRuntime | None" = None) -> None:
        self._rt = runtime
        self._parent = parent
        if parent is None:
            self.gate = threading.Event()
            self.meter: threading.Semaphore | None = None
            self.entered = threading.Semaphore(0)      # released once per generation reaching the gate
            self.started: list[list[int]] = []         # prompt tokens of each generation, in start order

    def __getattr__(self, name):
        if name in ("gate", "meter", "entered", "started") and self._parent is not None:
            return getattr(self._parent, name)
        return getattr(self._rt, name)

    def slots(self) -> list["GatedRuntime"]:
        return [GatedRuntime(slot, parent=self) for slot in self._rt.slots()]

    def start(self, request, *, plan=None, **kw):
        plan = plan if plan is not None else self._rt.prepare(request)
        inner = self._rt.start(request, plan=plan, **kw)   # argument errors raise here, as in the Runtime
        return _GatedStream(self, list(plan.prompt_tokens), inner)

    def stream_tokens(self, prompt_tokens, **kw):
        inner = self._rt.stream_tokens(prompt_tokens, **kw)
        return _GatedStream(self, list(prompt_tokens), inner)


class _GatedStream:
    """A TokenStream that waits at its runtime's gate before the first token and takes a meter permit
    before each further one, iterated (the Runtime's own thread) or run with a callback (the server: in a
    batching group the callback runs on the engine thread, so the meter's wait goes through blocking(),
    which parks the sequence while the others go on, as a consumer holding a Step does when iterating)."""

    def __init__(self, owner: GatedRuntime, prompt_tokens: list, inner) -> None:
        self._owner, self._prompt, self._inner = owner, prompt_tokens, inner
        self._gen = None

    def _enter(self) -> None:
        self._owner.started.append(self._prompt)
        self._owner.entered.release()
        if not self._owner.gate.wait(60):
            raise TimeoutError("test gate never opened")

    def _metered(self) -> None:
        meter = self._owner.meter
        if meter is not None and not blocking(lambda: meter.acquire(timeout=60)):
            raise TimeoutError("test meter never released a token")

    def _iterate(self):
        self._enter()
        try:
            for i, step in enumerate(self._inner):
                if i > 0:
                    self._metered()
                yield step
        finally:
            self._inner.close()

    def __iter__(self):
        return self

    def __next__(self):
        if self._gen is None:
            self._gen = self._iterate()
        return next(self._gen)

    def close(self) -> None:
        if self._gen is not None:
            self._gen.close()
        self._inner.close()

    def run(self, on_step) -> None:
        self._enter()
        n = 0

        def gated(step):
            nonlocal n
            if n > 0:
                self._metered()
            n += 1
            return on_step(step)

        self._inner.run(gated)


def wait_until(cond, timeout: float = 30, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def sse_events(lines) -> list:
    """Parse server-sent event lines: the JSON payloads in order, with '[DONE]' kept as a string."""
    out = []
    for line in lines:
        if not line.startswith("data: "):
            assert line == "", f"unexpected SSE line {line!r}"
            continue
        data = line[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out
