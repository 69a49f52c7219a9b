"""Load test of `edgerun serve` with a real model: concurrency, disconnects, overload, memory.

Starts the server as a subprocess (as systemd would) on a free loopback port, then:
  1. burst:     N concurrent streaming chat requests (greedy; P distinct prompts, N/P copies each) plus D
                clients that disconnect (half after their first token, half while still queued).
                Every completed stream must be whole: one finish chunk, `[DONE]` last, and the same
                text as a plain (non-stream) request for the same prompt made afterwards.
  2. overload:  more concurrent requests than the queue holds; the excess must get 503 + Retry-After
                + an OpenAI error JSON, the rest complete.
  3. soak:      requests until R in total (streams, plain, disconnecting), sampling the server's RSS;
                memory must come back to the level measured after warm-up (no leak).
Prints throughput and time-to-first-token percentiles; writes bench/results/serve.json.

    nice python bench/serve.py [--model smollm2-135m-instruct] [--concurrency 50] [--requests 500]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).parent))
from harness import Proc, edgerun_cmd, free_port  # noqa: E402

PROMPTS = [
    "Name three uses of a steam engine.", "What is a prime number?", "Describe the colour blue.",
    "Why do cats purr?", "How does a bicycle stay upright?", "What is the capital of France?",
    "Give me a tip for writing clean code.", "What is rain made of?", "Explain what a CPU does.",
    "Tell me a fact about the moon.",
]


class Server(Proc):
    """`edgerun serve` with the load test's options; its memory and Prometheus counters."""

    def __init__(self, args) -> None:
        port = free_port()
        cmd = edgerun_cmd("serve", "--model", args.model, "--draft", args.draft, "--port", str(port),
                          "--queue", str(args.queue), "--ctx", str(args.ctx), "--timeout", "900")
        if args.threads is not None:
            cmd += ["--threads", str(args.threads)]
        super().__init__("edgerun serve", cmd, f"http://127.0.0.1:{port}")
        self.wait_ready()
        self.ps = psutil.Process(self.proc.pid)

    def rss_mb(self) -> float:
        return self.ps.memory_info().rss / 2 ** 20

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(name))

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(120)


def chat_body(model: str, prompt: str, max_tokens: int, stream: bool) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}


async def stream_chat(client: httpx.AsyncClient, body: dict) -> dict:
    """One streaming request. Returns status, text, ttft, and whether the stream was whole."""
    t0 = time.perf_counter()
    out = {"status": None, "text": "", "ttft": None, "whole": False, "finish": None, "retry_after": None,
           "error": None}
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            payload = json.loads(await r.aread())
            out["error"] = payload.get("error", {}).get("code")
            out["retry_after"] = r.headers.get("retry-after")
            return out
        events, finals, pieces = [], 0, []
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            events.append(data)
            if data == "[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                out["error"] = chunk["error"]["code"]
                continue
            for ch in chunk["choices"]:
                piece = ch["delta"].get("content")
                if piece:
                    if out["ttft"] is None:
                        out["ttft"] = time.perf_counter() - t0
                    pieces.append(piece)
                if ch["finish_reason"] is not None:
                    finals += 1
                    out["finish"] = ch["finish_reason"]
        out["text"] = "".join(pieces)
        out["whole"] = bool(events) and events[-1] == "[DONE]" and events.count("[DONE]") == 1 and finals == 1 \
            and out["error"] is None
    return out


async def plain_chat(client: httpx.AsyncClient, body: dict) -> dict:
    r = await client.post("/v1/chat/completions", json={**body, "stream": False})
    if r.status_code != 200:
        return {"status": r.status_code, "text": None, "error": r.json()["error"]["code"],
                "retry_after": r.headers.get("retry-after")}
    b = r.json()
    return {"status": 200, "text": b["choices"][0]["message"]["content"], "tokens": b["usage"]["completion_tokens"]}


async def disconnecting(client: httpx.AsyncClient, body: dict, after_first_token: bool,
                        queued_wait: float = 0.05) -> None:
    """Open a stream and vanish: after the first token, or while still queued (after `queued_wait` s)."""
    async def go() -> None:
        async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                    return
    if after_first_token:
        await go()
        return
    task = asyncio.create_task(go())
    await asyncio.sleep(queued_wait)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return


def offline_baseline(args) -> dict:
    """The same greedy chat requests through the offline Python API, one after another, in this process."""
    import edgerun

    rt = edgerun.load(args.model, draft=args.draft, n_ctx=args.ctx, n_threads=args.threads)
    try:
        t0, tokens = time.perf_counter(), 0
        for p in PROMPTS:
            tokens += rt.chat([{"role": "user", "content": p}], max_tokens=args.max_tokens, temperature=0).n_tokens
        wall = time.perf_counter() - t0
    finally:
        rt.close()
    return {"requests": len(PROMPTS), "tokens": tokens, "wall_s": wall, "throughput_tok_s": tokens / wall}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


