"""Continuous batching (issue 22): several sequences of one llama.cpp context, each running the one decode
loop, their steps evaluated together (edgerun/engine/batch.py). Real llama.cpp, real threads.

What must hold: each sequence's output is what it would be alone (greedy at 1 thread, and sampled with
a fixed seed: its own rng and logits); a sequence that stops mid-batch leaves the others untouched; and
the sampled joint law of two batched sequences' first tokens is the product of the one-sequence laws
(a chi-square test that a row-mixing batcher fails).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from edgerun.backends.llamacpp import LlamaCppBackend
from edgerun.config import BackendArgs
from edgerun.errors import InvalidArgument
from edgerun.runtime import load
from edgerun.speculative.sampling import probs
from test_verify import P_FAIL, P_PASS, chisquare_pooled

# A row's logits, batched with other sequences' rows, against the same row evaluated alone. llama.cpp's
# multi-row kernels round differently from its one-row path: on an AVX-512 CPU (AMD Zen 4) sequence 3 of the
# tiny model differs by 2.6e-4 whenever it shares a ubatch with sequence 2, filler row or not, while a row that
# saw a position it should not have (a filler left in the cache) differs by 1.75.
ROW_ATOL = 1e-3

PROMPTS = ["the quick brown fox", "one two three one two three", "hello there", "a b c d e f"]


def _load(path, parallel, **kw):
    kw.setdefault("draft", None)
    return load(str(path), profile="generic-x86_64-cpu", n_ctx=256, n_threads=1, parallel=parallel, **kw)


def _concurrently(fns) -> list:
    """Run the callables on their own threads, started together; their results in order."""
    out: list = [None] * len(fns)
    errors: list = []
    barrier = threading.Barrier(len(fns))

    def go(i):
        try:
            barrier.wait()
            out[i] = fns[i]()
        except BaseException as e:     # re-raised in the test's thread
            errors.append(e)
    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return out


def _texts_alone_and_batched(rt, prompts, **kw):
    alone = [rt.generate(p, **kw).text for p in prompts]
    slots = rt.slots()
    batched = _concurrently([lambda s=s, p=p: s.generate(p, **kw).text for s, p in zip(slots, prompts)])
    return alone, batched, slots[0].group


@pytest.mark.parametrize("draft,gamma", [(None, 0), ("lookup", 2), ("self", 3), ("self", "auto")])
def test_greedy_batched_equals_alone(tiny_llama, draft, gamma, monkeypatch):
    """Four concurrent greedy generations (plain, prompt lookup, a model drafter on its own batched
    context; a fixed gamma, or the tuner under BatchedGamma) each give the text they give alone; they
    really shared batches."""
    from edgerun.speculative.gamma import BatchedGamma

    plain = []
    real = BatchedGamma.plain_cycle
    monkeypatch.setattr(BatchedGamma, "plain_cycle", lambda self, lag=0: plain.append(real(self, lag)) or plain[-1])
    rt = _load(tiny_llama, 4, draft=str(tiny_llama) if draft == "self" else draft, gamma=gamma)
    with rt:
        alone, batched, group = _texts_alone_and_batched(rt, PROMPTS, max_tokens=24, temperature=0)
        assert batched == alone
        assert group.n_rows > group.n_steps          # some batch held rows of more than one position
        assert bool(plain) == (gamma == "auto")      # the tuner is asked through BatchedGamma


@pytest.mark.parametrize("draft,gamma", [(None, 0), ("self", 2)])
def test_generations_that_join_a_running_one_are_stepped_by_the_engine_thread(tiny_llama, draft, gamma):
    """A generation that starts alone runs on its own thread (BatchGroup.run, as drive); those that join
    it while it runs are stepped by the engine thread (run_inline), and the first moves there too at its
    next Step: each text is what it is alone, the first's Steps came from both threads, and batches held
    its rows with the others'."""
    from edgerun.engine import blocking

    rt = _load(tiny_llama, 4, draft=str(tiny_llama) if draft else None, gamma=gamma)
    with rt:
        kw = dict(max_tokens=24, temperature=0)
        alone = [rt.generate(p, **kw).text for p in PROMPTS]
        slots = rt.slots()
        group = slots[0].group
        kinds: dict[int, set] = {}
        orig = rt.target.eval_rows

        def spy(rows):
            kinds.setdefault(len(kinds), {q for q, _, _ in rows})
            return orig(rows)
        rt.target.eval_rows = spy
        first_going = threading.Event()
        texts: list = [None] * 4
        where: list[str] = []

        def first():
            text = []

            def on_step(step):
                text.append(step.text)
                where.append(threading.current_thread().name)
                if len(text) == 2:
                    first_going.set()
                    blocking(lambda: joined.wait(30))     # hold on until the others run beside it
            slots[0].stream_tokens(slots[0].tokenize(PROMPTS[0]), **kw).run(on_step)
            texts[0] = "".join(text)

        joined = threading.Event()

        def later(i):
            assert first_going.wait(30)
            texts[i] = slots[i].generate(PROMPTS[i], **kw).text
        threads = [threading.Thread(target=first)] + [threading.Thread(target=later, args=(i,)) for i in (1, 2, 3)]
        for t in threads:
            t.start()
        assert first_going.wait(30)
        wait_for = time.monotonic() + 30
        while group.n_inline < 3 and time.monotonic() < wait_for:
            time.sleep(0.005)
        joined.set()
        for t in threads:
            t.join(120)
        assert texts == alone
        assert group.n_inline == 4                   # the three that joined, and the first once they had
        assert where[0] != "edgerun-engine" and where[-1] == "edgerun-engine"
        assert any(0 in ids and len(ids) > 1 for ids in kinds.values())   # sequence 0 shared a batch with them


