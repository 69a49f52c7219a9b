"""Continuous batching in the server (an in-process server, real Runtime held at a gate): batched requests
equal their answers alone, slot moves and gaps, disconnects mid-batch, the prompt cache."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from edgerun.backends.base import common_prefix
from edgerun.runtime import load
from edgerun.serve.settings import ServerConfig
from server_harness import InProcessServer, wait_until
from server_fixtures import (COMPL, CTX, PARALLEL, assert_error, loader, hold_slots, metric,
                             post_in_thread, raw_request)


def test_concurrent_requests_are_batched_and_each_equals_its_answer_alone(tiny_llama):
    """Four clients at once (the official openai client, one thread each) on four slots: each greedy answer
    is the one the offline runtime gives alone, and the batches held several sequences' rows."""
    model = str(tiny_llama)
    prompts = ["the quick brown fox", "one two three", "hello there", "a b c d"]
    with load(model, draft=None, profile="generic-x86_64-cpu", n_ctx=CTX, n_threads=1) as rt:
        alone = [rt.generate(p, max_tokens=24, temperature=0).text for p in prompts]
    holder, out = {}, {}
    with InProcessServer(ServerConfig(model=model), loader(tiny_llama, holder, parallel=4)) as srv:
        wait_until(lambda: httpx.get(srv.url + "/health").status_code == 200, what="readiness")
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        holder["rt"].gate.clear()                      # all four start together

        def ask(i):
            out[i] = client.completions.create(model=model, prompt=prompts[i], max_tokens=24, temperature=0)
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for _ in range(4):
            assert holder["rt"].entered.acquire(timeout=30)
        holder["rt"].gate.set()
        for t in threads:
            t.join(60)
        assert [out[i].choices[0].text for i in range(4)] == alone
        group = srv.state.scheduler.slots[0].group
        assert group.n_rows > group.n_steps            # batches held rows of several sequences
        assert metric(srv.url, "edgerun_slots") == 4
        assert metric(srv.url, "edgerun_batch_rows_total") > metric(srv.url, "edgerun_batch_steps_total") > 0
        assert 0 < metric(srv.url, "edgerun_batch_eval_seconds_total") == pytest.approx(group.eval_s)
        # nothing runs or waits now: the huge-page collapse, kept out of the requests' way, starts
        wait_until(lambda: srv.state.scheduler.runtime.target.huge.started, what="the collapse at idle time")


def test_a_gap_a_finished_job_leaves_is_closed_by_moving_a_running_sequence(tiny_llama):
    """Jobs on slots 0, 1 and 2; the one on slot 1 ends first. llama.cpp would evaluate the busy ids 0 and
    2 in two passes, so the scheduler moves slot 2's running sequence to id 1 at the next step: both long
    answers are still the ones given alone, the move is counted, and the next job is placed on the id after
    them."""
    model = str(tiny_llama)
    prompts = {"long one": 48, "short": 2, "long two": 48}
    with load(model, draft=None, profile="generic-x86_64-cpu", n_ctx=CTX, n_threads=1) as rt:
        alone = {p: rt.generate(p, max_tokens=n, temperature=0).text for p, n in prompts.items()}
    holder, out = {}, {}
    with InProcessServer(ServerConfig(model=model), loader(tiny_llama, holder, parallel=4)) as srv:
        wait_until(lambda: httpx.get(srv.url + "/health").status_code == 200, what="readiness")
        rt, sch = holder["rt"], srv.state.scheduler
        rt.gate.clear()
        threads = []
        for p, n in prompts.items():                    # in order: slots 0, 1, 2
            threads.append(post_in_thread(srv.url, COMPL, {"model": model, "prompt": p, "max_tokens": n,
                                                            "temperature": 0}, out, p))
            assert rt.entered.acquire(timeout=30)
        assert [sch.packing.seq_id(i) for i in range(4)] == [0, 1, 2, 3]
        # one token per 5 ms in all: the long answers take ~0.5 s, so on a loaded machine they cannot end
        # before the scheduler's move after the short one (a race the move would lose, leaving the gap)
        rt.meter = threading.Semaphore(0)
        done = threading.Event()
        pacer = threading.Thread(target=lambda: [rt.meter.release() for _ in iter(lambda: done.wait(0.005), True)])
        pacer.start()
        rt.gate.set()
        for t in threads:
            t.join(60)
        done.set()
        pacer.join(10)
        rt.meter = None
        assert {p: out[p].json()["choices"][0]["text"] for p in prompts} == alone
        assert metric(srv.url, "edgerun_batch_moves_total") == 1
        assert [sch.packing.seq_id(i) for i in range(4)] == [0, 2, 1, 3]
        r = httpx.post(srv.url + COMPL, json={"model": model, "prompt": "short", "max_tokens": 2, "temperature": 0},
                       timeout=60)
        assert r.json()["choices"][0]["text"] == alone["short"]


