"""Cross-request history for suffix lookup (edgerun/speculative/history.py, `serve --suffix-history`).

- The store: a bucket never holds more than its budget, keeps at least 3/4 of it once full, drops its
  oldest answers first; keys are separate buckets. A cursor's match is the longest suffix of its context
  found inside one stored answer (brute force), never across two, and what it drafts followed a real
  occurrence; answers added while a request reads the bucket keep its claims true.
- The drafter with history, on the reference backend: greedy output equals plain greedy, and a repeated
  prompt gets its earlier answer drafted (more accepted tokens in fewer target calls). Sampled, the joint
  law of two tokens with history drafts passes the chi-square test against the exact target law, and a
  loop that appends such drafts unverified fails it.
- The real server (SmolLM2-135M, two API keys in one key file, gamma fixed): key 1's repeated question gets
  more accepted drafts than its first; key 2's first ask gets exactly what key 1's first got (no draft
  from key 1's history: its hit counter stays 0 in /metrics) and its own repeat gets what key 1's repeat
  got; with the setting off nothing is held and a repeat gets nothing more.
- The default: `--draft auto` is suffix lookup for a model without a paired drafter (a pair keeps its model).
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from click.testing import CliRunner

import edgerun.generate as gen
from edgerun.backends.reference import ReferenceBackend
from edgerun.cli import main
from edgerun.config import SamplingArgs
from edgerun.generate import GenStats, generate
from edgerun.registry.cache import cache_dir
from edgerun.speculative.gamma import FixedGamma
from edgerun.speculative.history import BLOCKS, PROMPT_TAIL, SEPARATOR, SuffixHistory, _Frozen, _Growing
from edgerun.speculative.sampling import as_dist
from edgerun.speculative.suffix import SuffixDrafter
from server_harness import ServerProcess, clean_env
from test_spec_exact import SETTINGS, exact_pairs, sample_pairs
from test_verify import P_FAIL, P_PASS, chisquare_pooled

GREEDY = SamplingArgs(temperature=0.0)


# ---------------------------------------------------------------- the store

def segments(bucket) -> list[list[int]]:
    """The answers a bucket holds now, oldest first."""
    out = []
    for b in bucket.blocks:
        cur: list[int] | None = None
        for t in b.sa.tokens:
            if t == SEPARATOR:
                cur = []
                out.append(cur)
            else:
                cur.append(t)
    return out


def test_a_bucket_is_bounded_and_drops_its_oldest_answers_first():
    h = SuffixHistory(400)
    b = h.bucket("k")
    rng = np.random.default_rng(0)
    added = []
    for i in range(60):
        ans = [int(x) for x in rng.integers(0, 50, rng.integers(5, 40))]
        b.add(ans, prompt=[1000 + i])
        added.append([1000 + i, *ans])
        held = segments(b)
        assert b.tokens == sum(map(len, held)) <= 400
        assert held == added[len(added) - len(held):]             # the newest ones, in order: oldest out first
        if sum(map(len, added)) > 400:
            assert b.tokens >= 400 * (BLOCKS - 1) // BLOCKS - 40  # a full bucket keeps most of its budget
    assert b.answers == 60 and len(segments(b)) < 60


def test_the_prompt_tail_and_a_long_answer_are_cut():
    b = SuffixHistory(100).bucket(None)
    assert b.add([], prompt=[1, 2, 3]) == 0 and b.tokens == 0       # no answer: nothing kept
    assert b.add([7, 8], prompt=list(range(500))) == PROMPT_TAIL + 2
    assert segments(b)[-1] == [*range(500 - PROMPT_TAIL, 500), 7, 8]
    b.add(list(range(300)))
    assert b.tokens <= 100 and segments(b)[-1] == list(range(100))


def test_keys_are_separate_buckets():
    h = SuffixHistory(1000)
    h.bucket(1, "1").add([5, 6, 7, 8, 9], prompt=[1, 2])
    c = h.bucket(2, "2").cursor()
    c.feed([1, 2, 5, 6])
    assert c.match() == (0, -1)                                      # key 2 sees nothing of key 1's
    c1 = h.bucket(1).cursor()
    c1.feed([1, 2, 5, 6])
    k, where = c1.match()
    assert k == 4 and c1.continuation(where, 3) == [7, 8, 9]
    assert h.stats() == [("1", 7, 0, 0), ("2", 0, 0, 0)]


def test_metrics_show_each_keys_history_and_nothing_when_off():
    from edgerun.serve.metrics import Metrics

    h = SuffixHistory(1000)
    h.bucket(2, "2").add([5, 6, 7], prompt=[1])
    cur = h.bucket(2).cursor()
    cur.feed([1, 5])
    cur.count(len(cur.continuation(cur.match()[1], 4)))
    text = Metrics().render(queue_depth=0, queue_limit=1, busy=False, ready=True, suffix_history=h.stats())
    assert 'edgerun_suffix_history_tokens{key="2"} 4' in text
    assert 'edgerun_suffix_history_hits_total{key="2"} 1' in text
    assert 'edgerun_suffix_history_draft_tokens_total{key="2"} 2' in text
    off = Metrics().render(queue_depth=0, queue_limit=1, busy=False, ready=True)
    assert "suffix_history" not in off


def brute(ctx: list[int], answers: list[list[int]]) -> int:
    """Length of the longest suffix of ctx found inside one answer."""
    best = 0
    for k in range(1, len(ctx) + 1):
        suf = ctx[-k:]
        if any(a[i:i + k] == suf for a in answers for i in range(len(a) - k + 1)):
            best = k
        else:
            break
    return best


def test_a_frozen_block_has_the_growing_ones_transitions():
    rng = np.random.default_rng(1)
    sa = _Growing()
    for t in [SEPARATOR, *rng.integers(0, 4, 300), SEPARATOR, *rng.integers(0, 4, 50)]:
        sa.extend(int(t))
    frozen = _Frozen(sa)
    for s in range(len(sa.next)):
        for t in (SEPARATOR, 0, 1, 2, 3, 4, 70000):
            assert frozen.go(s, t) == sa.go(s, t)
    assert len(frozen.keys) == sum(map(len, sa.next))


@pytest.mark.parametrize("budget", [10_000, 60], ids=["one-block", "frozen-blocks"])
@pytest.mark.parametrize("alphabet", [2, 3, 6])
def test_a_cursor_finds_the_longest_match_inside_one_answer(alphabet, budget):
    rng = np.random.default_rng(alphabet)
    for _ in range(10):
        b = SuffixHistory(budget).bucket("k")
        for _ in range(8):
            b.add([int(x) for x in rng.integers(0, alphabet, rng.integers(1, 12))])
        answers = segments(b)
        assert budget > 100 or (len(b.blocks) > 1 and isinstance(b.blocks[0].sa, _Frozen))
        cur = b.cursor()
        ctx: list[int] = []
        for t in rng.integers(0, alphabet, 40):
            ctx.append(int(t))
            cur.feed([int(t)])
            k, where = cur.match()
            assert k == brute(ctx, answers)
            if k:
                sa = cur.blocks[where].sa
                end = sa.end[cur.state[where]]
                assert list(sa.tokens[end - k + 1:end + 1]) == ctx[-k:]     # a real occurrence...
                cont = cur.continuation(where, 4)
                assert SEPARATOR not in cont and list(sa.tokens[end + 1:end + 1 + len(cont)]) == cont   # ...its sequel


@pytest.mark.parametrize("budget", [100_000, 40], ids=["growing", "frozen-and-dropped"])
def test_answers_added_meanwhile_keep_a_cursors_claims_true(budget):
    rng = np.random.default_rng(7)
    b = SuffixHistory(budget).bucket("k")
    b.add([int(x) for x in rng.integers(0, 3, 30)])
    cur = b.cursor()
    seen: list[int] = []
    for _ in range(300):
        seen.append(int(rng.integers(0, 3)))
        cur.feed(seen[-1:])
        b.add([int(x) for x in rng.integers(0, 3, 5)])               # another request ends (states split)
        k, where = cur.match()
        if k:
            sa = cur.blocks[where].sa
            end = sa.end[cur.state[where]]
            assert k <= sa.length[cur.state[where]]
            assert list(sa.tokens[end - k + 1:end + 1]) == seen[-k:]    # a real occurrence of the context's end


# ---------------------------------------------------------------- the drafter (reference backend)

@pytest.fixture(scope="module")
def target(tiny_model_factory):
    return ReferenceBackend(tiny_model_factory(arch="llama", wtype="f32", seed=0))


def run(target, prompt, drafter=None, gamma=0, max_tokens=32):
    stats = GenStats()
    toks = [s.token for s in generate(target, prompt, GREEDY, max_tokens=max_tokens, drafter=drafter,
                                      policy=FixedGamma(gamma), rng=np.random.default_rng(0), stats=stats)]
    return toks, stats


def test_a_repeated_prompt_is_drafted_from_history_and_the_answer_is_the_same(target):
    tok = target.tokenizer
    h = SuffixHistory(5000)
    for text in ("Hello there, the world", "<|im_start|>user\nwhat is it?<|im_end|>\n<|im_start|>assistant\n"):
        prompt = tok.tokenize(text)
        plain, _ = run(target, prompt)
        alone = SuffixDrafter()
        first, st1 = run(target, prompt, alone, 4)
        d = SuffixDrafter()
        d.history = h.bucket("k")
        d.history.add(plain, prompt)                                  # as the server adds a finished answer
        again, st2 = run(target, prompt, d, 4)
        assert first == plain and again == plain
        assert st2.n_accepted > st1.n_accepted and st2.n_accepted >= len(plain) // 2, (st1, st2)
        assert st2.n_cycles < st1.n_cycles
        other = SuffixDrafter()
        other.history = h.bucket("other")                              # another key: nothing to draw on
        third, st3 = run(target, prompt, other, 4)
        assert third == plain and st3.n_accepted == st1.n_accepted
    assert h.bucket("k").hits > 0 and h.bucket("other").hits == 0


def test_greedy_with_a_misleading_history_equals_plain(target):
    """History drafts that are wrong (another prompt's answers, random text) change nothing."""
    tok = target.tokenizer
    rng = np.random.default_rng(3)
    h = SuffixHistory(2000)
    b = h.bucket("k")
    for text in ("Hello there, the world", "the net is in the net is in the", "a b c"):
        b.add([int(x) for x in rng.integers(0, target.n_vocab, 40)], tok.tokenize(text))
    for text in ("Hello there, the world", "the net is in the net is in the", "a b c", "zzz"):
        prompt = tok.tokenize(text)
        plain, _ = run(target, prompt)
        d = SuffixDrafter()
        d.history = b
        for gamma in (1, 3, 6):
            assert run(target, prompt, d, gamma)[0] == plain, (text, gamma)
    assert b.hits > 0


def _history_drafter(t_model, tok, prompt, sampling):
    """A suffix drafter whose history holds answers to `prompt` starting with its likelier first tokens."""
    from edgerun.speculative.sampling import probs

    p1 = probs(t_model.forward(prompt, t_model.new_cache())[-1], sampling, prompt)
    top = [int(t) for t in np.argsort(-p1)[:3]]
    h = SuffixHistory(1000)
    b = h.bucket("k")
    for i, t in enumerate(top):
        b.add([t, top[(i + 1) % 3], top[(i + 2) % 3]], prompt)
    d = SuffixDrafter()
    d.history = b
    return d


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_history_drafts_keep_the_target_law(peaked, setting):
    t_model, _, tok = peaked
    sampling = SETTINGS[setting]
    target = ReferenceBackend(t_model, tokenizer=tok)
    prompt = tok.tokenize("Hello there")
    d = _history_drafter(t_model, tok, prompt, sampling)
    counts = sample_pairs(target, d, prompt, sampling, 1000, seed=5)
    assert d.history.hits > 500                                   # the history did draft...
    assert chisquare_pooled(counts, exact_pairs(t_model, prompt, sampling)) > P_PASS   # ...and the law holds


def _trusting(p, q, draft, rng, **kw):
    """Known wrong: every drafted token appended unverified (as if history were the target's own answer)."""
    return len(draft), as_dist(list(p)[len(draft)]).sample(rng)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_history_drafts_taken_unverified_fail(peaked, setting, monkeypatch):
    t_model, _, tok = peaked
    sampling = SETTINGS[setting]
    monkeypatch.setattr(gen, "verify", _trusting)
    target = ReferenceBackend(t_model, tokenizer=tok)
    prompt = tok.tokenize("Hello there")
    d = _history_drafter(t_model, tok, prompt, sampling)
    counts = sample_pairs(target, d, prompt, sampling, 1000, seed=5)
    assert chisquare_pooled(counts, exact_pairs(t_model, prompt, sampling)) < P_FAIL


# ---------------------------------------------------------------- the real server (SmolLM2-135M)

MODEL = "smollm2-135m-instruct"
KEYS = ("history-test-key-one", "history-test-key-two")
ASK = [{"role": "user", "content": "Write a short poem about the sea and the moon."}]


@pytest.fixture(scope="module")
def pulled():
    r = CliRunner().invoke(main, ["pull", MODEL])
    assert r.exit_code == 0, r.output


def _server(tmp_path, *extra):
    keyfile = tmp_path / "keys"
    keyfile.write_text("\n".join(KEYS) + "\n")
    srv = ServerProcess(["--model", MODEL, "--no-pull", "--draft", "suffix", "--gamma", "4", "--threads", "1",
                         "--ctx", "1024", "--api-key-file", keyfile, *extra], env=clean_env(cache_dir()))
    srv.wait_ready(timeout=300)
    return srv


def _ask(srv, key: str) -> tuple[str, int]:
    r = httpx.post(srv.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=300,
                   json={"model": MODEL, "messages": ASK, "max_tokens": 64, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["edgerun"]["n_accepted"]


def _history_metrics(srv) -> dict[str, float]:
    text = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"}).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("edgerun_suffix_history")}


@pytest.mark.real_model
@pytest.mark.parametrize("parallel", [1, 2])
def test_each_key_drafts_from_its_own_history_only(pulled, tmp_path, parallel):
    srv = _server(tmp_path, "--suffix-history", "20000", "--parallel", parallel)
    try:
        assert _history_metrics(srv) == {}                                   # nothing held before any answer
        a1, acc_a1 = _ask(srv, KEYS[0])
        a2, acc_a2 = _ask(srv, KEYS[0])
        m = _history_metrics(srv)
        assert a2 == a1 and acc_a2 > acc_a1, (acc_a1, acc_a2)               # the repeat is drafted from history
        assert m['edgerun_suffix_history_hits_total{key="1"}'] > 0
        b1, acc_b1 = _ask(srv, KEYS[1])
        m = _history_metrics(srv)
        assert b1 == a1 and acc_b1 == acc_a1, (acc_a1, acc_b1)              # key 2's first ask: as key 1's first
        assert m['edgerun_suffix_history_hits_total{key="2"}'] == 0         # no draft from key 1's answers
        assert 0 < m['edgerun_suffix_history_tokens{key="2"}'] < m['edgerun_suffix_history_tokens{key="1"}']
        b2, acc_b2 = _ask(srv, KEYS[1])
        m = _history_metrics(srv)
        assert b2 == a1 and acc_b2 == acc_a2, (acc_a2, acc_b2)              # its own repeat: as key 1's
        assert m['edgerun_suffix_history_hits_total{key="2"}'] > 0
        assert httpx.get(srv.url + "/v1/models").status_code == 401         # the keys are still required
        assert httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    finally:
        assert srv.terminate() == 0, srv.output


@pytest.mark.real_model
def test_with_the_setting_off_nothing_is_kept(pulled, tmp_path):
    srv = _server(tmp_path)
    try:
        a1, acc1 = _ask(srv, KEYS[0])
        a2, acc2 = _ask(srv, KEYS[0])
        assert a2 == a1 and acc2 == acc1, (acc1, acc2)                      # no history: the same drafts
        assert _history_metrics(srv) == {}                                   # and no store at all
    finally:
        assert srv.terminate() == 0, srv.output


# ---------------------------------------------------------------- the default drafter

def test_draft_auto_is_suffix_lookup_unless_a_model_is_paired(tmp_path):
    from edgerun.resolve import auto_draft

    assert auto_draft("smollm2-135m-instruct") == "suffix"               # no paired drafter
    assert auto_draft(str(tmp_path / "some.gguf")) == "suffix"           # a local file
    assert auto_draft("qwen2.5-coder-1.5b-instruct") == "qwen2.5-coder-0.5b-instruct"   # a pair keeps its model


def test_a_runtime_loaded_with_the_defaults_drafts_with_suffix_lookup(tiny_llama):
    from edgerun import load

    with load(str(tiny_llama), profile="generic-x86_64-cpu", n_ctx=256, n_threads=1) as rt:
        assert rt.draft_name == "suffix" and isinstance(rt.drafter, SuffixDrafter)
    with load(str(tiny_llama), draft="none", profile="generic-x86_64-cpu", n_ctx=256, n_threads=1) as rt:
        assert rt.drafter is None


def test_a_shadow_draft_from_history_is_not_counted_as_drafted():
    """A shadow (speculative/shadow.py) is the draft that was not made: it reads the history like a draft but adds
    nothing to the bucket's drafted and hit counts (/metrics); a real proposal does."""
    h = SuffixHistory(2000)
    b = h.bucket("k")
    answer = list(range(100, 160))
    b.add(answer, [1, 2, 3])
    d = SuffixDrafter()
    d.history = b
    ctx = [7, 8] + answer[:12]                        # the context ends in an earlier answer's first 12 tokens
    assert d.shadow_draft(ctx, 8) == answer[12:20]
    assert (b.hits, b.drafted) == (0, 0)
    draft, _ = d.propose(ctx, 8, SamplingArgs(temperature=0.0), np.random.default_rng(0))
    assert draft == answer[12:20] and (b.hits, b.drafted) == (1, 8)