def test_without_greenlet_every_generation_runs_on_its_own_thread(tiny_llama):
    """BatchGroup.run without greenlet (no hub): every loop runs on the thread that started it, as drive()
    runs it, the texts are the same and nothing ran on the engine thread's hub."""
    with _load(tiny_llama, 4) as rt:
        kw = dict(max_tokens=16, temperature=0)
        alone = [rt.generate(p, **kw).text for p in PROMPTS]
        slots = rt.slots()
        group = slots[0].group
        group._hub = None
        assert not group.steps_inline
        batched = _concurrently([lambda s=s, p=p: s.generate(p, **kw).text for s, p in zip(slots, PROMPTS)])
        assert batched == alone and group.n_inline == 0 and group.n_rows > group.n_steps


def test_every_evaluation_of_a_multi_sequence_context_runs_on_the_engine_thread(tiny_llama):
    """llama.cpp's CPU backend runs a call on an OpenMP team of the calling thread, a team lives as long as
    its thread, and a second live team slows the working one (libgomp's throttled spinning; engine.thread.on_engine).
    So every llama_decode of a multi-sequence context, of the target and of a model drafter, whoever calls
    it (the slots' decode loops, an eval from this thread as the start-up cost probe makes), runs on the
    process's one engine thread; a one-sequence context evaluates on the calling thread."""
    rt = _load(tiny_llama, 4, draft=str(tiny_llama), gamma=2)
    callers: dict[str, set] = {"target": set(), "draft": set()}
    for name, be in (("target", rt.target), ("draft", rt.drafter.backend)):
        def spy(*a, _orig=be._decode_flat, _name=name):
            callers[_name].add(threading.current_thread().name)
            return _orig(*a)
        be._decode_flat = spy
    with rt:
        rt.target.eval(rt.tokenize("hello"), 1)             # from this thread, as the cost probe does
        rt.drafter.backend.eval(rt.tokenize("hello"), 1)
        slots = rt.slots()
        _concurrently([lambda s=s, p=p: s.generate(p, max_tokens=16, temperature=0).text
                       for s, p in zip(slots, PROMPTS)])
        assert len(callers["target"]) == 1 and callers["target"] == callers["draft"]
        assert next(iter(callers["target"])).startswith("edgerun-engine")
    one = LlamaCppBackend(tiny_llama, BackendArgs(n_ctx=64, n_threads=1))
    seen: set = set()
    orig = one._decode_flat
    one._decode_flat = lambda *a: (seen.add(threading.current_thread().name), orig(*a))[1]
    try:
        one.eval([1, 2, 3], 1)
    finally:
        one.close()
    assert seen == {threading.current_thread().name}


@pytest.mark.parametrize("stepped", ["own thread", "engine thread"])
def test_a_job_being_admitted_joins_the_next_step_and_a_slow_admission_holds_none(tiny_llama, stepped):
    """A job being placed on a free slot (tokenizing, restoring a prefix) holds the running sequences'
    next batch until its prompt rows join it, up to ADMIT_GRACE_S from the admission's start: a burst's
    prompts share a pass instead of straggling into passes of their own. An admission slower than that
    holds nothing after it. Both ways of running a member: iterated on its own thread (drive), and run
    with a callback on the engine thread (run_inline, the server's), whose ~1 ms wait per token goes
    through blocking()."""
    from edgerun.engine import ADMIT_GRACE_S, blocking

    with _load(tiny_llama, 4) as rt:
        batches: list[list[tuple[int, int]]] = []
        orig = rt.target.eval_rows
        rt.target.eval_rows = lambda rows: (batches.append([(q, len(t)) for q, t, _ in rows]), orig(rows))[1]
        slots = rt.slots()
        group = slots[0].group
        going = threading.Event()

        def long_run():                          # sequence 0, its consumer taking ~1 ms per token
            stream = slots[0].stream_tokens(rt.tokenize(PROMPTS[0]), max_tokens=200, temperature=0)
            if stepped == "own thread":
                for i, _ in enumerate(stream):
                    if i == 5:
                        going.set()
                    time.sleep(0.001)
            else:
                n = []

                def on_step(step):
                    n.append(step)
                    if len(n) == 6:
                        going.set()
                    blocking(lambda: time.sleep(0.001))
                stream.run(on_step)
        a = threading.Thread(target=long_run)
        a.start()
        assert going.wait(30)
        out = {}

        def admit(slot, hold_s, key):
            group.begin_admission()
            try:
                n0 = len(batches)
                time.sleep(hold_s)               # the admission's own work
                out[key] = len(batches) - n0
                stream = slots[slot].stream_tokens(rt.tokenize(PROMPTS[slot]), max_tokens=2, temperature=0)
                if stepped == "own thread":
                    list(stream)
                else:
                    stream.run(lambda step: None)
            finally:
                group.end_admission()
        b = threading.Thread(target=admit, args=(1, 0.02, "quick"))
        b.start()
        b.join(30)
        first_of_1 = next(bt for bt in batches if any(q == 1 for q, _ in bt))
        c = threading.Thread(target=admit, args=(2, 6 * ADMIT_GRACE_S, "slow"))
        c.start()
        c.join(30)
        a.join(60)
    assert out["quick"] <= 1                     # sequence 0 waited for the admission (at most the step in flight)
    assert (0, 1) in first_of_1 and any(q == 1 and n > 1 for q, n in first_of_1)   # the prompt joined its step
    assert out["slow"] >= 5                      # past the grace, sequence 0 went on without it


