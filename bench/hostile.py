"""A hostile home network against the real `edgerun serve` on loopback, bounded in count and time.

One well-behaved client sends the same greedy chat request over and over: first alone (the quiet
phase), then while the attack runs: 200 idle sockets, 50 slow-header and 50 slow-body clients (a byte
a second), 30 concurrent streams that disconnect after two chunks, 20 oversized bodies and 20
pathological prompts (a flood of `<|im_start|>` text). Reported: the good client's p50/p95 latency in
both phases (a 503 queue_full is retried after 1 s and counted in the latency) and their ratio
(target <= 2), every status the attackers and the client got (no 500),
/health polled twice a second throughout (every answer 200), the server's RSS before, at the peak and
15 s after the attack (target: back within 10%), and whether the good client's greedy text ever changed.

    nice python bench/hostile.py [--model smollm2-135m-instruct] [--requests 20] [--out bench/results/hostile.json]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from server_harness import ServerProcess, clean_env  # noqa: E402

from edgerun.registry.cache import cache_dir  # noqa: E402

KEY = "hostile-bench-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def p95(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


class Attack:
    def __init__(self, host: str, port: int, model: str) -> None:
        self.host, self.port, self.model = host, port, model
        self.statuses: Counter = Counter()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.socks: list[socket.socket] = []

    def note(self, what: str) -> None:
        with self.lock:
            self.statuses[what] += 1

    def idle(self, n: int) -> None:
        for _ in range(n):
            try:
                self.socks.append(socket.create_connection((self.host, self.port)))
            except OSError as e:
                self.note(f"idle connect failed: {e.__class__.__name__}")

    def slow(self, body: bool) -> None:
        try:
            s = socket.create_connection((self.host, self.port))
            head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 1000\r\n\r\n")
            if body:
                s.sendall(head)
                data = b"{" * 1000
            else:
                data = head
            for i in range(len(data)):
                if self.stop.is_set():
                    break
                s.sendall(data[i:i + 1])
                time.sleep(1.0)
            self.note("slow-" + ("body" if body else "header") + " ran to the end")
        except OSError:
            self.note("slow-" + ("body" if body else "header") + " cut by the server")

    def stream_and_vanish(self) -> None:
        try:
            with httpx.stream("POST", f"http://{self.host}:{self.port}/v1/chat/completions", headers=AUTH, timeout=60,
                              json={"model": self.model, "messages": [{"role": "user", "content": "Tell a story."}],
                                    "max_tokens": 64, "stream": True}) as r:
                self.note(f"stream {r.status_code}")
                for i, _ in enumerate(r.iter_lines()):
                    if i >= 2:
                        break
        except httpx.HTTPError as e:
            self.note(f"stream error {e.__class__.__name__}")

    def oversized(self) -> None:
        body = {"model": self.model, "prompt": "a" * (2 * 1024 * 1024), "max_tokens": 1}
        try:
            r = httpx.post(f"http://{self.host}:{self.port}/v1/completions", json=body, headers=AUTH, timeout=60)
            self.note(f"oversized {r.status_code}")
        except httpx.HTTPError as e:
            self.note(f"oversized error {e.__class__.__name__}")

    def pathological(self) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": "<|im_start|>" * 80000}], "max_tokens": 1}
        try:
            r = httpx.post(f"http://{self.host}:{self.port}/v1/chat/completions", json=body, headers=AUTH, timeout=120)
            self.note(f"pathological {r.status_code}")
        except httpx.HTTPError as e:
            self.note(f"pathological error {e.__class__.__name__}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--requests", type=int, default=20, help="good-client requests per phase")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="bench/results/hostile.json")
    a = ap.parse_args()

    srv = ServerProcess(["--model", a.model, "--no-pull", "--draft", "none", "--threads", str(a.threads), "--ctx", "1024",
                         "--api-key", KEY, "--queue", "8"], env=clean_env(cache_dir()))
    srv.wait_ready(timeout=120)
    host, port = srv.url.rsplit("//", 1)[1].rsplit(":", 1)
    port = int(port)
    proc = psutil.Process(srv.proc.pid)
    good = {"model": a.model, "messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 16,
            "temperature": 0}
    client = httpx.Client(base_url=srv.url, headers=AUTH, timeout=120)
    texts: set[str] = set()
    client_status: Counter = Counter()

    def good_phase(n: int) -> list[float]:
        """n answered requests; a 503 (queue full) is retried after 1 s, as a client honouring
        Retry-After would (sooner): the latency counts from the first attempt."""
        lat = []
        for _ in range(n):
            t0 = time.perf_counter()
            for _attempt in range(60):
                r = client.post("/v1/chat/completions", json=good)
                client_status[r.status_code] += 1
                if r.status_code != 503:
                    break
                time.sleep(1.0)
            lat.append(time.perf_counter() - t0)
            if r.status_code == 200:
                texts.add(r.json()["choices"][0]["message"]["content"])
        return lat

    good_phase(3)                                   # warm
    rss_before = proc.memory_info().rss
    quiet = good_phase(a.requests)

    health: Counter = Counter()
    health_stop = threading.Event()

    def poll_health() -> None:
        while not health_stop.is_set():
            try:
                health[httpx.get(srv.url + "/health", timeout=5).status_code] += 1
            except httpx.HTTPError as e:
                health[e.__class__.__name__] += 1
            time.sleep(0.5)

    atk = Attack(host, port, a.model)
    threads = [threading.Thread(target=poll_health, daemon=True)]
    threads += [threading.Thread(target=atk.slow, args=(False,), daemon=True) for _ in range(50)]
    threads += [threading.Thread(target=atk.slow, args=(True,), daemon=True) for _ in range(50)]
    threads += [threading.Thread(target=atk.stream_and_vanish, daemon=True) for _ in range(30)]
    threads += [threading.Thread(target=atk.oversized, daemon=True) for _ in range(20)]
    threads += [threading.Thread(target=atk.pathological, daemon=True) for _ in range(20)]
    atk.idle(200)
    rss_peak = proc.memory_info().rss
    for t in threads:
        t.start()
    hostile = good_phase(a.requests)
    rss_peak = max(rss_peak, proc.memory_info().rss)
    atk.stop.set()
    for s in atk.socks:
        s.close()
    for t in threads[1:]:
        t.join(60)
    time.sleep(15)
    health_stop.set()
    rss_after = proc.memory_info().rss
    after = good_phase(3)
    client.close()
    code = srv.terminate()

    result = {
        "model": a.model, "requests": a.requests,
        "quiet": {"p50_s": statistics.median(quiet), "p95_s": p95(quiet)},
        "hostile": {"p50_s": statistics.median(hostile), "p95_s": p95(hostile)},
        "p95_ratio": p95(hostile) / p95(quiet),
        "client_statuses": dict(client_status), "attack_statuses": dict(atk.statuses), "health": dict(health),
        "rss_mb": {"before": rss_before / 2**20, "peak": rss_peak / 2**20, "after": rss_after / 2**20},
        "rss_after_over_before": rss_after / rss_before,
        "greedy_texts": sorted(texts), "greedy_unchanged": len(texts) == 1, "after_s": after,
        "server_exit": code, "no_500": not any(str(k).endswith("500") or k == 500 for k in
                                               [*client_status, *[s.split()[-1] for s in atk.statuses]]),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"good client p50/p95: quiet {result['quiet']['p50_s']:.3f}/{result['quiet']['p95_s']:.3f} s, "
          f"under attack {result['hostile']['p50_s']:.3f}/{result['hostile']['p95_s']:.3f} s "
          f"(p95 ratio {result['p95_ratio']:.2f}, target <= 2)")
    print(f"client statuses {dict(client_status)}; /health {dict(health)}")
    print(f"attack outcomes {dict(atk.statuses)}")
    print(f"RSS before {result['rss_mb']['before']:.0f} MB, peak {result['rss_mb']['peak']:.0f} MB, after "
          f"{result['rss_mb']['after']:.0f} MB (after/before {result['rss_after_over_before']:.3f}); greedy text "
          f"unchanged: {result['greedy_unchanged']}; no 500: {result['no_500']}; server exit {code}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
