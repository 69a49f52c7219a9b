"""The server's scheduling on an in-process server whose real Runtime can be held at a gate: readiness,
the bounded FIFO queue, cancellation on disconnect, time limits, stream intervals, speculation's statistics."""

from __future__ import annotations

import threading

import httpx
import pytest

from edgerun.runtime import load
from edgerun.serve.settings import ServerConfig
from server_harness import InProcessServer, Meter, wait_until
from server_fixtures import (CHAT, COMPL, CTX, MSGS, PARALLEL, assert_error, loader, hold_slots,
                             metric, post_in_thread, raw_request, stream_events, streamed_text)


@PARALLEL
def test_health_is_not_ready_until_the_model_is_loaded(tiny_llama, parallel):
    holder, load_gate = {}, threading.Event()
    with InProcessServer(ServerConfig(model=str(tiny_llama)), loader(tiny_llama, holder, load_gate, parallel)) as srv:
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "loading" and int(r.headers["retry-after"]) > 0
        r = httpx.post(srv.url + CHAT, json={"model": str(tiny_llama), "messages": MSGS})
        assert_error(r, 503, "model_loading")
        assert metric(srv.url, f'edgerun_ready{{model="{tiny_llama}"}}') == 0
        load_gate.set()
        wait_until(lambda: httpx.get(srv.url + "/health").status_code == 200, what="readiness")
        r = httpx.post(srv.url + CHAT, json={"model": str(tiny_llama), "messages": MSGS, "max_tokens": 3})
        assert r.status_code == 200, r.text


@PARALLEL
def test_queue_is_fifo_and_rejects_past_its_bound(tiny_llama, parallel):
    holder, out = {}, {}
    model = str(tiny_llama)
    with InProcessServer(ServerConfig(model=model, queue=2), loader(tiny_llama, holder, parallel=parallel)) as srv:
        wait_until(lambda: "rt" in holder, what="load")
        rt, sch = holder["rt"], srv.state.scheduler
        wait_until(sch.ready.is_set, what="ready")
        assert sch.n_slots == parallel
        rt.gate.clear()
        prompts = {"a": "one two", "b": "three four", "c": "five six"}
        threads = hold_slots(srv, rt, model, parallel - 1, out)          # the other slots are taken too
        threads.append(post_in_thread(srv.url, COMPL, {"model": model, "prompt": prompts["a"], "max_tokens": 6},
                                       out, "a"))
        assert rt.entered.acquire(timeout=30)                      # a is running, held at the gate
        for k in ("b", "c"):
            threads.append(post_in_thread(srv.url, COMPL, {"model": model, "prompt": prompts[k], "max_tokens": 6},
                                           out, k))
            wait_until(lambda: sch.depth == ("bc".index(k) + 1), what=f"{k} queued")
        assert [j.request.prompt for j in sch._waiting] == [prompts["b"], prompts["c"]]        # in arrival order
        r = httpx.post(srv.url + COMPL, json={"model": model, "prompt": "seven", "max_tokens": 6})
        assert_error(r, 503, "queue_full")
        assert int(r.headers["retry-after"]) >= 1
        # issue 20: a prompt that cannot fit is refused at once (400), even with the queue full: it never
        # takes a queue slot nor the worker's time to tokenize
        flood = {"model": model, "messages": [{"role": "user", "content": "<|im_start|>" * 4000}], "max_tokens": 1}
        assert_error(httpx.post(srv.url + CHAT, json=flood), 400, "context_length_exceeded", "messages")
        assert_error(httpx.post(srv.url + COMPL, json={"model": model, "prompt": "<|im_start|>" * 4000}), 400,
                     "context_length_exceeded", "prompt")
        assert metric(srv.url, "edgerun_queue_depth") == 2 and metric(srv.url, "edgerun_busy") == 1
        rt.gate.set()
        for t in threads:
            t.join(60)
        for k in [*"abc", *(f"h{i}" for i in range(parallel - 1))]:
            body = out[k].json()
            assert out[k].status_code == 200, body
            assert body["choices"][0]["finish_reason"] in ("stop", "length")
            assert body["usage"]["completion_tokens"] <= 6
        order = [next((k for k, p in prompts.items() if rt.tokenize(p) == toks), "held") for toks in rt.started]
        assert order[:parallel] == ["held"] * (parallel - 1) + ["a"]
        if parallel == 1:                   # one slot: b then c; several: both start as the held ones end
            assert order == ["a", "b", "c"]
        assert sorted(order[parallel:]) == ["b", "c"]
        assert metric(srv.url, 'edgerun_requests_total{endpoint="/v1/completions",status="503"}') == 1