def test_sampled_with_seeds_reproduce_batched(tiny_llama):
    """Sampled generations with fixed seeds: each sequence has its own rng, so the batched text is the
    alone text (and the seeds differ, so the texts do too)."""
    with _load(tiny_llama, 4) as rt:
        kw = [dict(max_tokens=20, temperature=1.0, seed=s) for s in (1, 2, 3, 4)]
        alone = [rt.generate(p, **k).text for p, k in zip(PROMPTS, kw)]
        slots = rt.slots()
        batched = _concurrently([lambda s=s, p=p, k=k: s.generate(p, **k).text for s, p, k in zip(slots, PROMPTS, kw)])
        assert batched == alone
        again = _concurrently([lambda s=s, p=p, k=k: s.generate(p, **k).text for s, p, k in zip(slots, PROMPTS, kw)])
        assert again == alone


@pytest.mark.parametrize("stepped", ["own thread", "engine thread"])
def test_a_sequence_stopping_mid_batch_leaves_the_others_untouched(tiny_llama, stepped):
    """A consumer that goes away after 4 tokens (a stream closed on its own thread, or a callback that
    returns False on the engine thread, as the server's on a disconnect) rolls its sequence back to what
    it committed; the others' texts and caches are what they are alone, and the freed slot serves again."""
    with _load(tiny_llama, 3) as rt:
        kw = dict(max_tokens=40, temperature=0)
        alone = [rt.generate(p, **kw).text for p in PROMPTS[:3]]
        slots = rt.slots()
        started = threading.Event()

        def quitter():
            stream = slots[1].stream_tokens(slots[1].tokenize(PROMPTS[1]), **kw)
            if stepped == "own thread":
                for i, _ in enumerate(stream):
                    if i == 3:
                        started.set()
                        break                   # the consumer goes away: the loop rolls its cache back
                stream.close()
            else:
                got = []

                def on_step(step):
                    got.append(step)
                    if len(got) == 4:
                        started.set()
                        return False            # the same, from a callback on the engine thread
                stream.run(on_step)
                assert len(got) == 4
            n = len(slots[1].target.tokens)
            # then the freed slot serves a new request, from scratch, while the others still run
            return n, slots[1].generate(PROMPTS[1], **kw).text

        out = _concurrently([lambda: slots[0].generate(PROMPTS[0], **kw).text, quitter,
                             lambda: slots[2].generate(PROMPTS[2], **kw).text])
        assert out[0] == alone[0] and out[2] == alone[2]
        n_after_stop, text = out[1]
        assert n_after_stop == len(rt.tokenize(PROMPTS[1])) + 4 - 1   # prompt + 4 committed, minus pending
        assert text == alone[1]
        for i in (0, 2):                        # each cache holds its own committed tokens, minus pending
            toks = rt.tokenize(PROMPTS[i])
            assert slots[i].target.tokens[:len(toks)] == toks



@pytest.mark.parametrize("stepped", ["own thread", "engine thread"])
@pytest.mark.parametrize("draft,gamma", [(None, 0), ("self", 2)])
def test_a_running_sequence_moved_to_a_free_id_goes_on_as_alone(tiny_llama, draft, gamma, stepped):
    """BatchGroup.move mid-generation: slot 2's sequences (target, and a model drafter's) move to idle slot
    1's ids between two steps while slot 0 runs beside it (on the engine thread); both texts are what they
    are alone, the views swapped ids, the moved caches hold their tokens and the idle slot's are empty.
    Slot 2 iterated on its own thread (a group with members of both kinds) or run on the engine thread."""
    rt = _load(tiny_llama, 4, draft=str(tiny_llama) if draft else None, gamma=gamma)
    with rt:
        kw = dict(max_tokens=32, temperature=0)
        alone = [rt.generate(p, **kw).text for p in PROMPTS[:3]]
        slots = rt.slots()
        halfway = threading.Event()
        moved: list = []

        def mover():
            stream = slots[2].stream_tokens(slots[2].tokenize(PROMPTS[2]), **kw)
            text = []

            def on_step(step):
                text.append(step.text)
                if len(text) == 6:
                    halfway.set()
            if stepped == "own thread":
                for step in stream:
                    on_step(step)
            else:
                stream.run(on_step)
            return "".join(text)

        def move():
            assert halfway.wait(60)
            moved.append(slots[0].group.move(slots[2].batch_views(), slots[1].batch_views(), timeout_s=30))
            return None

        out = _concurrently([lambda: slots[0].generate(PROMPTS[0], **kw).text, mover, move])
        assert moved == [True] and slots[0].group.n_moves == 1
        assert out[0] == alone[0] and out[1] == alone[2]
        views2, views1 = slots[2].batch_views(), slots[1].batch_views()
        assert [v.seq for v in views2] == [1] * len(views2) and [v.seq for v in views1] == [2] * len(views1)
        toks = rt.tokenize(PROMPTS[2])
        for v in views2:
            assert v.tokens[:len(toks)] == toks and v.tokens is v.shared.seq_tokens(1)
        for v in views1:
            assert v.tokens == [] and v.tokens is v.shared.seq_tokens(2)
        # a finished generation is no member: moving it does nothing; the slot serves on at its new id
        assert not slots[0].group.move(slots[2].batch_views(), slots[1].batch_views(), timeout_s=0.2)
        assert slots[2].generate(PROMPTS[2], **kw).text == alone[2]


