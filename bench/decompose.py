"""Where a streamed request's wall time goes, edgerun against llama-server: the model's evaluations, the time
between them, and the time before the first and after the last.

Both servers run the same model, threads and context (bench/batch.py's commands) and get the same greedy
streaming chat requests, a reading at a time (`--clients` requests at once), the order alternating. Every
llama.cpp evaluation is timed inside C in each server by a small shared library (compiled here with the
system C compiler; outermost call only): preloaded into llama-server (llama_decode / llama_process), loaded
with ctypes in edgerun and called in place of llama_decode. edgerun's calls are also timed around the ctypes
call, which gives the call's own cost: the time before the C function starts (a thread woken as the GIL is
released may take the core first) and after it returns. Per reading, from the client's send to its last byte:

    pre   request sent -> first evaluation starts (HTTP, admission, prompt cache)
    eval  the evaluations themselves (the model's compute, and whatever else runs on the cores meanwhile)
    gaps  between one evaluation's end and the next one's start (sampling, hand-offs, batch set-up)
    post  last evaluation ends -> last byte received

Also per server: CPU time per generated token of its threads other than the two busiest (the compute
team): HTTP, event loop, slot threads. Ratios are geometric means over the paired readings, with 95%
intervals. Writes JSON (--out) and prints the table.

    python bench/decompose.py --llama-bin <llama.cpp build>/bin [--model smollm2-135m-instruct]
        [--clients 1] [--max-tokens 128] [--pairs 12] [--threads 2] [--parallel 4] [--ctx 1024]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

RECORDS = 1 << 20           # evaluations a trace file holds: float64 [count, (start, seconds) * RECORDS]

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#define RECORDS %d
static double *trace = 0;
static __thread int depth = 0;
__attribute__((constructor)) static void open_trace(void) {
    const char *path = getenv("EDGERUN_EVAL_TRACE");
    if (!path) return;
    int fd = open(path, O_RDWR);
    if (fd < 0) return;
    void *m = mmap(0, sizeof(double) * (1 + 2 * RECORDS), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m != MAP_FAILED) trace = m;
}
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static void record(double t0, double t1) {
    if (!trace) return;
    int64_t n = (int64_t) trace[0];
    if (n >= RECORDS) return;
    trace[1 + 2 * n] = t0;
    trace[2 + 2 * n] = t1 - t0;
    trace[0] = (double) (n + 1);
}
typedef struct { int32_t n_tokens; void *token, *embd, *pos, *n_seq_id, *seq_id, *logits; } batch_t;
static int32_t timed_decode(int32_t (*fn)(void *, batch_t), void *ctx, batch_t b) {
    double t0 = now();
    depth++;
    int32_t rc = fn(ctx, b);
    depth--;
    if (depth == 0) record(t0, now());
    return rc;
}
int32_t llama_decode(void *ctx, batch_t b) {
    static int32_t (*real)(void *, batch_t) = 0;
    if (!real) real = (int32_t (*)(void *, batch_t)) dlsym(RTLD_NEXT, "llama_decode");
    return timed_decode(real, ctx, b);
}
/* edgerun: loaded with ctypes (it does not interpose), handed libllama's llama_decode, called instead of it */
static int32_t (*edgerun_real)(void *, batch_t) = 0;
void edgerun_set_real(void *fn) { edgerun_real = (int32_t (*)(void *, batch_t)) fn; }
int32_t edgerun_traced_decode(void *ctx, batch_t b) { return timed_decode(edgerun_real, ctx, b); }
int32_t llama_process(void *ctx, int type, void *b) {
    static int32_t (*real)(void *, int, void *) = 0;
    if (!real) real = (int32_t (*)(void *, int, void *)) dlsym(RTLD_NEXT, "llama_process");
    double t0 = now();
    depth++;
    int32_t rc = real(ctx, type, b);
    depth--;
    if (depth == 0) record(t0, now());
    return rc;
}
""" % RECORDS


