"""`edgerun cluster status`: each worker's protocol version, devices, free/total memory and round-trip time.

ggml-rpc aborts the process that meets a dead or incompatible worker, so the workers are asked from a
child process (`python -m edgerun.cluster.status ENDPOINT...`), which prints one JSON line per worker;
the caller survives whatever happens there.
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Sequence

from ..errors import ClusterError
from . import rpc

RTT_SAMPLES = 5


def _emit(rec: dict) -> None:
    sys.stdout.write(json.dumps(rec) + "\n")
    sys.stdout.flush()


def probe_one(ep: rpc.Endpoint, timeout: float) -> dict:
    """Ask one worker (in THIS process: a worker that dies half-way aborts it). A dict, 'error' on failure."""
    rec: dict = {"endpoint": str(ep)}
    try:
        v = rpc.hello(ep, timeout=timeout)
        rec["protocol"] = rpc.fmt_version(v)
        rpc.check_version(ep, v)
    except ClusterError as e:
        rec["error"] = str(e)
        return rec
    g = rpc.ggml()
    devs = rpc.remote_devices(ep)
    rec["devices"] = []
    for i, dev in enumerate(devs):
        d = rpc.dev_info(dev)
        d["index"] = i
        rec["devices"].append(d)
    # the round trip of one small command on an open connection (a backend keeps ggml's connection open)
    backend = g.rpc.ggml_backend_rpc_init(str(ep).encode(), 0)
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    times = []
    try:
        for _ in range(RTT_SAMPLES + 1):
            t0 = time.perf_counter()
            g.rpc.ggml_backend_rpc_get_device_memory(str(ep).encode(), 0, ctypes.byref(free), ctypes.byref(total))
            times.append(time.perf_counter() - t0)
    finally:
        g.base.ggml_backend_free(backend)
    rec["rtt_ms"] = round(1e3 * statistics.median(times[1:]), 3)
    return rec


def _child(endpoints: Sequence[str], timeout: float) -> int:
    current: dict = {}

    def on_abort(msg: str) -> None:
        _emit({"endpoint": current.get("ep"), "error": f"RPC worker {current.get('ep')} failed while it was "
               f"asked for its devices ({msg.split(': ', 1)[-1].strip()})"})

    rpc.on_abort(on_abort)
    for ep in rpc.parse_endpoints(list(endpoints)):
        current["ep"] = str(ep)
        _emit(probe_one(ep, timeout))
    return 0


def status(endpoints: Sequence[rpc.Endpoint], *, timeout: float = 3.0) -> list[dict]:
    """One record per worker, in order: {'endpoint', 'protocol', 'devices': [...], 'rtt_ms'} or {'endpoint',
    'error'}. Runs the questions in a child process; raises ClusterError only if the child cannot start."""
    rpc.require_rpc("--rpc")
    env = dict(os.environ, GGML_NO_BACKTRACE="1")
    limit = 10.0 + len(endpoints) * (2 * timeout + 5.0)
    cmd = [sys.executable, "-m", "edgerun.cluster.status", "--timeout", str(timeout), *map(str, endpoints)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env)
        out, err, rc = p.stdout, p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err, rc = f"no answer within {limit:.0f} s", None
    got: dict[str, dict] = {}
    for line in out.splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and rec.get("endpoint"):
            got.setdefault(rec["endpoint"], rec)
    why = (err.strip().splitlines() or [f"exit status {rc}"])[-1]
    return [got.get(str(ep)) or {"endpoint": str(ep), "error": f"RPC worker {ep} was not reached by the status "
                                 f"check ({why})"} for ep in endpoints]


def require_all(records: list[dict]) -> None:
    """ClusterError with the first failing worker's message (one line)."""
    bad = [r for r in records if "error" in r]
    if bad:
        more = f" (and {len(bad) - 1} more worker(s) failed)" if len(bad) > 1 else ""
        raise ClusterError(bad[0]["error"] + more)


def format_table(records: list[dict]) -> list[str]:
    """Human-readable lines. A worker's devices appear under the names the head gives them (RPC0, RPC1...);
    ggml-rpc does not tell the head what they are on the worker (`edgerun worker` prints that)."""
    lines = [f"{'WORKER':22s} {'PROTOCOL':8s} {'RTT':>9s}  {'DEVICE':8s} {'FREE':>10s} {'TOTAL':>10s}"]
    for r in records:
        if "error" in r:
            lines.append(f"{r['endpoint']:22s} {r.get('protocol', '-'):8s} {'-':>9s}  error: {r['error']}")
            continue
        for i, d in enumerate(r["devices"]):
            head = (f"{r['endpoint']:22s} {r['protocol']:8s} {r['rtt_ms']:7.3f}ms" if i == 0 else
                    f"{'':22s} {'':8s} {'':>9s}")
            lines.append(f"{head}  {d['name']:8s} {d['free'] / 2**30:7.2f}GiB {d['total'] / 2**30:7.2f}GiB")
    return lines


if __name__ == "__main__":       # the child process
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=3.0)
    ap.add_argument("endpoints", nargs="+")
    a = ap.parse_args()
    sys.exit(_child(a.endpoints, a.timeout))