def test_a_waiting_move_ends_when_its_sequence_ends_or_is_cancelled(tiny_llama):
    """A move waits for the group's next step. When no step comes because the sequence to move is the only
    member and its consumer holds a Step, the move must not wait out its timeout: it ends unapplied as soon
    as that sequence ends, or when cancel_moves() is called (the server's submit does, so that a freed slot
    takes a new job at once instead of holding it for the move). The sequence goes on as alone. Before
    this, a burst of requests that came right after the last one ended waited ~0.1 s for such a move."""
    rt = _load(tiny_llama, 4)
    with rt:
        kw = dict(max_tokens=12, temperature=0)
        alone = rt.generate(PROMPTS[2], **kw).text
        slots = rt.slots()
        group = slots[0].group
        src, dst = slots[2].batch_views(), slots[1].batch_views()
        assert not group.move(src, dst, timeout_s=60)            # no member: False at once

        def move_in_thread() -> tuple[threading.Thread, list]:
            got: list = []
            t = threading.Thread(target=lambda: got.append(group.move(src, dst, timeout_s=60)), daemon=True)
            t.start()
            deadline = time.monotonic() + 30
            while not group._moves and t.is_alive() and time.monotonic() < deadline:
                time.sleep(0.001)
            assert group._moves, "the move did not wait for a step"
            return t, got

        for ending in ("cancelled", "ended"):
            stream = slots[2].stream_tokens(rt.tokenize(PROMPTS[2]), **kw)
            text = [next(stream).text]                # the consumer holds a Step: no step comes
            t, got = move_in_thread()
            if ending == "cancelled":
                group.cancel_moves()
                t.join(30)
                assert got == [False]
                text += [step.text for step in stream]     # it goes on, unmoved
                assert "".join(text) == alone
            else:
                stream.close()                            # the sequence ends: nothing left to move
                t.join(30)
                assert got == [False]
            assert not t.is_alive() and not group._moves and group.n_moves == 0
            assert [v.seq for v in src] == [2] and [v.seq for v in dst] == [1]


def test_move_seq_moves_the_cache_and_the_token_lists(four_seqs):
    """The backend half of a move: sequence 2's cache now answers as sequence 1 (the same logits as before
    the move, from the reference context), sequence 2 is empty, and the token lists went with the caches."""
    be, ref = four_seqs
    lists = [be.seq_tokens(s) for s in range(4)]
    be.move_seq(2, 1)
    assert be.seq_tokens(1) is lists[2] and be.seq_tokens(2) is lists[1]
    assert be.seq_tokens(1) == [3, 4, 5] and be.seq_tokens(2) == []
    moved = be.eval_rows([(1, [9], 1)])[0]
    expect = ref.eval_rows([(2, [9], 1)])[0]
    np.testing.assert_allclose(moved, expect, atol=ROW_ATOL)
    fresh = be.eval_rows([(2, [3, 4, 5, 9], 1)])[0]       # the emptied id takes a new sequence from scratch
    np.testing.assert_allclose(fresh, expect, atol=ROW_ATOL)

def _first_token_pairs(rt, prompts, sampling_kw, n_trials):
    """(first token of sequence 0, first token of sequence 1) of n_trials batched pairs of generations."""
    slots = rt.slots()[:2]
    eos = rt.tokenizer.eos_id          # a generation that ends at once committed its end token
    pairs = np.empty((n_trials, 2), dtype=np.int64)
    for t in range(n_trials):
        res = _concurrently([lambda s=s, p=p, i=i: s.generate(p, max_tokens=6, seed=2 * t + i, **sampling_kw).tokens
                             for i, (s, p) in enumerate(zip(slots, prompts))])
        pairs[t] = [r[0] if r else eos for r in res]
    return pairs, slots[0].group


def _joint_law(rt, prompts, sampling_kw) -> np.ndarray:
    """p(x0) p(x1) over [V x V]: each sequence's exact one-sequence law of its first token."""
    sampling = rt.sampling_args(**sampling_kw)
    laws = []
    for p in prompts:
        toks = rt.tokenize(p)
        rt.target.truncate(0)
        laws.append(probs(rt.target.eval(toks, n_logits=1)[-1], sampling, toks))
    rt.target.truncate(0)
    return np.outer(laws[0], laws[1]).ravel()


SAMPLED = dict(temperature=1.0, top_k=6)
N_TRIALS = 600


def test_batched_sampling_follows_each_sequences_law(tiny_llama):
    """Two sequences sampled in the same batches: the joint law of their first tokens is the product of
    the laws each has alone (chi-square over the pairs)."""
    with _load(tiny_llama, 2) as rt:
        prompts = PROMPTS[:2]
        pairs, group = _first_token_pairs(rt, prompts, SAMPLED, N_TRIALS)
        assert group.n_rows > group.n_steps                 # the pairs really were batched
        V = rt.target.n_vocab
        counts = np.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V)
        p_value = chisquare_pooled(counts, _joint_law(rt, prompts, SAMPLED))
        print("p", p_value)
        assert p_value > P_PASS


