"""Suffix lookup and a model drafter as one drafter (speculative/combined.py): the tuner picks per cycle.

- The law: with both parts drafting (a policy that picks either offer at random), the joint law of two sampled
  tokens passes the chi-square test against the exact target law; the same loop appending drafts unverified
  fails it. Greedy output equals plain greedy whichever part drafts.
- The choice: on a CPU-like cost curve (4 positions cost ~3 steps, a model step 0.35 of the target's) the tuner
  keeps the model's classes off and drafts from suffix matches on copied text; on a flat curve (a GPU's) the model
  drafts where nothing matches. Suffix cycles price no model step and no catch-up.
- The wiring: `--draft auto` for a target with a paired model gives a SuffixOrModel; an explicit model name gives
  the model alone; its tuner state is stored apart from the model drafter's alone; slots get their own parts.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

import edgerun.generate as gen
from edgerun.backends.reference import ReferenceBackend
from edgerun.config import SamplingArgs
from edgerun.device.cost import CostCurve
from edgerun.generate import GenStats, generate
from edgerun.speculative.combined import SuffixOrModel, model_part
from edgerun.speculative.drafters import ModelDrafter
from edgerun.speculative.gamma import FixedGamma, GammaTuner
from edgerun.speculative.history import SuffixHistory
from edgerun.speculative.sampling import probs
from edgerun.speculative.suffix import SuffixDrafter
from test_spec_exact import SETTINGS, exact_pairs
from test_suffix_history import _trusting     # known wrong: every draft appended unverified
from test_verify import P_FAIL, P_PASS, chisquare_pooled

GREEDY = SamplingArgs(temperature=0.0)


class RandomPick(FixedGamma):
    """A fixed gamma that takes either of a drafter's offers at random, and counts what it took."""

    def __init__(self, gamma: int, seed: int = 0) -> None:
        super().__init__(gamma)
        self.rng = np.random.default_rng(seed)
        self.picked = {"suffix": 0, "model": 0}

    def pick(self, classes):
        c = classes[int(self.rng.integers(len(classes)))]
        self.picked["model" if c >= SuffixOrModel.free_classes else "suffix"] += 1
        return c


def _combined(t_model, d_model, tok, prompt, sampling) -> SuffixOrModel:
    """The noisy drafter model and a suffix part whose history holds answers starting with the target's likelier
    tokens (so that suffix drafts are offered from the first position on)."""
    target = ReferenceBackend(t_model, tokenizer=tok)
    p1 = probs(t_model.forward(prompt, t_model.new_cache())[-1], sampling, prompt)
    top = [int(t) for t in np.argsort(-p1)[:3]]
    bucket = SuffixHistory(1000).bucket("k")
    for i, t in enumerate(top):
        bucket.add([t, top[(i + 1) % 3], top[(i + 2) % 3]], prompt)
    suffix = SuffixDrafter()
    suffix.history = bucket
    return SuffixOrModel(ModelDrafter(ReferenceBackend(d_model, tokenizer=tok), target), suffix)


def _sample_pairs(target, drafter, policy, prompt, sampling, n, seed):
    rng = np.random.default_rng(seed)
    V = target.n_vocab
    cells = np.empty(n, dtype=np.int64)
    for s in range(n):
        toks = [st.token for st in generate(target, prompt, sampling, max_tokens=3, drafter=drafter, policy=policy,
                                            rng=rng, is_eog=lambda t: False)]
        cells[s] = toks[0] * V + toks[1]
    return np.bincount(cells, minlength=V * V)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_both_parts_drafting_keep_the_target_law(peaked, setting):
    t_model, d_model, tok = peaked
    sampling = SETTINGS[setting]
    prompt = tok.tokenize("Hello there")
    target = ReferenceBackend(t_model, tokenizer=tok)
    drafter = _combined(t_model, d_model, tok, prompt, sampling)
    policy = RandomPick(2, seed=1)
    counts = _sample_pairs(target, drafter, policy, prompt, sampling, 1000, seed=5)
    assert policy.picked["suffix"] > 300 and policy.picked["model"] > 300, policy.picked   # both parts drafted
    assert drafter.history.hits > 300
    assert chisquare_pooled(counts, exact_pairs(t_model, prompt, sampling)) > P_PASS


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_drafts_taken_unverified_fail(peaked, setting, monkeypatch):
    t_model, d_model, tok = peaked
    sampling = SETTINGS[setting]
    monkeypatch.setattr(gen, "verify", _trusting)
    prompt = tok.tokenize("Hello there")
    target = ReferenceBackend(t_model, tokenizer=tok)
    drafter = _combined(t_model, d_model, tok, prompt, sampling)
    counts = _sample_pairs(target, drafter, RandomPick(2, seed=1), prompt, sampling, 1000, seed=5)
    assert chisquare_pooled(counts, exact_pairs(t_model, prompt, sampling)) < P_FAIL