def test_a_disconnect_mid_batch_frees_its_slot_and_leaves_the_others_untouched(tiny_llama):
    model = str(tiny_llama)
    body = {"model": model, "max_tokens": 30, "temperature": 0}
    with load(model, draft=None, profile="generic-x86_64-cpu", n_ctx=CTX, n_threads=1) as rt:
        alone = {p: rt.generate(p, max_tokens=30, temperature=0).text for p in ("stays", "comes later")}
    holder, out = {}, {}
    with InProcessServer(ServerConfig(model=model, queue=0), loader(tiny_llama, holder, parallel=2)) as srv:
        wait_until(lambda: httpx.get(srv.url + "/health").status_code == 200, what="readiness")
        rt, sch = holder["rt"], srv.state.scheduler
        rt.gate.clear()
        rt.meter = threading.Semaphore(0)              # each token after the first waits for a permit
        leaving = raw_request(srv.url, COMPL, {**body, "prompt": "goes away", "stream": True})
        assert rt.entered.acquire(timeout=30)
        staying = post_in_thread(srv.url, COMPL, {**body, "prompt": "stays"}, out, "stays")
        assert rt.entered.acquire(timeout=30)
        assert_error(httpx.post(srv.url + COMPL, json={**body, "prompt": "no room"}), 503, "queue_full")
        rt.gate.set()
        rt.meter.release(6)                             # both sequences advance, batched
        buf = b""
        while buf.count(b"data: ") < 2:
            data = leaving.recv(65536)
            assert data, f"the stream ended early: {buf!r}"
            buf += data
        (gone,) = [j for j in sch.running_jobs if j.request.prompt == "goes away"]
        leaving.close()
        # the sequence waits for its next permit until the server has seen the disconnect: a loaded machine
        # cannot let it run to its natural end first (that would be counted 'length', not 'cancelled')
        wait_until(lambda: gone.stop_reason == "cancelled", what="the disconnect to be seen")
        rt.meter.release(1000)
        wait_until(lambda: len(sch.running_jobs) <= 1, what="the disconnect to free its slot")
        later = httpx.post(srv.url + COMPL, json={**body, "prompt": "comes later"}, timeout=60)   # the freed slot
        staying.join(60)
        rt.meter = None
        assert out["stays"].json()["choices"][0]["text"] == alone["stays"]
        assert later.json()["choices"][0]["text"] == alone["comes later"]
        assert metric(srv.url, 'edgerun_generations_total{outcome="cancelled"}') == 1


