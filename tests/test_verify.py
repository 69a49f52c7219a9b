"""The rejection sampler (edgerun/speculative/verify.py): greedy behaviour, edge cases, and a chi-square
proof that speculative sampling reproduces the target distribution (and that a wrong residual fails).

The statistical part simulates whole generations of 3 tokens with a target and a drafter that are
Markov chains over a small vocabulary (p(next | previous token)), several speculative cycles each,
so the bonus token, rejections at every position and the hand-over between cycles are all covered.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from edgerun.config import SamplingArgs
from edgerun.errors import InvalidArgument
from edgerun.speculative.sampling import Dist, greedy_token, probs, sample
from edgerun.speculative.verify import residual, verify, verify_greedy

P_PASS = 1e-3    # a correct sampler must not be rejected at this level (fixed seeds: deterministic)
P_FAIL = 1e-6    # a wrong sampler must be rejected at least this clearly


def chisquare_pooled(counts: np.ndarray, expected_p: np.ndarray, min_expected: float = 5.0) -> float:
    """Chi-square goodness-of-fit p-value; cells expecting < min_expected samples are pooled into one."""
    n = counts.sum()
    exp = expected_p * n
    small = exp < min_expected
    obs_c = np.append(counts[~small], counts[small].sum())
    exp_c = np.append(exp[~small], exp[small].sum())
    if exp_c[-1] == 0:                       # nothing pooled: drop the empty cell
        assert obs_c[-1] == 0, "a sample fell on a cell of probability 0"
        obs_c, exp_c = obs_c[:-1], exp_c[:-1]
    exp_c = exp_c * (obs_c.sum() / exp_c.sum())   # exact total (float rounding of the table)
    return float(stats.chisquare(obs_c, exp_c).pvalue)


def wrong_residual(p_i, q_i, x):
    """The classic bug: resample from the target instead of norm(max(0, p - q))."""
    return Dist(p_i.idx, p_i.w / p_i.w.sum(), p_i.V)


def one_hot(i: int, V: int) -> np.ndarray:
    r = np.zeros(V)
    r[i] = 1.0
    return r


# ---------------------------------------------------------------- deterministic behaviour

def test_greedy_accepts_while_argmax_matches():
    rng = np.random.default_rng(0)
    V = 11
    for _ in range(300):
        g = int(rng.integers(0, 7))
        target = rng.integers(0, V, size=g + 1)
        draft = [int(t) if rng.random() < 0.7 else int(rng.integers(0, V)) for t in target[:g]]
        p = np.stack([one_hot(t, V) for t in target])             # [g+1, V]
        q = np.array([one_hot(t, V) for t in draft]).reshape(g, V)  # [g, V]
        expect_n = next((i for i in range(g) if draft[i] != target[i]), g)
        for qq in (q, None):
            n, nxt = verify(p, qq, draft, rng)
            assert (n, nxt) == (expect_n, int(target[expect_n]))


def test_greedy_fast_path_equals_verify_on_one_hot_rows():
    """The decode loop's greedy branch (argmax per position, no probability vectors) decides exactly
    as verify() does on the one-hot rows probs() builds for greedy sampling, repetition penalty on."""
    rng = np.random.default_rng(0)
    greedy = SamplingArgs(temperature=0.0, repeat_penalty=1.3, repeat_last_n=8)
    for _ in range(300):
        V, g = 12, int(rng.integers(0, 6))
        logits = rng.normal(size=(g + 1, V)).astype(np.float32)
        context = rng.integers(0, V, size=10).tolist()
        tgt = [greedy_token(logits[i], greedy, context) for i in range(g + 1)]
        # drafts that follow the target's argmax for a while, then (maybe) stray
        k = int(rng.integers(0, g + 1))
        draft = tgt[:k] + rng.integers(0, V, size=g - k).tolist()
        p = np.stack([probs(logits[i], greedy, context) for i in range(g + 1)])
        assert verify_greedy(tgt, draft) == verify(p, None, draft, np.random.default_rng(1))
    with pytest.raises(InvalidArgument):
        verify_greedy([1, 2], [1, 2])


def test_point_mass_equals_explicit_one_hot_q():
    V, g = 7, 4
    base = np.random.default_rng(1)
    for trial in range(200):
        p = base.dirichlet(np.ones(V) * 0.5, size=g + 1)
        draft = [int(x) for x in base.integers(0, V, size=g)]
        q = np.stack([one_hot(x, V) for x in draft])
        a = verify(p, None, draft, np.random.default_rng(trial))
        b = verify(p, q, draft, np.random.default_rng(trial))
        assert a == b


def test_identical_p_and_q_accept_everything():
    rng = np.random.default_rng(2)
    V, g = 50, 8
    for _ in range(50):
        q = rng.dirichlet(np.ones(V), size=g)
        p = np.vstack([q, rng.dirichlet(np.ones(V))])
        draft = [sample(row, rng) for row in q]
        n, _ = verify(p, q, draft, rng)
        assert n == g


def test_zero_target_probability_is_never_accepted():
    rng = np.random.default_rng(3)
    p = np.array([[0.0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]])
    q = np.array([[1.0, 0.0, 0.0]])
    for _ in range(100):
        n, nxt = verify(p, q, [0], rng)
        assert n == 0 and nxt in (1, 2)


def test_residual_without_mass_falls_back_to_p():
    p = np.array([0.25, 0.25, 0.5])
    r = residual(p, p * (1 + 1e-15), 2)
    np.testing.assert_allclose(r.dense(), p)
    r = residual(np.array([0.0, 0.0, 1.0]), None, 2)      # point mass on the only token p allows
    np.testing.assert_allclose(r.dense(), [0.0, 0.0, 1.0])
    np.testing.assert_allclose(residual(np.array([0.5, 0.5, 0.0]), np.array([0.9, 0.1, 0.0]), 0).dense(), [0, 1, 0])


@pytest.mark.parametrize("p_shape,q_shape,draft", [
    ((3, 5), (2, 5), [1]),          # p rows != len(draft) + 1
    ((2, 5), (1, 4), [1]),          # q width != p width
    ((2, 5), (2, 5), [1]),          # q rows != len(draft)
    ((2, 5), None, [5]),            # token outside the vocabulary
    ((5,), None, []),               # p not 2-D
])
def test_bad_shapes_are_refused(p_shape, q_shape, draft):
    p = np.full(p_shape, 1.0 / p_shape[-1])
    q = None if q_shape is None else np.full(q_shape, 1.0 / q_shape[-1])
    with pytest.raises(InvalidArgument):
        verify(p, q, draft, np.random.default_rng(0))


def test_first_acceptance_rate_is_sum_of_min():
    """P(first draft kept) = sum_x min(p(x), q(x)) (Leviathan et al., definition of alpha)."""
    rng = np.random.default_rng(4)
    V = 6
    p = rng.dirichlet(np.ones(V), size=2)
    q = rng.dirichlet(np.ones(V), size=1)
    alpha = float(np.minimum(p[0], q[0]).sum())
    N = 4000
    kept = sum(verify(p, q, [sample(q[0], rng)], rng)[0] for _ in range(N))
    assert stats.binomtest(kept, N, alpha).pvalue > P_PASS


# ---------------------------------------------------------------- statistical exactness

def markov_tables(V: int, sampling: SamplingArgs, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Target and drafter next-token tables [V(prev), V(next)] after the sampling transforms."""
    rng = np.random.default_rng(seed)
    t_logits = rng.normal(0, 1.5, size=(V, V))
    d_logits = t_logits + rng.normal(0, 1.5, size=(V, V))    # a related but clearly different drafter
    T = np.stack([probs(row, sampling) for row in t_logits])
    D = np.stack([probs(row, sampling) for row in d_logits])
    return T, D