def _run(target, prompt, drafter=None, policy=None, max_tokens=40):
    stats = GenStats()
    toks = [s.token for s in generate(target, prompt, GREEDY, max_tokens=max_tokens, drafter=drafter,
                                      policy=policy if policy is not None else FixedGamma(0),
                                      rng=np.random.default_rng(0), stats=stats, is_eog=lambda t: False)]
    return toks, stats


@pytest.fixture(scope="module")
def pair(tiny_model_factory):
    target = ReferenceBackend(tiny_model_factory(arch="llama", wtype="f32", seed=0))
    noisy = ReferenceBackend(tiny_model_factory(arch="llama", wtype="f32", seed=1))
    return target, noisy


COPY = "the cat sat on the mat and the dog sat on the log; the cat sat on the mat and the dog sat on the log; the cat"


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_equals_plain_whichever_part_drafts(pair, gamma):
    target, noisy = pair
    for text in (COPY, "Hello there, the world"):
        prompt = target.tokenizer.tokenize(text)
        plain, _ = _run(target, prompt)
        d = SuffixOrModel(ModelDrafter(noisy, target))
        policy = RandomPick(gamma, seed=gamma)
        got, st = _run(target, prompt, d, policy)
        assert got == plain, (text, gamma)
        assert st.n_drafted > 0
    assert policy.picked["model"] > 0


def _curve(ratios: list[float], t1: float, draft_ratio: float) -> CostCurve:
    return CostCurve(t_verify=tuple(r * t1 for r in ratios), t_draft=draft_ratio * t1, source="measured")


CPU = [1.0, 1.6, 2.2, 3.0, 3.6, 4.2, 4.9, 5.6, 6.3, 7.0]      # verifying n positions on 2 cores (docs/speculative.md)
FLAT = [1.0, 1.01, 1.02, 1.03, 1.05, 1.07, 1.09, 1.11, 1.13, 1.15]


def test_suffix_classes_cost_no_draft_time_and_no_catch_up():
    t = GammaTuner(_curve(CPU, 0.03, 0.35), gamma_max=8, n_classes=10, free_classes=6)
    assert t.draft_cost(0) == 0.0 and t.draft_cost(5) == 0.0 and t.draft_cost(6) == pytest.approx(0.35 * 0.03)
    # at equal (prior) acceptance a suffix draft is predicted faster than a model draft at every gamma, and a
    # tie at gamma 0 (neither pays yet) goes to the suffix match
    assert (t.rates(0)[1:] > t.rates(6)[1:]).all() and t.rates(0)[0] == t.rates(6)[0]
    assert t.pick((0, 6)) == 0
    # the catch-up of a model that sat out many cycles is not priced into a suffix class
    t.choose(0, lag=500)
    assert t._lag == 0
    t.choose(7, lag=500)
    assert t._lag == 500
    # a model-free cycle's near-zero draft time teaches nothing about the model's step
    t.choose(2, lag=0)
    before = t.t_draft()
    for _ in range(20):
        t.choose(2)
        t.observe(3, 3, 1e-6, 0.08)
    assert t.t_draft() == before
    with pytest.raises(Exception):
        GammaTuner(_curve(CPU, 0.03, 0.35), gamma_max=8, n_classes=4, free_classes=6)