def new_trace(directory: str, name: str) -> str:
    path = os.path.join(directory, name)
    with open(path, "wb") as f:
        f.truncate(8 * (1 + 2 * RECORDS))
    return path


def read_trace(path: str) -> np.ndarray:
    """[(start, seconds)] of the evaluations recorded so far (perf_counter / CLOCK_MONOTONIC time)."""
    raw = np.fromfile(path, dtype=np.float64)
    n = int(raw[0])
    return raw[1:1 + 2 * n].reshape(n, 2)


def edgerun_child(trace_path: str, argv: list[str]) -> None:
    """Run `edgerun <argv>` with every llama_decode call timed into trace_path (a memory-mapped file) inside
    C, by the trace library (as llama-server's are), and around the ctypes call into trace_path + ".py": the
    difference is the ctypes call's own time, the wait for a core before the C function starts among it."""
    import ctypes

    os.environ["EDGERUN_EVAL_TRACE"] = trace_path          # read by the library's constructor
    shim = ctypes.CDLL(os.environ["EDGERUN_DECOMPOSE_SHIM"])
    py_trace = np.memmap(trace_path + ".py", dtype=np.float64, mode="r+")
    from edgerun import llama_lib

    L = llama_lib.lib()
    raw = L.llama_decode
    shim.edgerun_set_real(ctypes.cast(raw, ctypes.c_void_p))
    traced = shim.edgerun_traced_decode
    traced.argtypes, traced.restype = raw.argtypes, raw.restype
    clock = time.perf_counter

    def timed(ctx, batch):
        t0 = clock()
        try:
            return traced(ctx, batch)
        finally:
            n = int(py_trace[0])
            if n < RECORDS:
                py_trace[1 + 2 * n] = t0
                py_trace[2 + 2 * n] = clock() - t0
                py_trace[0] = n + 1

    L.llama_decode = timed
    from edgerun.cli import main

    sys.exit(main(argv))


def split(readings: list[dict], trace: np.ndarray) -> list[dict]:
    """Per reading: pre, eval, gaps, post (seconds) and the number of evaluations."""
    out = []
    for r in readings:
        start, dur = trace[:, 0], trace[:, 1]
        x = trace[(start >= r["t0"]) & (start + dur <= r["t1"] + 0.005)]
        if not len(x):
            raise SystemExit(f"no evaluation was traced during a reading of {r['server']}: is the trace wired?")
        ends = x[:, 0] + x[:, 1]
        out.append({**r, "pre": x[0, 0] - r["t0"], "eval": float(x[:, 1].sum()),
                    "gaps": float((x[1:, 0] - ends[:-1]).sum()), "post": r["t1"] - ends[-1], "n_evals": len(x)})
    return out