def simulate(T, D, gamma, n_tokens, n_samples, rng, resample=residual, drafter="model"):
    """Speculative generations of n_tokens from start token 0; returns their joint cell indices."""
    V = T.shape[0]
    cells = np.empty(n_samples, dtype=np.int64)
    for s in range(n_samples):
        out = []
        last = 0
        while len(out) < n_tokens:
            draft, q_rows, prev = [], [], last
            for _ in range(gamma):
                if drafter == "model":
                    x = sample(D[prev], rng)
                    q_rows.append(D[prev])
                else:                          # a deterministic (point-mass) drafter
                    x = int(np.argmax(D[prev]))
                draft.append(x)
                prev = x
            ctx = [last] + draft
            p = T[ctx]                                          # [gamma+1, V]
            q = np.stack(q_rows) if drafter == "model" else None  # [gamma, V]
            n, nxt = verify(p, q, draft, rng, resample=resample)
            out += draft[:n] + [nxt]
            last = out[-1]
        idx = 0
        for t in out[:n_tokens]:
            idx = idx * V + t
        cells[s] = idx
    return cells


def exact_joint(T: np.ndarray, n_tokens: int) -> np.ndarray:
    """P(t1..tn | start 0) flattened like simulate()'s cells."""
    joint = T[0]
    for _ in range(n_tokens - 1):
        # joint [V^k] x T[last of each cell] -> [V^k, V] -> [V^(k+1)]
        joint = (joint[:, None] * T[np.arange(joint.size) % T.shape[0]]).reshape(-1)
    return joint


SETTINGS = {
    "t1": SamplingArgs(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    "t0.7-top_p0.9": SamplingArgs(temperature=0.7, top_k=0, top_p=0.9, min_p=0.0),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("drafter", ["model", "point-mass"])
def test_speculative_sampling_reproduces_target(setting, drafter):
    V, n_tokens, N = 4, 3, 3000
    T, D = markov_tables(V, SETTINGS[setting], seed=10)
    cells = simulate(T, D, gamma=3, n_tokens=n_tokens, n_samples=N, rng=np.random.default_rng(11),
                     drafter=drafter)
    counts = np.bincount(cells, minlength=V ** n_tokens)
    assert chisquare_pooled(counts, exact_joint(T, n_tokens)) > P_PASS


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_wrong_residual_is_caught(setting):
    V, n_tokens, N = 4, 3, 3000
    T, D = markov_tables(V, SETTINGS[setting], seed=10)
    cells = simulate(T, D, gamma=3, n_tokens=n_tokens, n_samples=N, rng=np.random.default_rng(11),
                     resample=wrong_residual)
    counts = np.bincount(cells, minlength=V ** n_tokens)
    assert chisquare_pooled(counts, exact_joint(T, n_tokens)) < P_FAIL