def test_on_a_cpu_curve_copied_text_drafts_from_suffix_and_the_model_stays_off(pair):
    target, noisy = pair
    prompt = target.tokenizer.tokenize(COPY * 3)
    # a model step 0.6 of the target's: on this curve no model draft can pay even if every one is accepted
    tuner = GammaTuner(_curve(CPU, 0.03, 0.6), gamma_max=8, n_classes=10, free_classes=6)
    assert not tuner._could_win(1.0, 6) and tuner._could_win(0.8, 0)
    tuner._learn_times = lambda *a, **kw: None      # the curve stays the CPU's (the tiny model's real times are flat)
    d = SuffixOrModel(ModelDrafter(noisy, target))
    picked = {"suffix": 0, "model": 0}
    real_pick = tuner.pick

    def counting(classes):
        c = real_pick(classes)
        picked["model" if c >= 6 else "suffix"] += 1
        return c

    tuner.pick = counting
    model_calls = []
    real_propose = d.model.propose
    d.model.propose = lambda *a, **kw: model_calls.append(1) or real_propose(*a, **kw)
    plain, _ = _run(target, prompt, max_tokens=60)
    got, st = _run(target, prompt, d, tuner, max_tokens=60)
    assert got == plain
    assert picked["suffix"] > picked["model"], picked
    assert st.n_accepted > 0   # suffix drafts were made and kept...
    assert not model_calls and max(tuner.gammas()[6:]) == 0     # ...and the model, which cannot pay here, never drafted


def test_on_a_flat_curve_the_model_drafts_where_nothing_matches():
    tuner = GammaTuner(_curve(FLAT, 0.03, 0.05), gamma_max=8, n_classes=10, free_classes=6)
    # at the prior both could pay; a model class that has learned high acceptance beats a short-match class
    for _ in range(40):
        tuner.choose(8)
        tuner.observe(4, 4, 4 * 0.0015, 0.031)
        tuner.choose(0)
        tuner.observe(2, 0, 0.0, 0.0303)
    assert tuner.gammas()[8] > 0
    assert tuner.pick((0, 8)) == 8
    # and a long verbatim match whose drafts are all accepted beats it
    for _ in range(40):
        tuner.choose(5)
        tuner.observe(8, 8, 0.0, 0.0339)
    assert tuner.pick((5, 8)) == 5


def test_a_slot_copy_has_its_own_parts(pair):
    target, noisy = pair
    d = SuffixOrModel(ModelDrafter(noisy, target))
    c = copy.copy(d)
    assert c.suffix is not d.suffix and c.model is not d.model and model_part(c) is c.model
    assert c.name == d.name and c.n_classes == 12 and c.free_classes == 8
    assert model_part(SuffixDrafter()) is None


def test_draft_auto_with_a_paired_model_is_suffix_or_model(tiny_llama, tmp_path, monkeypatch):
    """`--draft auto` for a target whose resolution finds a paired model wraps it with suffix lookup; an explicit
    model name drafts with the model alone; the two tuners' stored states are apart."""
    from edgerun import load
    from edgerun.speculative.tuner_store import TunerStore

    monkeypatch.setenv("EDGERUN_HOME", str(tmp_path))
    import edgerun.resolve as resolve

    monkeypatch.setattr(resolve, "auto_draft", lambda model: str(tiny_llama))     # a pair: the same file
    with load(tiny_llama, draft="auto", n_ctx=256, n_threads=1) as rt:
        assert isinstance(rt.drafter, SuffixOrModel)
        assert rt.policy.free_classes == 8 and rt.policy.n_classes == 12
        combined_key = rt.tuner_store.key if rt.tuner_store else None
        out = rt.generate("the cat sat on the mat, the cat sat on the", max_tokens=8)
        assert isinstance(out.text, str)
    with load(tiny_llama, draft=str(tiny_llama), n_ctx=256, n_threads=1) as rt:
        assert isinstance(rt.drafter, ModelDrafter)
        assert rt.policy.free_classes == 0
        alone_key = rt.tuner_store.key if rt.tuner_store else None
    assert combined_key is None or combined_key != alone_key
    assert TunerStore.keyed("t", "d", combined=True).key != TunerStore.keyed("t", "d").key