@PARALLEL
def test_client_disconnect_cancels_its_generation_and_frees_the_slot(tiny_llama, parallel):
    holder, out = {}, {}
    model = str(tiny_llama)
    probe = {"model": model, "prompt": "the water is", "max_tokens": 12, "temperature": 0}
    with InProcessServer(ServerConfig(model=model, queue=2), loader(tiny_llama, holder, parallel=parallel)) as srv:
        wait_until(lambda: "rt" in holder, what="load")
        rt, sch = holder["rt"], srv.state.scheduler
        first = httpx.post(srv.url + COMPL, json=probe).json()
        before, before_tokens = first["choices"][0]["text"], first["usage"]["completion_tokens"]
        assert rt.entered.acquire(timeout=30)          # the probe's: from here on one release per held request

        # a queued request whose client goes away leaves the queue at once
        rt.gate.clear()
        running = raw_request(srv.url, COMPL, {"model": model, "prompt": "held", "max_tokens": 50, "stream": True,
                                                "temperature": 0})
        assert rt.entered.acquire(timeout=30)
        fillers = hold_slots(srv, rt, model, parallel - 1, out, max_tokens=1)   # one token each, then they end
        queued = raw_request(srv.url, CHAT, {"model": model, "messages": MSGS, "max_tokens": 50})
        wait_until(lambda: sch.depth == 1, what="queued")
        queued.close()
        wait_until(lambda: sch.depth == 0, what="the queued request to leave")

        # a running stream whose client goes away mid-stream stops at its next token
        rt.meter = Meter(2)
        rt.gate.set()
        buf = b""
        while buf.count(b"data: ") < 2:                 # headers + the first tokens arrived
            data = running.recv(65536)
            assert data, f"the stream ended early: {buf!r}"
            buf += data
        # close only once the generation waits for its 4th token: a disconnect noticed between two tokens
        # would end it after its 3rd (a race the test must not depend on)
        assert rt.meter.blocked.wait(30)
        running.close()
        wait_until(lambda: sch.running is not None and sch.running.stop_reason == "cancelled",
                   what="the disconnect to be noticed")
        rt.meter.release(1)
        wait_until(lambda: not sch.busy, what="the worker to stop")
        rt.meter = None
        for t in fillers:
            t.join(60)
        assert all(out[f"h{i}"].status_code == 200 for i in range(parallel - 1))
        assert metric(srv.url, 'edgerun_generations_total{outcome="cancelled"}') == 2
        # the 50-token stream was cut after its 4th token (the first three, then one more permit); in a batch
        # the cancelled sequence may leave the step that computes the 4th before it is counted
        cut = metric(srv.url, "edgerun_tokens_generated_total") - before_tokens - (parallel - 1)
        assert cut == 4 or (parallel > 1 and cut == 3), cut

        # the caches were rolled back: the same greedy request gives the same text
        after = httpx.post(srv.url + COMPL, json=probe).json()["choices"][0]["text"]
        assert after == before


@PARALLEL
def test_time_limit_ends_running_and_queued_requests(tiny_llama, parallel):
    holder, out = {}, {}
    model = str(tiny_llama)
    with InProcessServer(ServerConfig(model=model, queue=2, timeout_s=0.5),
                         loader(tiny_llama, holder, parallel=parallel)) as srv:
        wait_until(lambda: "rt" in holder, what="load")
        rt = holder["rt"]
        rt.gate.clear()
        t = post_in_thread(srv.url, COMPL, {"model": model, "prompt": "slow one", "max_tokens": 20,
                                             "temperature": 0}, out, "a")
        assert rt.entered.acquire(timeout=30)
        # greedy: a sampled request can draw EOS as its first token (CI saw it once) and end "stop"
        others = hold_slots(srv, rt, model, parallel - 1, out, max_tokens=20, temperature=0)
        r = httpx.post(srv.url + COMPL, json={"model": model, "prompt": "waits", "max_tokens": 5}, timeout=60)
        assert_error(r, 503, "queue_timeout")            # waited its whole limit behind the held request
        rt.gate.set()
        for t in [t, *others]:
            t.join(60)
        for k in ["a", *(f"h{i}" for i in range(parallel - 1))]:
            body = out[k].json()
            assert out[k].status_code == 200, body
            assert body["choices"][0]["finish_reason"] == "length" and body["edgerun"]["finish"] == "time_limit"
            assert body["usage"]["completion_tokens"] == 1     # stopped after the first token it produced
        assert metric(srv.url, 'edgerun_generations_total{outcome="timeout"}') == 1 + parallel