def test_a_row_mixing_batcher_fails_the_test(tiny_llama, monkeypatch):
    """The known-wrong variant: a batcher that hands two sequences each other's logits rows."""
    orig = LlamaCppBackend.eval_rows

    def mixed(self, rows):
        outs = orig(self, rows)
        ks = [k for _, _, k in rows]
        if len(outs) == 2 and ks[0] == ks[1]:
            outs = outs[::-1]
        return outs

    monkeypatch.setattr(LlamaCppBackend, "eval_rows", mixed)
    with _load(tiny_llama, 2) as rt:
        prompts = PROMPTS[:2]
        pairs, _ = _first_token_pairs(rt, prompts, SAMPLED, N_TRIALS // 2)      # overlapping: rows mixed
        V = rt.target.n_vocab
        counts = np.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V)
        p_value = chisquare_pooled(counts, _joint_law(rt, prompts, SAMPLED))
        print("wrong-variant p", p_value)
        assert p_value < P_FAIL


@pytest.mark.real_model
def test_real_model_greedy_batched_equals_alone():
    """SmolLM2-135M (the registry file), 1 thread: four concurrent greedy generations, each equal to alone."""
    from edgerun.resolve import resolve_model

    path = resolve_model("smollm2-135m-instruct")
    with _load(path, 4) as rt:
        prompts = ["The capital of France is", "def fib(n):", "Once upon a time", "List three colors:"]
        alone, batched, group = _texts_alone_and_batched(rt, prompts, max_tokens=32, temperature=0)
        assert batched == alone
        assert group.n_rows > group.n_steps


def test_batched_gamma_prices_the_second_pass_of_a_speculating_sequence():
    """The batch-aware gamma: alone it is the tuner's choice; with m sequences active a speculating one's
    step costs T(m) + T(gamma) (llama.cpp runs the m first rows, then its other gamma rows: split_equal gives
    every sequence of a ubatch the same rows), and it drafts only where that second pass brings more tokens
    than it costs. Expected values worked by hand (a drafter always right, t_draft 1 ms, gamma 0 or 4):
    flat (every pass 10 ms): m=2: 2/10 ms = 200/s vs 6/24 ms = 250/s -> 4; m=3: 300 vs 7/24 = 292 -> 0.
    knee (T(n) = 10 ms x max(1, n - 4)): m=4: 400 vs 8/24 = 333 -> 0; m=6: 300 vs 10/34 = 294 -> 0;
    m=8: 200 vs 12/54 = 222 -> 4 (the batch is dear, the drafted rows' pass is not).
    (Between 1 and 4 drafts the rate rises with gamma here, so 4 is the best one.) Priced as one pass of
    T(m + gamma) instead, flat would draft 4 at every m and knee 1 at m=4."""
    from edgerun.device.cost import CostCurve
    from edgerun.speculative.gamma import BatchedGamma, GammaTuner

    flat = CostCurve(t_verify=tuple(0.010 for _ in range(40)), t_draft=0.001)
    knee = CostCurve(t_verify=tuple(0.010 * max(1, n - 4) for n in range(1, 41)), t_draft=0.001)
    for curve, expect in ((flat, {1: 4, 2: 4, 3: 0, 8: 0}), (knee, {1: 4, 2: 4, 4: 0, 6: 0, 8: 4})):
        tuner = GammaTuner(curve, gamma_max=4)
        for _ in range(50):                                 # a drafter that is always right
            tuner.observe(4, 4, 0.004, curve.verify(5))
        active = [1]
        policy = BatchedGamma(tuner, lambda: active[0])
        got = {}
        for m in expect:
            active[0] = m
            got[m] = policy.choose(0)
            assert tuner.n_explored == 0, "the tuner itself chose 4 (not an exploration cycle)"
        assert got == expect



def test_cycles_lowered_by_the_batch_teach_the_tuner_nothing_about_the_drafter():
    """A long stretch of busy batches (gamma lowered to 0 every cycle) leaves the tuner's model of the drafter
    as it was: once the sequence is alone again it drafts at once, and the drafter's supply is still ~1. The
    earlier code let the tuner read every lowered cycle as "asked for 4, supplied none": supply fell towards
    0, speculation switched off for the pair and was persisted so (tuner_store) for single clients too."""
    from edgerun.device.cost import CostCurve
    from edgerun.speculative.gamma import BatchedGamma, GammaTuner

    flat = CostCurve(t_verify=tuple(0.010 for _ in range(40)), t_draft=0.001)
    tuner = GammaTuner(flat, gamma_max=4)
    for _ in range(50):                                     # a drafter that is always right
        tuner.observe(4, 4, 0.004, flat.verify(5))
    supply0, acc0 = tuner.supply(0).copy(), tuner.acceptance(0).copy()
    active = [3]                                            # flat, m=3: drafting does not pay (test above)
    policy = BatchedGamma(tuner, lambda: active[0])
    for _ in range(300):
        g = policy.choose(0)
        assert g == 0
        policy.observe(g, 0, 0.0, flat.verify(3))
    assert policy.n_lowered > 250
    # (its rare plain explorations are observed as such: they decay the counts a little)
    np.testing.assert_allclose(tuner.supply(0), supply0, rtol=1e-3)
    np.testing.assert_allclose(tuner.acceptance(0), acc0, rtol=1e-3)
    active[0] = 1
    assert policy.choose(0) == 4                            # alone again: speculation at once
    with pytest.raises(InvalidArgument):
        tuner.lower(5)

