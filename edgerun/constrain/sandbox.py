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
import hashlib
import logging
import os
import resource
import select
import signal
import sys
import threading
import time
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


def vet(source: str, what: str, trial: Callable[[], None]) -> None:
    """Run `trial` (compile `source` and compute a few masks) in a child process, unless this source
    passed before. Raises GrammarError when the child fails, crashes, or takes longer than BUDGET_S."""
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
            refusal = _run(what, trial)
        with _lock:
            _verdicts[key] = refusal
            while len(_verdicts) > _REMEMBERED:
                _verdicts.popitem(last=False)
    if refusal is not None:
        raise GrammarError(refusal)


def _run(what: str, trial: Callable[[], None]) -> str | None:
    r, w = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:                                   # the child: never returns
        os.close(r)
        faulthandler.disable()                     # a crash here is the verdict, not a report for stderr
        os.nice(10)                                # the generation worker goes first
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