async def run(args, srv: Server) -> dict:
    limits = httpx.Limits(max_connections=400, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=srv.url, timeout=900, limits=limits) as client:
        # warm-up: a few requests so allocator pools and caches reach their steady size
        for p in PROMPTS[:4]:
            await plain_chat(client, chat_body(args.model, p, args.max_tokens, False))
        rss_start = srv.rss_mb()
        n_done = 4

        # 1. burst: N concurrent streams + D disconnecting clients
        cancelled_before = srv.metric('edgerun_generations_total{outcome="cancelled"}')
        tok_before = srv.metric("edgerun_tokens_generated_total")
        bodies = [chat_body(args.model, PROMPTS[i % len(PROMPTS)], args.max_tokens, True)
                  for i in range(args.concurrency)]
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(stream_chat(client, b)) for b in bodies]
        # the queued half vanishes after 2 s: by then its request sits in the queue behind the burst
        dis = [asyncio.create_task(disconnecting(client, chat_body(args.model, PROMPTS[i % len(PROMPTS)], 200, True),
                                                 after_first_token=i % 2 == 0, queued_wait=2.0))
               for i in range(args.disconnects)]
        results = await asyncio.gather(*tasks)
        await asyncio.gather(*dis)
        wall = time.perf_counter() - t0
        burst_tokens = srv.metric("edgerun_tokens_generated_total") - tok_before
        n_done += args.concurrency + args.disconnects
        refs = {}
        for p in PROMPTS:
            refs[p] = (await plain_chat(client, chat_body(args.model, p, args.max_tokens, False)))["text"]
        n_done += len(PROMPTS)
        ok = [r for r in results if r["status"] == 200]
        whole = [r for r, b in zip(results, bodies) if r["status"] == 200 and r["whole"]
                 and r["text"] == refs[b["messages"][0]["content"]]]
        ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
        await asyncio.sleep(0.5)
        cancelled = srv.metric('edgerun_generations_total{outcome="cancelled"}') - cancelled_before
        burst = {"requests": args.concurrency, "disconnecting_clients": args.disconnects, "ok": len(ok),
                 "whole_and_equal_to_plain": len(whole), "wall_s": wall,
                 "ttft_p50_s": pct(ttfts, 0.5), "ttft_p95_s": pct(ttfts, 0.95), "ttft_max_s": max(ttfts or [0]),
                 "tokens": burst_tokens, "throughput_tok_s": burst_tokens / wall, "cancelled_generations": cancelled}

        # 2. overload: more than 1 running + `queue` waiting
        over_n = args.queue + 1 + args.overload_extra
        tok0 = srv.metric("edgerun_tokens_generated_total")
        t0 = time.perf_counter()
        over = await asyncio.gather(*[plain_chat(client, chat_body(args.model, PROMPTS[i % len(PROMPTS)],
                                                                   args.max_tokens, False)) for i in range(over_n)])
        over_wall = time.perf_counter() - t0
        n_done += over_n
        accepted = [r for r in over if r["status"] == 200]
        rejected = [r for r in over if r["status"] != 200]
        clean = [r for r in rejected if r["status"] == 503 and r["error"] == "queue_full"
                 and r["retry_after"] and int(r["retry_after"]) >= 1]
        correct = [r for r, i in zip(over, range(over_n)) if r["status"] == 200
                   and r["text"] == refs[PROMPTS[i % len(PROMPTS)]]]
        tokens = srv.metric("edgerun_tokens_generated_total") - tok0
        overload = {"requests": over_n, "queue": args.queue, "accepted": len(accepted), "rejected": len(rejected),
                    "rejected_clean_503": len(clean), "accepted_equal_to_plain": len(correct),
                    "wall_s": over_wall, "tokens": tokens, "throughput_tok_s": tokens / over_wall}

        # 3. soak: up to R requests in total, 8 at a time, mixed kinds; RSS sampled along the way
        samples = [(n_done, srv.rss_mb())]
        kinds = ("stream", "plain", "stream", "disconnect")
        i = 0
        while n_done < args.requests:
            batch = []
            for _ in range(min(8, args.requests - n_done)):
                kind = kinds[i % len(kinds)]
                body = chat_body(args.model, PROMPTS[i % len(PROMPTS)], args.soak_tokens, kind != "plain")
                batch.append(stream_chat(client, body) if kind == "stream" else plain_chat(client, body)
                             if kind == "plain" else disconnecting(client, body, after_first_token=i % 8 == 3))
                i += 1
            await asyncio.gather(*batch)
            n_done += len(batch)
            if n_done // 100 != (n_done - len(batch)) // 100:
                samples.append((n_done, srv.rss_mb()))
        await asyncio.sleep(1.0)
        samples.append((n_done, srv.rss_mb()))
        rss_end = samples[-1][1]
        soak = {"requests_total": n_done, "rss_start_mb": rss_start, "rss_end_mb": rss_end,
                "rss_growth_mb": rss_end - rss_start, "rss_samples": samples,
                "no_leak": rss_end - rss_start <= max(args.rss_slack_mb, 0.05 * rss_start)}
        counts = {name: srv.metric(name) for name in ("edgerun_tokens_generated_total", "edgerun_prompt_tokens_total",
                                                       "edgerun_decode_seconds_total")}
        return {"burst": burst, "overload": overload, "soak": soak, "server_counters": counts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="auto")
    ap.add_argument("--concurrency", type=int, default=50)
    ap.add_argument("--disconnects", type=int, default=10)
    ap.add_argument("--queue", type=int, default=64, help="server queue; the burst fits, the overload does not")
    ap.add_argument("--overload-extra", type=int, default=20, help="requests beyond queue + 1 in the overload phase")
    ap.add_argument("--requests", type=int, default=500, help="total requests by the end of the soak")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--soak-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None,
                    help="llama.cpp threads (default: the device profile's). On a machine shared with other "
                         "busy processes use 1: llama.cpp's threads wait for each other at every operation")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--rss-slack-mb", type=float, default=16.0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "serve.json"))
    a = ap.parse_args()

    before = offline_baseline(a)          # side by side: the offline API before and after the server
    srv = Server(a)
    try:
        res = asyncio.run(run(a, srv))
    finally:
        rc = srv.stop()
    after = offline_baseline(a)
    offline = (before["throughput_tok_s"] + after["throughput_tok_s"]) / 2
    res["offline_api"] = {"before": before, "after": after, "throughput_tok_s": offline,
                          "server_over_offline": res["overload"]["throughput_tok_s"] / offline}
    res["config"] = {k: v for k, v in vars(a).items() if k != "out"}
    res["machine"] = {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}
    res["server_exit_status"] = rc
    res["server_tracebacks"] = sum("Traceback" in l for l in srv.lines)
    res["server_log_tail"] = srv.lines[-400:] if res["server_tracebacks"] else []
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))

    b, o, s = res["burst"], res["overload"], res["soak"]
    rows = [
        ("burst: streams completed / whole & equal to plain", f"{b['ok']}/{b['requests']} / {b['whole_and_equal_to_plain']}"),
        ("burst: disconnecting clients / generations cancelled", f"{b['disconnecting_clients']} / {b['cancelled_generations']:.0f}"),
        ("burst: TTFT p50 / p95 / max (s)", f"{b['ttft_p50_s']:.2f} / {b['ttft_p95_s']:.2f} / {b['ttft_max_s']:.2f}"),
        ("burst: wall (s) / throughput (tok/s)", f"{b['wall_s']:.1f} / {b['throughput_tok_s']:.1f}"),
        ("overload: sent / accepted / rejected (clean 503)", f"{o['requests']} / {o['accepted']} / {o['rejected']} ({o['rejected_clean_503']})"),
        ("overload: accepted equal to plain", f"{o['accepted_equal_to_plain']}/{o['accepted']}"),
        ("overload: throughput (tok/s) / offline API, same requests", f"{o['throughput_tok_s']:.1f} / "
         f"{res['offline_api']['throughput_tok_s']:.1f} (ratio {res['offline_api']['server_over_offline']:.2f})"),
        ("soak: requests / RSS start -> end (MB)", f"{s['requests_total']} / {s['rss_start_mb']:.1f} -> {s['rss_end_mb']:.1f}"),
        ("soak: no leak", str(s["no_leak"])),
        ("server exit status / tracebacks", f"{rc} / {res['server_tracebacks']}"),
    ]
    w = max(len(r[0]) for r in rows)
    print(f"edgerun serve load test: {a.model}, threads {a.threads or 'from profile'}, queue {a.queue}, "
          f"load average at the end {res['machine']['load_avg_1m']:.1f} on {res['machine']['cpus']} CPUs")
    for k, v in rows:
        print(f"  {k.ljust(w)}  {v}")
    print(f"wrote {a.out}")
    failed = (b["whole_and_equal_to_plain"] != b["requests"] or o["rejected"] != o["rejected_clean_503"]
              or o["rejected"] == 0 or o["accepted_equal_to_plain"] != o["accepted"] or not s["no_leak"] or rc != 0
              or res["server_tracebacks"])
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
