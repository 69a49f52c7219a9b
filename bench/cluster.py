"""A model split over RPC workers on loopback: speed, time to first token, bytes per token, load time.

Configurations run interleaved in one session (local, 1 worker, 2 workers, and through SSH tunnels when
sshd can run here), each head in its own process (`edgerun.load(..., rpc=...)`), greedy, plain decoding.
TTFT is the wall time from the request to the first token (prefill included); tok/s is (n - 1) / (time of
the last token - time of the first), so prefill is excluded; load is edgerun.load's wall time.
Workers are `edgerun worker --threads T --cache none` processes; a third worker with a weight cache shows
load time cold vs warm. Bytes are the kernel's count for the head's TCP connections to its workers
(`ss -ti`: bytes_sent + bytes_received) over the generation (prefill included), divided by the tokens.

    python bench/cluster.py [--models smollm2-135m-instruct,qwen2.5-coder-1.5b-instruct] [--tokens 32]
                            [--threads 1] [--repeats 2] [--no-ssh]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from ssh_tunnel import Tunnel, available as ssh_unavailable, free_port, wait_port  # noqa: E402  (the tests' sshd harness)
sys.path.insert(0, str(ROOT / "bench"))
from harness import print_table, timed_tokens, write_result  # noqa: E402
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle.\n\n"


def start_worker(threads: int, cache: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "edgerun", "worker", "--port", str(port), "--threads", str(threads),
                          "--cache", cache], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env=dict(os.environ, GGML_NO_BACKTRACE="1"))
    wait_port(port)
    return p, port


def tcp_bytes(ports: list[int]) -> int:
    """bytes_sent + bytes_received of this machine's TCP connections to these ports (the head's, on loopback)."""
    total = 0
    for port in ports:
        out = subprocess.run(["ss", "-tinH", "state", "established", "dst", f"127.0.0.1:{port}"], capture_output=True,
                             text=True).stdout
        total += sum(int(x) for x in re.findall(r"bytes_(?:sent|received):(\d+)", out))
    return total


def head(spec: dict) -> dict:
    """One head process: load (timed), one greedy generation (timed), the bytes its connections carried."""
    t0 = time.perf_counter()
    import edgerun

    rt = edgerun.load(spec["model"], draft="none", profile="generic-x86_64-cpu", n_threads=spec["threads"],
                      n_ctx=1024, pull=False, rpc=spec["rpc"] or None)
    t_load = time.perf_counter() - t0
    ports = [int(e.rsplit(":", 1)[1]) for e in spec["rpc"]]
    b0 = tcp_bytes(ports)
    t = timed_tokens(rt.stream(PROMPT, max_tokens=spec["tokens"], temperature=0, gamma=0))
    b1 = tcp_bytes(ports)
    return {"t_load_s": t_load, "ttft_s": t.ttft, "n_tokens": t.n, "bytes": b1 - b0, "text": "".join(t.text),
            "tokens_per_s": t.rate, "n_prompt": len(rt.tokenize(PROMPT))}


def run_head(model: str, rpc: list[str], tokens: int, threads: int) -> dict:
    spec = {"model": model, "rpc": rpc, "tokens": tokens, "threads": threads}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, __file__, "--head", json.dumps(spec)], capture_output=True, text=True,
                       env=dict(os.environ, GGML_NO_BACKTRACE="1"), timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"head failed ({rpc}): {r.stderr[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["t_process_s"] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m-instruct,qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-ssh", action="store_true")
    ap.add_argument("--head", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.head:
        print(json.dumps(head(json.loads(a.head))))
        return

    tmp = Path(tempfile.mkdtemp(prefix="edgerun-cluster-bench-"))
    workers = [start_worker(a.threads, "none") for _ in range(2)]
    cached = start_worker(a.threads, str(tmp / "cache"))
    tunnel = None
    why_not = "--no-ssh" if a.no_ssh else ssh_unavailable()
    if why_not is None:
        try:
            tunnel = Tunnel(tmp / "ssh", [w[1] for w in workers])
        except (OSError, subprocess.SubprocessError, RuntimeError) as e:
            why_not = str(e)
    if why_not:
        print(f"(no SSH tunnel: {why_not})", file=sys.stderr)
    configs = {"local": [], "1 worker": [f"127.0.0.1:{workers[0][1]}"],
               "2 workers": [f"127.0.0.1:{w[1]}" for w in workers]}
    if tunnel:
        configs["1 worker, ssh"] = [f"127.0.0.1:{tunnel.local_ports[0]}"]
        configs["2 workers, ssh"] = [f"127.0.0.1:{p}" for p in tunnel.local_ports]
    results: dict = {"threads": a.threads, "tokens": a.tokens, "configs": {}, "load": {}}
    try:
        for model in a.models.split(","):
            for rep in range(a.repeats):                      # interleaved: every config once per round
                for name, rpc in configs.items():
                    r = run_head(model, rpc, a.tokens, a.threads)
                    results["configs"].setdefault(model, {}).setdefault(name, []).append(r)
                    print(f"{model:32s} {name:16s} {r['tokens_per_s']:7.1f} tok/s  ttft {r['ttft_s'] * 1e3:7.1f} ms"
                          f"  load {r['t_load_s']:5.2f} s  {r['bytes'] / max(1, r['n_tokens']) / 1024:8.1f} KiB/token",
                          flush=True)
            # load time through a worker with a weight cache: cold (empty), then warm; vs no cache
            ep = [f"127.0.0.1:{cached[1]}"]
            cold = run_head(model, ep, 4, a.threads)
            warm = run_head(model, ep, 4, a.threads)
            none = run_head(model, configs["1 worker"], 4, a.threads)
            results["load"][model] = {"no cache": none["t_load_s"], "cache cold": cold["t_load_s"],
                                      "cache warm": warm["t_load_s"]}
            print(f"{model:32s} load via 1 worker: no cache {none['t_load_s']:.2f} s, cache cold "
                  f"{cold['t_load_s']:.2f} s, warm {warm['t_load_s']:.2f} s", flush=True)
    finally:
        if tunnel:
            tunnel.close()
        for p, _ in [*workers, cached]:
            p.kill()
            p.wait()
    write_result("cluster", results)
    print_tables(results)


def print_tables(res: dict) -> None:
    rows = []
    for model, cfgs in res["configs"].items():
        base = statistics.median(r["tokens_per_s"] for r in cfgs["local"])
        text = cfgs["local"][0]["text"]
        for name, runs in cfgs.items():
            tps = statistics.median(r["tokens_per_s"] for r in runs)
            kib = statistics.median(r["bytes"] / max(1, r["n_tokens"]) for r in runs) / 1024
            rows.append([model, name, f"{tps:.1f}", f"{tps / base:.2f}",
                         f"{statistics.median(r['ttft_s'] for r in runs) * 1e3:.0f}", f"{kib:.1f}",
                         f"{statistics.median(r['t_load_s'] for r in runs):.2f}",
                         "yes" if all(r["text"] == text for r in runs) else "no"])
    print()
    print_table(["model", "configuration", "tok/s", "vs local", "TTFT ms", "KiB/token", "load s", "same text as local"],
                rows, markdown=True)
    print()
    print_table(["model", "load via 1 worker: no cache", "cache cold", "cache warm"],
                [[m, *(f"{d[k]:.2f} s" for k in ("no cache", "cache cold", "cache warm"))] for m, d in res["load"].items()],
                markdown=True)


if __name__ == "__main__":
    main()
