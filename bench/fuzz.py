"""The grammar fuzzers of tests/test_fuzz.py, run longer, and the sandbox's cost per new grammar.

For each strategy (JSON schemas, regexes, Lark grammars from tests/fuzz_strategies.py), N generated
grammars go through `Runtime.constraint` on a real model and, when they compile, a few masks and
tokens; reported: how many compiled, how many were refused (InvalidArgument), how many failed any
other way (must be 0), and the slowest one. Then generated request bodies (REQUEST_BODY) against the
real app on the same model, in process: how many were answered 2xx and 4xx, and how many got a 5xx or
left /health unanswered (must be 0). --fork-cost: the first check of a new small schema (the
sandbox's fork + compile + 16 masks) against the same work in the process and a remembered verdict.

    nice python bench/fuzz.py [--model smollm2-135m-instruct] [--examples 300] [--only request_body]
                              [--out bench/results/fuzz.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fuzz_strategies import ANY_SCHEMA, LARK, REGEX, REQUEST_BODY  # noqa: E402

from edgerun.errors import InvalidArgument  # noqa: E402
from edgerun.runtime import load  # noqa: E402


def run_strategy(rt, name: str, strategy, kw: str, examples: int) -> dict:
    counts: Counter = Counter()
    slowest = [0.0, ""]

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(value=strategy)
    def one(value):
        t = time.perf_counter()
        try:
            c = rt.constraint(**{kw: value})
            for _ in range(4):
                allowed = np.flatnonzero(c.continuing_mask())
                if not len(allowed):
                    break
                c.consume(int(allowed[len(allowed) // 2]))
            counts["compiled"] += 1
        except InvalidArgument:
            counts["refused"] += 1
        except Exception as e:            # noqa: BLE001 - counted: the point of the bench is that there are none
            counts[f"failed {type(e).__name__}"] += 1
        dt = time.perf_counter() - t
        if dt > slowest[0]:
            slowest[:] = [dt, repr(value)[:120]]

    one()
    return {"strategy": name, "examples": sum(counts.values()), **counts, "slowest_s": slowest[0],
            "slowest": slowest[1]}


def run_bodies(rt, model: str, examples: int) -> dict:
    """REQUEST_BODY against the real app (create_app, uvicorn on a thread) serving `rt`."""
    import httpx

    from edgerun.serve.settings import ServerConfig
    from server_harness import InProcessServer, wait_until

    counts: Counter = Counter()
    slowest = [0.0, ""]
    with InProcessServer(ServerConfig(model=model, queue=4), lambda: rt) as srv:
        wait_until(srv.state.scheduler.ready.is_set, timeout=120, what="ready")
        name = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["id"]

        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(body=REQUEST_BODY)
        def one(body):
            if not isinstance(body.get("model"), str):
                body["model"] = name
            path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
            try:
                raw = json.dumps(body)
            except RecursionError:        # a schema chain too deep for this client's encoder: not sendable
                counts["not encodable"] += 1     # (raw deep bodies: tests/test_hardening.py)
                return
            t = time.perf_counter()
            try:
                status = httpx.post(srv.url + path, content=raw, headers={"Content-Type": "application/json"},
                                    timeout=120).status_code
                healthy = httpx.get(srv.url + "/health", timeout=30).status_code == 200
            except Exception as e:        # noqa: BLE001 - counted: there must be none
                counts[f"failed {type(e).__name__}"] += 1
                return
            counts["2xx" if status < 300 else "4xx" if status < 500 else "failed 5xx"] += 1
            if not healthy:
                counts["failed health"] += 1
            dt = time.perf_counter() - t
            if dt > slowest[0]:
                slowest[:] = [dt, repr(body)[:400]]

        one()
    return {"strategy": "request_body",
            "examples": sum(v for k, v in counts.items() if k not in ("failed health", "not encodable")),
            **counts, "slowest_s": slowest[0], "slowest": slowest[1]}


def fork_cost(rt, n: int = 12) -> dict:
    from edgerun.constrain import sandbox
    from edgerun.constrain.grammar import Grammar, _trial, _vocab

    v = _vocab(rt.tokenizer, rt.target.n_vocab)
    first, inproc, again = [], [], []
    for i in range(n):
        g = Grammar.json_schema({"type": "object", "properties": {f"k{i}_{time.time_ns()}": {"type": "integer"},
                                                                  "tags": {"type": "array", "items": {"enum": ["a", "b"]}}}})
        t = time.perf_counter()
        sandbox.vet(g.source, g.what, v.trial)
        first.append(time.perf_counter() - t)
        t = time.perf_counter()
        _trial(g, v)
        inproc.append(time.perf_counter() - t)
        t = time.perf_counter()
        sandbox.vet(g.source, g.what, v.trial)
        again.append(time.perf_counter() - t)
    return {"first_check_ms": statistics.median(first) * 1e3, "in_process_ms": statistics.median(inproc) * 1e3,
            "remembered_us": statistics.median(again) * 1e6, "n": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--examples", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated: json_schema,regex,lark,request_body (default all)")
    ap.add_argument("--out", default="bench/results/fuzz.json")
    a = ap.parse_args()
    rt = load(a.model, draft=None, profile="generic-x86_64-cpu", n_threads=a.threads, pull=False)
    only = set(a.only.split(",")) if a.only else {"json_schema", "regex", "lark", "request_body"}
    rows = [run_strategy(rt, name, strategy, kw, a.examples) for name, strategy, kw in
            (("json_schema", ANY_SCHEMA, "json_schema"), ("regex", REGEX, "grammar"), ("lark", LARK, "grammar"))
            if name in only]
    cost = fork_cost(rt)
    if "request_body" in only:
        rows.append(run_bodies(rt, a.model, a.examples))        # last: the server closes the runtime when it stops
    result = {"model": a.model, "rows": rows, "fork_cost": cost}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"{'strategy':12s} {'cases':>6s} {'compiled':>9s} {'refused':>8s} {'other':>6s} {'slowest s':>10s}"
          "   (request bodies: compiled = 2xx, refused = 4xx, other = 5xx or /health down)")
    for r in rows:
        other = sum(v for k, v in r.items() if k.startswith("failed"))
        ok, no = (r.get("2xx", 0), r.get("4xx", 0)) if r["strategy"] == "request_body" else \
            (r.get("compiled", 0), r.get("refused", 0))
        print(f"{r['strategy']:12s} {r['examples']:6d} {ok:9d} {no:8d} {other:6d} {r['slowest_s']:10.2f}"
              + (f"   ({r['not encodable']} too deep for the client's encoder, not sent)" if r.get("not encodable") else ""))
    print(f"a new grammar's sandboxed check: {cost['first_check_ms']:.1f} ms (in process {cost['in_process_ms']:.1f} ms,"
          f" remembered {cost['remembered_us']:.0f} us), median of {cost['n']}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