def test_a_request_runs_on_the_packed_slot_with_the_prefix_another_slot_holds(tiny_llama):
    """A lone request runs on the lowest free slot (busy sequence ids stay contiguous: a gap costs llama.cpp a
    second pass), and a longer prefix of its prompt cached in another free slot is copied there, not evaluated
    again; the slot it was copied from keeps its cache."""
    model = str(tiny_llama)
    holder, out = {}, {}
    prompts = {"x": "the story so far: one two three four five", "y": "a different conversation entirely"}
    with InProcessServer(ServerConfig(model=model), loader(tiny_llama, holder, parallel=2)) as srv:
        wait_until(lambda: httpx.get(srv.url + "/health").status_code == 200, what="readiness")
        rt, sch = holder["rt"], srv.state.scheduler
        rt.gate.clear()                                 # both slots busy at once: y on slot 0, then x on slot 1
        threads = []
        for k in ("y", "x"):
            threads.append(post_in_thread(srv.url, COMPL, {"model": model, "prompt": prompts[k], "max_tokens": 4,
                                                            "temperature": 0}, out, k))
            assert rt.entered.acquire(timeout=30)
        rt.gate.set()
        for t in threads:
            t.join(60)
        caches = [list(s.target.tokens) for s in sch.slots]
        x = rt.tokenize(prompts["x"])
        assert caches[1][:len(x)] == x and caches[0][:len(x)] != x
        group = sch.slots[0].group
        for turn in range(3):                           # the same conversation, one turn further each time
            rows, moved = group.n_rows, sch.packing.n_moved
            r = httpx.post(srv.url + COMPL, json={"model": model, "prompt": prompts["x"] + " six", "max_tokens": 4,
                                                  "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
            assert list(sch.slots[0].target.tokens[:len(x)]) == x                  # it ran on slot 0
            assert sch.packing.n_moved - moved == (1 if turn == 0 else 0)   # copied once, then slot 0 holds it
            assert group.n_rows - rows < len(x)          # the cached prefix was not evaluated again
            assert list(sch.slots[1].target.tokens) == caches[1]                  # slot 1 untouched


def test_a_request_cancels_a_move_that_waits_for_a_step(tiny_llama):
    """A slot freed by a finished job may wait, holding the dispatch lock, for a move that closes the gap
    in the busy sequence ids (Scheduler._compact). A move is applied at the next step, and when none comes
    (every running sequence's consumer is away) the new request must not wait for it: submit cancels the
    move and the request runs at once. Here the move is made as _compact makes it, with sequence 0 parked
    after its first token."""
    model = str(tiny_llama)
    body = {"model": model, "max_tokens": 8, "temperature": 0}
    with load(model, draft=None, profile="generic-x86_64-cpu", n_ctx=CTX, n_threads=1) as rt:
        alone = {p: rt.generate(p, max_tokens=8, temperature=0).text for p in ("first", "second")}
    holder, out = {}, {}
    with InProcessServer(ServerConfig(model=model), loader(tiny_llama, holder, parallel=2)) as srv:
        wait_until(lambda: httpx.get(srv.url + "/health").status_code == 200, what="readiness")
        rt, sch = holder["rt"], srv.state.scheduler
        group = sch.slots[0].group
        parked = threading.Event()

        class Meter(threading.Semaphore):              # each token after the first waits for a permit
            def acquire(self, *a, **kw):
                parked.set()
                return super().acquire(*a, **kw)
        rt.meter = Meter(0)
        first = post_in_thread(srv.url, COMPL, {**body, "prompt": "first"}, out, "first")
        assert parked.wait(60), "the first job never reached its second token"
        got: list = []
        with sch._dispatch:                            # as _compact holds it: no slot places a job meanwhile
            mover = threading.Thread(target=lambda: got.append(
                group.move(sch.slots[0].batch_views(), sch.slots[1].batch_views(), timeout_s=120)), daemon=True)
            mover.start()
            wait_until(lambda: bool(group._moves), what="the move to wait for a step")
            second = post_in_thread(srv.url, COMPL, {**body, "prompt": "second"}, out, "second")
            mover.join(60)
            assert got == [False] and group.n_moves == 0   # cancelled by the request, not timed out
        rt.meter.release(1000)
        first.join(60)
        second.join(60)
        rt.meter = None
        assert out["first"].json()["choices"][0]["text"] == alone["first"]
        assert out["second"].json()["choices"][0]["text"] == alone["second"]


@PARALLEL
def test_prompt_cache_restores_a_repeated_prompt_and_changes_nothing(tiny_llama, parallel):
    """A prompt seen before, whose slot cache other requests have overwritten since (every slot taken by a
    held request), is restored from the prompt cache instead of evaluated, and the answer is the same as the
    first time; with --prompt-cache 0 nothing is kept."""
    model = str(tiny_llama)
    long_a = "the water is cold and the river runs under the old stone bridge near the mill every spring morning"
    body = {"model": model, "prompt": long_a, "max_tokens": 8, "temperature": 0}
    for mib in (256, 0):
        holder, out = {}, {}
        with InProcessServer(ServerConfig(model=model, prompt_cache_mib=mib),
                             loader(tiny_llama, holder, parallel=parallel)) as srv:
            wait_until(lambda: "rt" in holder, what="load")
            rt, sch = holder["rt"], srv.state.scheduler
            first = httpx.post(srv.url + COMPL, json=body, timeout=60).json()["choices"][0]["text"]
            assert rt.entered.acquire(timeout=30)
            rt.gate.clear()
            for t in hold_slots(srv, rt, model, parallel, out, max_tokens=4, temperature=0):   # every slot overwritten
                rt.gate.set()
                t.join(60)
            a = rt.tokenize(long_a)
            assert all(common_prefix(s.target.tokens, a) < 16 for s in sch.slots)
            again = httpx.post(srv.url + COMPL, json=body, timeout=60).json()["choices"][0]["text"]
            hits = metric(srv.url, "edgerun_prompt_cache_hits_total")
            restored = metric(srv.url, "edgerun_prompt_cache_restored_tokens_total")
        assert again == first
        if mib:
            assert hits == 1 and restored >= 16
        else:
            assert hits == 0 and sch.prompt_cache is None