def paired(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Geometric mean of b/a over the pairs and its 95% interval."""
    from scipy import stats

    d = np.log(np.asarray(b)) - np.log(np.asarray(a))
    se = d.std(ddof=1) / np.sqrt(len(d))
    half = float(stats.t.ppf(0.975, len(d) - 1)) * se
    return float(np.exp(d.mean())), float(np.exp(d.mean() - half)), float(np.exp(d.mean() + half))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-bin", help="directory of a llama.cpp build with llama-server (and its libraries)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--clients", type=int, default=1, help="requests sent at once per reading")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=1024, help="context positions per slot (both servers)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "decompose.json"))
    ap.add_argument("--edgerun-child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.edgerun_child:
        edgerun_child(a.edgerun_child[0], a.edgerun_child[1:])
        return
    if not a.llama_bin or not (Path(a.llama_bin) / "llama-server").is_file():
        print("error: --llama-bin must name a llama.cpp build directory with llama-server in it", file=sys.stderr)
        raise SystemExit(2)
    if a.pairs < 2:
        print("error: --pairs must be at least 2 (an interval needs two pairs)", file=sys.stderr)
        raise SystemExit(2)
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        print("error: a C compiler (cc) is needed to build the llama-server trace library", file=sys.stderr)
        raise SystemExit(2)

    import httpx

    from batch import one_request
    from harness import Proc, free_port, llama_server
    from pair import thread_cpu
    from edgerun.resolve import resolve_model
    from serve import PROMPTS

    work = tempfile.mkdtemp(prefix="edgerun-decompose-")
    Path(work, "shim.c").write_text(SHIM)
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", f"{work}/shim.so", f"{work}/shim.c", "-ldl"], check=True)
    traces = {"edgerun": new_trace(work, "edgerun.trace"), "llama-server": new_trace(work, "llama.trace")}
    new_trace(work, "edgerun.trace.py")
    port = free_port()
    servers = {
        "edgerun": Proc("edgerun", [sys.executable, __file__, "--edgerun-child", traces["edgerun"], "serve",
                                    "--model", a.model, "--draft", "none", "--parallel", str(a.parallel),
                                    "--threads", str(a.threads), "--ctx", str(a.ctx), "--port",
                                    str(port), "--queue", "64", "--timeout", "900", "--no-pull"],
                        f"http://127.0.0.1:{port}",
                        env={**os.environ, "EDGERUN_DECOMPOSE_SHIM": f"{work}/shim.so"}),
        "llama-server": llama_server(
            Path(a.llama_bin) / "llama-server", resolve_model(a.model, pull=False), threads=a.threads,
            extra=["-c", str(a.ctx * a.parallel), "-np", str(a.parallel), "-fa", "on", "-ngl", "0"],
            env={**os.environ, "LD_LIBRARY_PATH": a.llama_bin, "LD_PRELOAD": f"{work}/shim.so",
                 "EDGERUN_EVAL_TRACE": traces["llama-server"]}),
    }
    try:
        for s in servers.values():
            s.wait_ready()
        models = {k: httpx.get(s.url + "/v1/models").json()["data"][0]["id"] for k, s in servers.items()}

        async def reading(k: str, i: int) -> dict:
            async with httpx.AsyncClient(base_url=servers[k].url, timeout=900,
                                         limits=httpx.Limits(max_keepalive_connections=0)) as client:
                t0 = time.perf_counter()
                rs = await asyncio.gather(*(one_request(client, models[k], PROMPTS[(i + c) % len(PROMPTS)],
                                                        a.max_tokens) for c in range(a.clients)))
                t1 = time.perf_counter()
            return {"server": k, "t0": t0, "t1": t1, "tokens": sum(r["tokens"] for r in rs),
                    "ttft": max(r["ttft"] or 0.0 for r in rs)}

        for k in servers:                        # warm-up: caches, the first graph, the prompt cache
            asyncio.run(reading(k, 0))
        for k in servers:
            if not len(read_trace(traces[k])):
                raise SystemExit(f"{k}: no evaluation was traced (the trace library or wrapper is not in use)")
        pids = {k: s.proc.pid for k, s in servers.items()}
        cpu0 = {k: thread_cpu(p) for k, p in pids.items()}
        readings: list[dict] = []
        for i in range(a.pairs):
            for k in (("llama-server", "edgerun") if i % 2 == 0 else ("edgerun", "llama-server")):
                readings.append({**asyncio.run(reading(k, i + 1)), "pair": i})
                time.sleep(0.3)                  # readings apart: the other server's trace stays out of this one
                print(f"pair {i + 1}/{a.pairs} {k}: {readings[-1]['tokens'] / (readings[-1]['t1'] - readings[-1]['t0']):.1f} tok/s",
                      flush=True)
        cpu1 = {k: thread_cpu(p) for k, p in pids.items()}
    finally:
        for s in servers.values():
            s.stop()

    result: dict = {"args": {k: v for k, v in vars(a).items() if k != "edgerun_child"}, "servers": {}}
    per = {}
    for k in servers:
        rows = split([r for r in readings if r["server"] == k], read_trace(traces[k]))
        per[k] = rows
        tokens = sum(r["tokens"] for r in rows)
        used = sorted(((cpu1[k][t] - cpu0[k].get(t, 0.0)) for t in cpu1[k]), reverse=True)
        result["servers"][k] = {
            "tok_s_median": float(np.median([r["tokens"] / (r["t1"] - r["t0"]) for r in rows])),
            **{f"{f}_ms_mean": 1e3 * float(np.mean([r[f] for r in rows])) for f in ("pre", "eval", "gaps", "post")},
            "wall_ms_mean": 1e3 * float(np.mean([r["t1"] - r["t0"] for r in rows])),
            "evals_mean": float(np.mean([r["n_evals"] for r in rows])),
            "tokens_mean": float(np.mean([r["tokens"] for r in rows])),
            "gap_us_per_eval": 1e6 * sum(r["gaps"] for r in rows) / sum(r["n_evals"] - 1 for r in rows),
            "other_threads_cpu_us_per_token": 1e6 * sum(used[2:]) / tokens,
            "readings": rows,
        }
    c_trace, py_trace = read_trace(traces["edgerun"]), read_trace(traces["edgerun"] + ".py")
    if len(c_trace) == len(py_trace):                      # one record each per call, in the same order
        enter = c_trace[:, 0] - py_trace[:, 0]
        leave = (py_trace[:, 0] + py_trace[:, 1]) - (c_trace[:, 0] + c_trace[:, 1])
        result["servers"]["edgerun"]["ctypes_call_us"] = {
            "enter_mean": 1e6 * float(enter.mean()), "enter_p90": 1e6 * float(np.quantile(enter, 0.9)),
            "leave_mean": 1e6 * float(leave.mean()), "leave_p90": 1e6 * float(np.quantile(leave, 0.9))}
    e, ls = per["edgerun"], per["llama-server"]
    result["edgerun_over_llama_server"] = {
        "tok_s": paired([r["tokens"] / (r["t1"] - r["t0"]) for r in ls], [r["tokens"] / (r["t1"] - r["t0"]) for r in e]),
        "eval_s": paired([r["eval"] for r in ls], [r["eval"] for r in e]),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))
    shutil.rmtree(work, ignore_errors=True)

    print(f"\n{a.model}, {a.clients} client(s) x {a.max_tokens} tokens, {a.pairs} paired readings, "
          f"{a.threads} threads, --parallel {a.parallel} (means per reading)\n")
    print("| server | tok/s (median) | wall ms | pre ms | eval ms | gaps ms | post ms | evals | gap µs per eval "
          "| other threads' CPU µs per token |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for k, s in result["servers"].items():
        print(f"| {k} | {s['tok_s_median']:.1f} | {s['wall_ms_mean']:.0f} | {s['pre_ms_mean']:.1f} | "
              f"{s['eval_ms_mean']:.0f} | {s['gaps_ms_mean']:.1f} | {s['post_ms_mean']:.1f} | {s['evals_mean']:.1f} | "
              f"{s['gap_us_per_eval']:.0f} | {s['other_threads_cpu_us_per_token']:.0f} |")
    if "ctypes_call_us" in result["servers"]["edgerun"]:
        c = result["servers"]["edgerun"]["ctypes_call_us"]
        print(f"edgerun's ctypes call around llama_decode (all calls): {c['enter_mean']:.0f} µs before the C "
              f"function starts (p90 {c['enter_p90']:.0f}), {c['leave_mean']:.0f} µs after it returns (p90 "
              f"{c['leave_p90']:.0f})")
    for f, (g, lo, hi) in result["edgerun_over_llama_server"].items():
        print(f"edgerun / llama-server, {f}: {g:.3f} [{lo:.3f}, {hi:.3f}]")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