def test_a_batch_in_which_no_draft_can_pay_runs_plain_without_asking_the_tuner():
    """plain_cycle() says 0 ahead of the drafter's hint exactly where choose() would (a tuner copy asked the
    same), never where a draft could still pay, and leaves what the tuner learned and owes as it was."""
    import copy

    from edgerun.device.cost import CostCurve
    from edgerun.speculative.gamma import BatchedGamma, GammaTuner

    flat = CostCurve(t_verify=tuple(0.010 for _ in range(40)), t_draft=0.001)
    knee = CostCurve(t_verify=tuple(0.010 * max(1, n - 4) for n in range(1, 41)), t_draft=0.001)
    cpu = CostCurve(t_verify=tuple(0.040 * (1 + 0.75 * (n - 1)) for n in range(1, 41)), t_draft=0.0145)
    seen = {True: 0, False: 0}
    for curve in (flat, knee, cpu):
        tuner = GammaTuner(curve, gamma_max=4)
        for _ in range(50):                                 # a drafter that is always right
            tuner.observe(4, 4, 0.004, curve.verify(5))
        for m in range(1, 9):
            active = [m]
            twin = copy.deepcopy(tuner)
            owed = tuner._since_explore.copy()
            plain = BatchedGamma(tuner, lambda: active[0]).plain_cycle(0)
            chosen = BatchedGamma(twin, lambda: active[0]).choose(0)
            seen[plain] += 1
            if plain:
                assert chosen == 0, (curve, m)
                np.testing.assert_array_equal(tuner._since_explore, owed)    # no exploration moved
            if m == 1 or (curve is flat and m == 2) or (curve is knee and m == 8):
                assert not plain and chosen > 0, (curve, m)   # a draft pays there (test above)
            tuner.observe(0, 0, 0.0, curve.verify(1))
    assert seen[True] > 10 and seen[False] > 3
    # the cycle taken that way teaches the tuner nothing about the drafter
    tuner = GammaTuner(flat, gamma_max=4)
    for _ in range(50):
        tuner.observe(4, 4, 0.004, flat.verify(5))
    supply0, acc0 = tuner.supply(0).copy(), tuner.acceptance(0).copy()
    policy = BatchedGamma(tuner, lambda: 3)
    for _ in range(300):
        assert policy.plain_cycle(0)
        policy.observe(0, 0, 0.0, flat.verify(3))
    assert policy.n_lowered == 300
    np.testing.assert_array_equal(tuner.supply(0), supply0)
    np.testing.assert_array_equal(tuner.acceptance(0), acc0)
    assert BatchedGamma(tuner, lambda: 1).choose(0) == 4    # alone again: speculation at once


def test_batch_times_do_not_bend_the_tuners_cost_model():
    """A batch's time is not a sequence's cost: other sequences' prompts join batches (hundreds of rows), and
    a batch time rescaled by the curve's T(1) / T(m) read a load far above the machine's; alternating with
    cycles alone, the fast load factor and the slow shape(1) drifted apart (a live tuner after a 4-client bench:
    load 2.37, shape(1) 0.44, and T(2) / T(1) 4.8 where the probe measured 1.8, from a shape(2) learned when
    the load was lower). Times seen in a batch of several sequences are not learned: stretches of 4, 1 and 2
    clients, the machine 10% slower than the probe and prompts joining every 25th step, leave the model at the
    machine's own T(n)."""
    from edgerun.device.cost import CostCurve
    from edgerun.speculative.gamma import BatchedGamma, GammaTuner

    curve = CostCurve(t_verify=(0.0405, 0.0713, 0.1008, 0.1014, 0.1314, 0.1589, 0.1910, 0.2019, 0.2209),
                      t_draft=0.0145)                      # the Qwen @spec pair's probe on the 2-core Zen 3
    tuner = GammaTuner(curve, gamma_max=8, n_classes=4)
    active = [4]
    policy = BatchedGamma(tuner, lambda: active[0])
    rng = np.random.default_rng(0)
    for _ in range(40):
        for m in (4, 1, 2):
            active[0] = m
            for i in range(100):
                g = 0 if policy.plain_cycle(0) else policy.choose(i % 4)
                step = {1: 1.1 * curve.verify(g + 1), 2: 0.09, 4: 0.17}[m] * (1 + 0.1 * rng.standard_normal())
                if m > 1 and i % 25 == 0:
                    step *= 4                      # a prompt joined this batch
                policy.observe(g, 0, 0.0145 * g, step)
    assert 0.9 < tuner._load < 1.3 and 0.8 < tuner._shape[1] < 1.25
    for n in (1, 2, 4):
        assert tuner.t_verify(n) == pytest.approx(1.1 * curve.verify(n), rel=0.15), n


@pytest.fixture
def four_seqs(tiny_llama):
    """Two 4-sequence contexts of the tiny model, each sequence s holding tokens [1+s, 2+s, 3+s]: the one a
    test batches, and a reference evaluated alone."""
    from edgerun.config import BackendArgs

    pair = [LlamaCppBackend(tiny_llama, BackendArgs(n_ctx=64, n_threads=1, n_seq=4)) for _ in range(2)]
    try:
        for b in pair:
            for s in range(4):
                b.eval_rows([(s, [1 + s, 2 + s, 3 + s], 1)])
        yield tuple(pair)
    finally:
        for b in pair:
            b.close()


