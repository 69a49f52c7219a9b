"""The first compile of each grammar runs in a child process, so a grammar that crashes llguidance or
runs away ends the child, not the service.

limits.py refuses the shapes known to hurt (deep `$ref` chains, nested repetitions), but llguidance is
native code fed by the network: a Lark grammar of 5,000 chained rules overflows its stack at compile
time, and some schemas take seconds of lexer construction. So on Linux a grammar not seen before is
compiled once in a forked child (which inherits the vocabulary already built) with a time budget
and an address-space limit, and a few of its masks are computed along the first allowed tokens.
Only a grammar that passed there is compiled in this process; the verdicts of recent grammars are
remembered by the hash of their compiled source, so a client that sends the same tools or schema
with every request pays for the fork once. Elsewhere (macOS: fork with threads is unsafe there) the
static limits and llguidance's own limits are the only guard.
"""

from __future__ import annotations

import faulthandler
import contextlib
import hashlib
import json
import logging
import os
import resource
import select
import signal
import struct
import sys
import threading
import time
import warnings
from collections import OrderedDict
from typing import Callable

from ..errors import GrammarError, InvalidArgument

log = logging.getLogger(__name__)

# the child's wall-clock limit: a runaway inside one native call (the CPU budget of grammar.py's trial is
# checked between calls); generous, since the child is niced and a loaded board may starve it
BUDGET_S = float(os.environ.get("EDGERUN_GRAMMAR_TIMEOUT_MS", "5000")) / 1000
CHILD_CPU_S = 1                 # the child's CPU seconds (a runaway inside one native call)
CHILD_MEMORY = 1 << 30          # bytes of address space the child may add to what it inherits
_REMEMBERED = 512
_verdicts: "OrderedDict[str, str | None]" = OrderedDict()     # source hash -> None (passed) or the refusal
_lock = threading.Lock()        # the server vets on its request threads, the worker compiles on its own
_one_child = threading.Lock()   # one sandbox child at a time: a flood of new grammars takes one core at most


def available() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "fork")


def vet(source: str, what: str, trial: Callable[[str, str], None]) -> None:
    """Run trial(source, what) (compile the grammar and compute a few masks) in a sandbox process, unless
    this source was vetted before. Raises GrammarError when it fails, crashes, or runs out of time. `trial`
    is one per vocabulary (grammar.py's `_Vocab.trial`): the sandbox processes are forked from a zygote made
    for it."""
    if not available():
        return
    key = hashlib.sha256(source.encode("utf-8", "surrogatepass")).hexdigest()
    with _lock:
        known = key in _verdicts
        if known:
            _verdicts.move_to_end(key)
            refusal = _verdicts[key]
    if not known:
        with _one_child:
            refusal = _zygote_for(trial).ask(source, what)
        with _lock:
            _verdicts[key] = refusal
            while len(_verdicts) > _REMEMBERED:
                _verdicts.popitem(last=False)
    if refusal is not None:
        raise GrammarError(refusal)


# --- the zygote ----------------------------------------------------------------------------------------
# The server forks once, into a single-threaded zygote that holds the vocabulary; each new grammar is then
# compiled in a child of the zygote. Forking the server itself for every grammar would mark its memory
# copy-on-write each time: its KV cache and compute buffers would fault page by page while a child lives
# (a flood of new grammars slowed everyone's decoding about 2x in bench/hostile.py).

_zygotes: dict[int, "_Zygote"] = {}


def _zygote_for(trial: Callable[[str, str], None]) -> "_Zygote":
    z = _zygotes.get(id(trial))
    if z is None or not z.alive():
        z = _zygotes[id(trial)] = _Zygote(trial)
    return z