def test_free_classes_may_draft_longer_than_a_models():
    """Suffix drafts of a long verbatim match may reach free_gamma_max (48); a model's stay within gamma_max (8)."""
    from edgerun.config import SpeculativeArgs

    assert SpeculativeArgs().limits(None, True) == (48, 8)
    assert SpeculativeArgs().limits(None, False) == (8, 8)
    assert SpeculativeArgs(gamma_max=4, free_gamma_max=12).limits(None, True) == (12, 4)
    # a curve whose cost per position falls with n (batched verification: matrix-matrix work), as a CPU's does
    long_curve = [1.0, 1.6, 2.2, 3.0, 3.4, 3.8, 4.2, 4.6, 5.0] + [5.0 + 0.25 * k for k in range(1, 17)]
    t = GammaTuner(_curve(long_curve, 0.03, 0.35), gamma_max=24, n_classes=10, free_classes=6, model_gamma_max=8)
    assert t.cap(5) == 24 and t.cap(8) == 8
    assert (t.rates(8)[9:] == 0).all() and (t.rates(5)[9:] > 0).all()
    t._learn_times = lambda *a, **kw: None
    for _ in range(60):                         # a 17+ match whose drafts are all accepted
        g = t.choose(5)
        t.observe(g, g, 0.0, 0.0)
    assert t.gammas()[5] > 8
    for _ in range(60):                         # a model whose drafts are all accepted: still at most 8
        g = t.choose(9)
        assert g <= 8
        t.observe(g, g, g * 0.35 * 0.03, 0.0)
    assert t.gammas()[9] <= 8


def test_long_drafts_are_earned_within_a_generation(pair):
    """A tuner that would draft 24 from the first cycle is held to 8 until drafts are kept whole, then the cap
    doubles; after a rejection it falls back. The lowered cycles are no supply misses, and greedy stays plain's."""
    import edgerun.generate as g

    target, _ = pair
    prompt = target.tokenizer.tokenize(COPY * 4)
    long_curve = [1.0] + [1.0 + 0.05 * k for k in range(1, 25)]          # a flat curve: 24 always pays
    tuner = GammaTuner(_curve(long_curve, 0.03, 0.0), gamma_max=24, n_classes=6, free_classes=6)
    tuner._learn_times = lambda *a, **kw: None
    for _ in range(40):                            # taught elsewhere: every draft of a long match accepted
        for c in range(6):
            x = tuner.choose(c)
            tuner.observe(x, x, 0.0, 0.0)
    assert min(tuner.gammas()) > 8
    plain, _ = _run(target, prompt, max_tokens=120)
    sizes = []
    real_propose = SuffixDrafter.propose

    def spy(self, context, gamma, *a, **kw):
        sizes.append(gamma)
        return real_propose(self, context, gamma, *a, **kw)

    SuffixDrafter.propose = spy
    try:
        got, st = _run(target, prompt, SuffixDrafter(), tuner, max_tokens=120)
    finally:
        SuffixDrafter.propose = real_propose
    assert got == plain
    assert sizes[0] <= g.EARNED_START < max(sizes), sizes     # started within the cap, earned longer drafts
    # the caps taught no supply misses (one lowered cycle each would be); the text itself may run out once
    assert (tuner._asked[5] - tuner._got[5]).sum() <= 1.0 + 1e-9


@pytest.mark.parametrize("gamma", [3, "auto"])
def test_slots_of_a_batching_context_each_get_their_own_parts(tiny_llama, monkeypatch, tmp_path, gamma):
    """`--parallel 4` with `--draft auto` and a paired model: each slot's SuffixOrModel holds its own suffix
    automaton and a model drafter on its own sequence of the drafter's context; four concurrent greedy generations
    each give the text they give alone."""
    import edgerun.resolve as resolve
    from test_batching import PROMPTS, _load, _texts_alone_and_batched

    monkeypatch.setenv("EDGERUN_HOME", str(tmp_path))
    monkeypatch.setattr(resolve, "auto_draft", lambda model: str(tiny_llama))
    with _load(tiny_llama, 4, draft="auto", gamma=gamma) as rt:
        assert isinstance(rt.drafter, SuffixOrModel)
        alone, batched, group = _texts_alone_and_batched(rt, PROMPTS, max_tokens=24, temperature=0)
    assert batched == alone