def test_rows_reach_llama_cpp_in_sequence_order(four_seqs, monkeypatch):
    """llama.cpp's split_equal takes consecutive sequence ids into one ubatch: rows posted out of order
    (2, 0, 3, 1) are handed over in ascending order, and each row still gets its own logits."""
    from edgerun import llama_lib

    be, ref = four_seqs
    L = llama_lib.lib()
    seen = []
    decode = L.llama_decode

    def spy(ctx, batch):
        seen.append([batch.seq_id[i][0] for i in range(batch.n_tokens)])
        return decode(ctx, batch)
    monkeypatch.setattr(L, "llama_decode", spy)
    order = [2, 0, 3, 1]
    outs = be.eval_rows([(s, [10 + s, 20 + s], 2) for s in order])
    monkeypatch.setattr(L, "llama_decode", decode)
    assert seen == [[0, 0, 1, 1, 2, 2, 3, 3]]
    for s, out in zip(order, outs):        # each row's logits are its own sequence's, alone
        alone = ref.eval_rows([(s, [10 + s, 20 + s], 2)])[0]
        np.testing.assert_allclose(out, alone, rtol=0, atol=ROW_ATOL)


def test_a_gap_in_the_sequence_ids_is_filled_and_leaves_the_idle_sequence_untouched(four_seqs, monkeypatch):
    """split_equal starts a new ubatch at a gap in the ids (rows of 0, 1, 3 would run as [0, 1] and [3]):
    the idle sequence 2 gets throw-away positions in the same llama_decode, removed right after. The rows'
    logits are their own, sequence 2's cache is as it was (its next logits equal a fresh run), and unequal
    rows are not filled. (Filling forced here; whether it is used is learned by timing, next test.)"""
    from edgerun import llama_lib

    be, ref = four_seqs
    be.fill_gaps = True
    L = llama_lib.lib()
    seen = []
    decode = L.llama_decode

    def spy(ctx, batch):
        seen.append([(batch.seq_id[i][0], batch.pos[i], batch.logits[i]) for i in range(batch.n_tokens)])
        return decode(ctx, batch)
    monkeypatch.setattr(L, "llama_decode", spy)
    outs = be.eval_rows([(3, [13], 1), (0, [10], 1), (1, [11], 1)])
    uneven = be.eval_rows([(0, [20, 21], 1), (3, [23], 1)])
    monkeypatch.setattr(L, "llama_decode", decode)
    assert seen[0] == [(0, 3, 1), (1, 3, 1), (2, 3, 0), (3, 3, 1)]      # one decode, the gap filled
    assert [s for s, _, _ in seen[1]] == [0, 0, 3]                       # unequal rows: nothing added
    assert be.seq_tokens(2) == [3, 4, 5]
    for s, tok, out in [(3, 13, outs[0]), (0, 10, outs[1]), (1, 11, outs[2])]:
        alone = ref.eval_rows([(s, [tok], 1)])[0]
        np.testing.assert_allclose(out, alone, rtol=0, atol=ROW_ATOL)
    np.testing.assert_allclose(uneven[0], ref.eval_rows([(0, [20, 21], 1)])[0], rtol=0, atol=ROW_ATOL)
    # the idle sequence: the filler positions are gone from its cache
    np.testing.assert_allclose(be.eval_rows([(2, [30, 31], 2)])[0], ref.eval_rows([(2, [30, 31], 2)])[0],
                               rtol=0, atol=ROW_ATOL)
    be.fill_gaps = False                   # split, as llama.cpp would
    seen.clear()
    monkeypatch.setattr(L, "llama_decode", spy)
    be.eval_rows([(0, [40], 1), (1, [41], 1), (3, [43], 1)])
    monkeypatch.setattr(L, "llama_decode", decode)
    assert [s for s, _, _ in seen[0]] == [0, 1, 3]


def test_gap_filling_is_learned_by_timing_each_way(monkeypatch):
    """GapChooser times each way a few times per shape, then keeps the faster (with a re-check now and then);
    a device where the split is faster (a compute-bound CPU) never settles on filling, and the reverse."""
    from edgerun.backends.gapfill import GapChooser

    for fill_s, split_s in ((0.030, 0.050), (0.050, 0.030)):
        g = GapChooser(trials=3, recheck_every=10)
        shape = (3, 1, 1)
        picks = []
        for _ in range(40):
            f = g.fill(shape)
            picks.append(f)
            g.observe(shape, f, fill_s if f else split_s)
        assert picks[:6].count(True) == 3 and picks[:6].count(False) == 3      # both ways tried first
        settled = picks[6:]
        faster = fill_s < split_s
        assert settled.count(faster) >= len(settled) - 4 and settled.count(not faster) >= 1   # re-checks
        assert g.fill((2, 1, 1)) is True                                        # a new shape is tried afresh