@PARALLEL
def test_server_output_equals_the_offline_runtime(tiny_llama, parallel):
    model = str(tiny_llama)
    with load(model, draft=None, profile="generic-x86_64-cpu", n_ctx=CTX, n_threads=1) as rt:
        offline = rt.generate("the quick brown fox", max_tokens=20, temperature=0)
    with InProcessServer(ServerConfig(model=model), loader(tiny_llama, {}, parallel=parallel)) as srv:
        wait_until(lambda: httpx.get(srv.url + "/health").status_code == 200, what="readiness")
        body = httpx.post(srv.url + COMPL, json={"model": model, "prompt": "the quick brown fox", "max_tokens": 20,
                                                 "temperature": 0}, timeout=60).json()
    assert body["choices"][0]["text"] == offline.text
    assert body["usage"]["completion_tokens"] == offline.n_tokens
    assert body["edgerun"]["finish"] == offline.finish_reason


@pytest.mark.parametrize("interval_ms", [0.0, 1000.0], ids=["each-token", "held"])
def test_a_stream_carries_one_event_per_token_whatever_the_interval(tiny_llama, interval_ms):
    """--stream-interval changes when a stream's tokens are written, not what is written: every token is
    still its own SSE event, in order, and the text is the plain answer's. At 1000 ms the tokens after the
    first are held and go out together (with the end, or when a nudge finds them)."""
    model = str(tiny_llama)
    body = {"model": model, "prompt": "the quick brown fox", "max_tokens": 20, "temperature": 0}
    with load(model, draft=None, profile="generic-x86_64-cpu", n_ctx=CTX, n_threads=1) as rt:
        pieces = [step.text for step in rt.stream("the quick brown fox", max_tokens=20, temperature=0)]
    config = ServerConfig(model=model, stream_interval_ms=interval_ms)
    with InProcessServer(config, loader(tiny_llama, {}, parallel=2)) as srv:
        wait_until(lambda: httpx.get(srv.url + "/health").status_code == 200, what="readiness")
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            plain = client.post(COMPL, json=body).json()
            events = stream_events(client, COMPL, body)
    texts = [e["choices"][0]["text"] for e in events if e["choices"] and e["choices"][0]["finish_reason"] is None]
    assert texts == [p for p in pieces if p]
    assert "".join(texts) == plain["choices"][0]["text"]


@PARALLEL
def test_speculative_stats_reach_the_response_and_metrics(tiny_llama, parallel):
    """With a drafter (prompt lookup, gamma 2) the server reports drafted/accepted tokens and gamma,
    and greedy speculative output is the same streamed or not."""
    model = str(tiny_llama)

    def load_spec():
        return load(model, draft="lookup", gamma=2, profile="generic-x86_64-cpu", n_ctx=CTX, n_threads=1,
                    parallel=parallel)

    body = {"model": model, "prompt": "one two three one two three one two three one two", "max_tokens": 24,
            "temperature": 0}
    with InProcessServer(ServerConfig(model=model), load_spec) as srv:
        wait_until(lambda: httpx.get(srv.url + "/health").status_code == 200, what="readiness")
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            full = client.post(COMPL, json=body).json()
            chunks = stream_events(client, COMPL, body)
        ext = full["edgerun"]
        assert ext["drafter"] == "lookup" and ext["n_drafted"] > 0 and ext["n_cycles"] > 0
        assert sum(ext["accept_histogram"]) >= 1 and 0 <= ext["n_accepted"] <= ext["n_drafted"]
        assert streamed_text(chunks, chat=False) == full["choices"][0]["text"]
        assert metric(srv.url, "edgerun_draft_tokens_total") >= ext["n_drafted"]
        assert metric(srv.url, "edgerun_gamma") == pytest.approx(ext["gamma_mean"], abs=1e-5)
        assert 0 < ext["gamma_mean"] <= 2