def test_a_seeded_sampled_run_decodes_plainly_unless_gamma_is_fixed(tiny_llama, tmp_path, monkeypatch):
    """Same seed, same text: the tuner's learned (persisted, timed) choices would decide which random numbers each
    position draws, so a seeded sampled run does not speculate unless a fixed gamma is asked for."""
    from edgerun import load
    from edgerun.speculative.gamma import FixedGamma

    monkeypatch.setenv("EDGERUN_HOME", str(tmp_path))
    with load(tiny_llama, draft="suffix", n_ctx=256, n_threads=1) as rt:
        assert isinstance(rt.policy, GammaTuner)
        seeded = rt.sampling_args(temperature=0.9, seed=3)
        assert rt._policy_for(None, seeded).__class__ is FixedGamma and rt._policy_for(None, seeded).gamma == 0
        assert rt._policy_for(4, seeded).gamma == 4
        assert rt._policy_for(None, rt.sampling_args(temperature=0.9)) is not None
        assert isinstance(rt._policy_for(None, rt.sampling_args(temperature=0.9)), GammaTuner)
        assert isinstance(rt._policy_for(None, rt.sampling_args(temperature=0.0, seed=3)), GammaTuner)
        texts = {rt.generate(COPY, max_tokens=24, temperature=0.9, seed=3).text for _ in range(3)}
        assert len(texts) == 1


def test_a_new_generation_weighs_what_free_classes_learned_on_other_texts_less():
    """On a steep curve (a 1.5B target on 2 CPU threads: each verified position costs ~0.8 of a step), a free
    class taught on a file copied whole drafts long; in a new generation (a short answer quoting a document),
    begin_generation() leaves its estimate but the weight of 16 positions, so the first rejected draft turns
    it down. Without it (the known-wrong variant) the class keeps drafting 22 into every rejection."""
    steep = [1.0 + 0.8 * k for k in range(25)]
    tuner = GammaTuner(_curve(steep, 0.033, 0.0), gamma_max=24, n_classes=6, free_classes=6)
    for _ in range(200):                           # the code edit: every draft of a long match accepted
        x = tuner.choose(5)
        tuner.observe(x, x, 0.0, 0.033 * steep[x])
    assert tuner.choose(5) > 16

    def quoting(t):       # each draft kept for its first 2 positions, then rejected
        out = []
        for _ in range(6):
            x = t.choose(5)
            out.append(x)
            t.observe(x, min(x, 2), 0.0, 0.033 * steep[x])
        return out

    stale = quoting(copy.deepcopy(tuner))
    rate = tuner._acc[5].sum() / tuner._seen[5].sum()
    tuner.begin_generation()
    assert abs(tuner._seen[5].sum() - 16.0) < 1e-9 and abs(tuner._acc[5].sum() / 16.0 - rate) < 1e-12
    fresh = quoting(tuner)
    assert max(fresh[1:]) <= 4 and min(stale) > 16, (fresh, stale)


# Qwen-1.5B Q4_K_M on 2 CPU threads, T(n)/T(1) for n = 1..49 as edgerun's cost probe measured it (a steep curve:
# no draft pays below ~90% acceptance)
QWEN_CPU = [1.0, 1.84, 2.52, 3.07, 3.74, 4.41, 5.06, 6.92, 7.26, 7.72, 8.14, 8.55, 8.55, 8.53, 8.52, 8.51, 9.02, 9.53,
            10.04, 10.55, 10.97, 11.4, 11.82, 12.07, 12.53, 12.98, 13.42, 13.81, 13.69, 13.57, 13.45, 13.34, 13.91,
            14.48, 15.02, 15.57, 16.11, 16.66, 17.21, 17.75, 18.07, 18.39, 18.71, 19.03, 19.34, 19.66, 19.98, 20.3,
            20.62]


@pytest.mark.parametrize("prior", [True, False])
def test_a_long_match_drafts_from_its_first_cycle_on_a_steep_curve(prior):
    """The suffix classes' prior acceptance (copying.MATCH_PRIOR): a fresh tuner on a steep CPU curve drafts long
    in the 17+ class from its first cycles and nothing after a 1-token match. The known-wrong variant, one pooled
    prior for every class (0.6, at which no draft pays here), decodes a file copied whole plain until an
    exploration every ~85 cycles has taught the class (measured on Qwen: the first 85 cycles of a 900-token code
    edit plain)."""
    t = GammaTuner(_curve(QWEN_CPU, 0.06, 0.0), gamma_max=48, n_classes=SuffixDrafter.n_classes,
                   free_classes=SuffixDrafter.free_classes, class_prior=SuffixDrafter.class_prior if prior else None)
    t._learn_times = lambda *a, **kw: None
    first = []
    for _ in range(40):                       # a file copied whole: every draft of the 17+ match accepted
        g = t.choose(5)
        first.append(g)
        t.observe(g, g, 0.0, 0.06 * QWEN_CPU[g])
    if prior:
        assert min(first[:3]) > 8 and t.choose(0) == 0, first
    else:
        assert max(first) == 0, first