def test_the_backend_learns_whether_to_fill(tiny_llama, monkeypatch):
    """Without fill_gaps forced, the backend asks its GapChooser per decode and reports the time back."""
    from edgerun.config import BackendArgs

    be = LlamaCppBackend(tiny_llama, BackendArgs(n_ctx=64, n_threads=1, n_seq=4))
    try:
        for s in range(4):
            be.eval_rows([(s, [1 + s, 2 + s], 1)])
        for i in range(8):
            be.eval_rows([(0, [10 + i], 1), (3, [20 + i], 1)])
            for s in (0, 3):
                be.truncate_seq(s, 2)
        learned = be.gaps.learned()
        assert list(learned) == ["2 seqs + 2 gap x 1 rows"]
        assert learned["2 seqs + 2 gap x 1 rows"]["fill_ms"] > 0 and learned["2 seqs + 2 gap x 1 rows"]["split_ms"] > 0
        assert be.seq_tokens(1) == [2, 3] and be.seq_tokens(2) == [3, 4]
    finally:
        be.close()


def test_a_lone_sequence_evaluates_ahead_and_rolls_back_what_it_began(tiny_llama, monkeypatch):
    """Plain decoding alone in a group starts each next evaluation before it yields the token (generate.py,
    BatchGroup.begin): the text is the one-sequence backend's, and whatever ends the generation (a stop
    string, the consumer leaving, max_tokens, the context's end) leaves the cache holding exactly the committed
    tokens minus the pending one, the evaluation begun ahead rolled back."""
    from edgerun.engine import batch as batch_mod

    began = []
    orig = batch_mod.BatchGroup.begin
    monkeypatch.setattr(batch_mod.BatchGroup, "begin", lambda self, *a: began.append(1) or orig(self, *a))
    with _load(tiny_llama, 2) as rt:
        kw = dict(max_tokens=30, temperature=0)
        alone = rt.generate(PROMPTS[0], **kw).text
        slot = rt.slots()[0]
        n_prompt = len(slot.tokenize(PROMPTS[0]))

        res = slot.generate(PROMPTS[0], **kw)
        assert res.text == alone and res.stats.n_tokens >= 10 and len(began) >= res.stats.n_tokens - 1
        assert len(slot.target.tokens) == n_prompt + res.stats.n_tokens - (res.stats.finish_reason != "eos")

        stop = alone[len(alone) // 2:len(alone) // 2 + 3]
        res = slot.generate(PROMPTS[0], stop=[stop], **kw)
        assert res.text == alone[:alone.index(stop)] and res.stats.finish_reason == "stop"
        assert len(slot.target.tokens) == n_prompt + res.stats.n_tokens - 1

        stream = slot.stream_tokens(slot.tokenize(PROMPTS[0]), **kw)
        for i, _ in enumerate(stream):
            if i == 5:
                break                           # the consumer leaves while the next evaluation runs
        stream.close()
        assert len(slot.target.tokens) == n_prompt + 6 - 1

        long = slot.target.tokenizer.tokenize("one two three four " * 200)[:slot.target.n_ctx - 4]
        steps = list(slot.stream_tokens(long, max_tokens=50, temperature=0))     # to the context's end
        st = slot.last_stats
        assert st.finish_reason == "length" and len(steps) == st.n_tokens == 5
        assert len(slot.target.tokens) == len(long) + st.n_tokens - 1 == slot.target.n_ctx


def test_a_lone_sequence_with_a_drafter_evaluates_its_plain_cycles_ahead(tiny_llama, monkeypatch):
    """With the suffix drafter (the default model-free one) a lone slot's cycles that will not draft (no match
    yet, or the policy says 0) have their evaluation begun before the previous cycle's tokens are yielded, as
    plain decoding does (generate.py _EvalAhead); cycles that draft evaluate as usual. Greedy, the text is the
    one-sequence backend's plain text; a stop string still leaves the cache at the committed tokens."""
    from edgerun.engine import batch as batch_mod
    from edgerun.speculative import suffix

    began, extended = [], []
    orig = batch_mod.BatchGroup.begin
    monkeypatch.setattr(batch_mod.BatchGroup, "begin", lambda self, *a: began.append(1) or orig(self, *a))
    extend = suffix.SuffixAutomaton.extend
    monkeypatch.setattr(suffix.SuffixAutomaton, "extend", lambda self, t: extended.append(t) or extend(self, t))
    prompt = PROMPTS[1] * 3
    with _load(tiny_llama, 1) as rt:
        plain = rt.generate(prompt, max_tokens=40, temperature=0).text
    with _load(tiny_llama, 2, draft="suffix", gamma=4) as rt:
        slot = rt.slots()[0]
        n_prompt = len(slot.tokenize(prompt))
        res = slot.generate(prompt, max_tokens=40, temperature=0)
        st = res.stats
        assert res.text == plain
        n_cycles = st.n_tokens - st.n_accepted - st.n_forced
        assert 0 < len(began) < n_cycles and st.n_drafted > 0, (len(began), n_cycles, st.n_drafted)
        # the drafter's automaton grows by the committed tokens: choosing gamma ahead rebuilds nothing
        assert len(extended) <= n_prompt + st.n_tokens + 1, (len(extended), n_prompt, st.n_tokens)
        assert len(slot.target.tokens) == n_prompt + st.n_tokens - (st.finish_reason != "eos")
        stop = plain[len(plain) // 2:len(plain) // 2 + 3]
        res = slot.generate(prompt, stop=[stop], max_tokens=40, temperature=0)
        assert res.text == plain[:plain.index(stop)]
        assert len(slot.target.tokens) == n_prompt + res.stats.n_tokens - 1