class _Zygote:
    def __init__(self, trial: Callable[[str, str], None]) -> None:
        self.trial = trial                          # kept: its id keys _zygotes
        req_r, self._req_w = os.pipe()
        self._ans_r, ans_w = os.pipe()
        with warnings.catch_warnings():            # 3.12+ warns about fork with threads: the zygote runs one
            warnings.simplefilter("ignore", DeprecationWarning)     # thread, ours, and forks from itself only
            pid = os.fork()
        if pid == 0:                               # the zygote: never returns
            os.close(self._req_w)
            os.close(self._ans_r)
            code = 0
            try:
                _die_with_parent()
                faulthandler.disable()
                os.nice(10)                        # the generation worker goes first
                _serve(req_r, ans_w, trial)
            except BaseException:                  # noqa: BLE001 - the zygote ends; the server makes another
                code = 1
            os._exit(code)
        os.close(req_r)
        os.close(ans_w)
        self.pid = pid

    def alive(self) -> bool:
        try:
            return os.waitpid(self.pid, os.WNOHANG) == (0, 0)
        except ChildProcessError:
            return False

    def ask(self, source: str, what: str) -> str | None:
        try:
            _send(self._req_w, {"source": source, "what": what})
            ready, _, _ = select.select([self._ans_r], [], [], BUDGET_S + 10)
            answer = _receive(self._ans_r) if ready else None
        except OSError:
            answer = None
        if answer is None:                          # the zygote is stuck or gone: replace it next time
            self.close()
            return f"{what} could not be checked (the grammar sandbox did not answer); it is refused"
        return answer.get("refusal")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        for fd in (self._req_w, self._ans_r):
            with contextlib.suppress(OSError):
                os.close(fd)


def _serve(req_r: int, ans_w: int, trial: Callable[[str, str], None]) -> None:
    """The zygote's loop: one request at a time, each in a child of its own, until the server goes away."""
    while True:
        request = _receive(req_r)
        if request is None:
            return
        _send(ans_w, {"refusal": _run(request["what"], lambda: trial(request["source"], request["what"]))})


def _send(fd: int, obj: dict) -> None:
    data = json.dumps(obj).encode("utf-8", "surrogatepass")
    os.write(fd, struct.pack("<I", len(data)))
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _receive(fd: int) -> dict | None:
    head = _read_n(fd, 4)
    if head is None:
        return None
    body = _read_n(fd, struct.unpack("<I", head)[0])
    return None if body is None else json.loads(body.decode("utf-8", "surrogatepass"))


def _read_n(fd: int, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        b = os.read(fd, left)
        if not b:
            return None
        chunks.append(b)
        left -= len(b)
    return b"".join(chunks)


def _die_with_parent() -> None:
    """The zygote ends with the server (Linux: PR_SET_PDEATHSIG)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG


def _run(what: str, trial: Callable[[], None]) -> str | None:
    """In the zygote: one child runs `trial` under the limits; its verdict (None: passed)."""
    r, w = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:                                   # the child: never returns
        os.close(r)
        code, message = 0, b""
        try:
            _limit_memory()
            trial()
        except InvalidArgument as e:
            code, message = 3, str(e).encode("utf-8", "replace")
        except BaseException as e:                 # noqa: BLE001 - anything at all is reported, then _exit
            code, message = 4, f"{type(e).__name__}: {e}".encode("utf-8", "replace")
        try:
            os.write(w, message[:4000])
        finally:
            os._exit(code)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], BUDGET_S)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            log.warning("refused %s: compiling it took more than %.0f ms", what, BUDGET_S * 1000)
            return (f"{what} takes more than {BUDGET_S:g} s to compile (it was stopped), the limit for a grammar "
                    "from a request; simplify it (fewer alternatives, rules or repetitions)")
        message = _read_all(r)
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(r)
    log.debug("vetted %s in %.1f ms", what, (time.monotonic() - t0) * 1000)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGXCPU, signal.SIGKILL):
        log.warning("refused %s: compiling it used more than %d s of CPU", what, CHILD_CPU_S)
        return (f"{what} takes more than {CHILD_CPU_S} s of CPU to compile (it was stopped), the limit for a "
                "grammar from a request; simplify it (fewer alternatives, rules or repetitions)")
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        log.warning("refused %s: it crashed the grammar compiler in a child process (signal %d)", what, sig)
        return (f"{what} crashes the grammar compiler (signal {signal.Signals(sig).name} in a sandbox process); "
                "it is refused (nesting or chains of rules that deep are the usual cause)")
    code = os.WEXITSTATUS(status)
    if code == 0:
        return None
    text = message.decode("utf-8", "replace")
    if code == 3:
        return text
    return f"{what} could not be compiled in the sandbox process: {text or f'exit status {code}'}"


def _read_all(fd: int) -> bytes:
    chunks = []
    while True:
        b = os.read(fd, 65536)
        if not b:
            return b"".join(chunks)
        chunks.append(b)


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_CPU, (CHILD_CPU_S, CHILD_CPU_S + 1))    # SIGXCPU, then SIGKILL
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[0])
        size = pages * os.sysconf("SC_PAGE_SIZE") + CHILD_MEMORY
        resource.setrlimit(resource.RLIMIT_AS, (size, size))
    except (OSError, ValueError):
        pass