@pytest.mark.parametrize("shadow", [True, False])
def test_shadow_drafts_teach_a_class_kept_off(shadow):
    """A class kept off still has its draft made (free) and compared with the tokens decoded plain after it
    (speculative/shadow.py): a file copied whole teaches the 17+ class its acceptance within a few cycles, and the
    tuner turns it on. The known-wrong variant (no shadow) keeps the class off: with one pooled prior (0.6) nothing
    pays on this curve, and its next exploration is ~85 cycles away."""
    from edgerun.speculative.shadow import Shadow
    t = GammaTuner(_curve(QWEN_CPU, 0.06, 0.0), gamma_max=48, n_classes=SuffixDrafter.n_classes,
                   free_classes=SuffixDrafter.free_classes)                          # no class priors
    t._learn_times = lambda *a, **kw: None
    d, sh = SuffixDrafter(), Shadow(t if shadow else None)
    src = [int(x) for x in np.random.default_rng(0).integers(10, 5000, 400)]
    ctx = [1] + src + [2] + src[:20]
    gammas = []
    for i in range(20, 60):                   # plain cycles while off: the target's tokens go on copying the file
        c = d.hint(ctx)
        g = t.choose(c)
        sh.step(d, ctx, c, g)
        gammas.append(g)
        if g:
            break
        t.observe(0, 0, 0.0, 0.06)
        ctx.append(src[i])
    if shadow:
        assert gammas[-1] > 8 and len(gammas) < 12, gammas
        assert t._seen[5].sum() > 0 and t._acc[5].sum() == t._seen[5].sum()       # all it saw agreed
    else:
        assert max(gammas) == 0 and t._seen[5].sum() == 0


def test_a_shadow_counts_what_agreed_up_to_the_first_difference():
    from edgerun.speculative.shadow import Shadow
    t = GammaTuner(_curve(QWEN_CPU, 0.06, 0.0), gamma_max=48, n_classes=8, free_classes=8)

    class Copy:            # a free drafter that always drafts 10, 11, ..., 19
        def shadow_draft(self, context, gamma):
            return list(range(10, 20))[:gamma]

    sh = Shadow(t)
    ctx = [1, 2, 3]
    sh.step(Copy(), ctx, 6, 0)                     # class 6 off: a shadow opens
    assert 6 in sh.open
    ctx += [10, 11, 12]
    sh.step(Copy(), ctx, 0, 0)                     # 3 agree so far: counted, still open
    assert 6 in sh.open and t._acc[6].sum() == 3 and t._seen[6].sum() == 3
    ctx += [13, 99]
    sh.step(Copy(), ctx, 0, 0)                     # the 5th differs: 4 accepted, the 5th rejected
    assert 6 not in sh.open
    assert t._acc[6, :6].round(6).tolist() == [1, 1, 1, 1, 0, 0] and t._seen[6, :6].round(6).tolist() == [1] * 5 + [0]
    sh.step(Copy(), ctx, 7, 0)                     # class 7 opens one; then drafts for real
    ctx += [10, 11]
    sh.step(Copy(), ctx, 7, 5)                     # closed at what agreed (2), the rest unobserved
    assert 7 not in sh.open and t._acc[7].sum() == 2 and t._seen[7].sum() == 2


def test_what_free_classes_learn_does_not_lift_a_model_class_untried():
    """Free classes (copies of the text) and a model's classes are pooled apart: a file copied whole, taught to the
    suffix classes by shadows, leaves an untried model class at the prior. Pooled together (the known-wrong
    variant, measured in a server: the model then drafted at 0.7 at half plain speed) it rose to ~0.9."""
    t = GammaTuner(_curve(QWEN_CPU, 0.06, 0.3), gamma_max=48, n_classes=12, free_classes=8, model_gamma_max=8)
    for _ in range(40):
        t.shadow(5, 0, 48, False)
    assert t.acceptance(5)[0] > 0.95
    assert abs(t.acceptance(9)[0] - t.settings.alpha_prior) < 1e-9
