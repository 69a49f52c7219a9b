"""Sampling transforms: each one against a hand computation on a small vocabulary."""

import numpy as np
import pytest

from edgerun.config import SamplingArgs
from edgerun.errors import InvalidArgument
from edgerun.speculative.sampling import Dist, apply_repeat_penalty, dist, probs, sample

LOGITS = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05]))  # softmax at T=1 gives these probabilities


def sa(**kw):
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
    base.update(kw)
    return SamplingArgs(**base)


def test_plain_softmax():
    np.testing.assert_allclose(probs(LOGITS, sa()), [0.5, 0.2, 0.15, 0.1, 0.05], rtol=1e-12)


def test_greedy_is_one_hot_at_argmax():
    p = probs(LOGITS, sa(temperature=0))
    assert p.tolist() == [1.0, 0, 0, 0, 0]


def test_temperature_sharpens():
    p = probs(LOGITS, sa(temperature=0.5))
    w = np.array([0.5, 0.2, 0.15, 0.1, 0.05]) ** 2
    np.testing.assert_allclose(p, w / w.sum(), rtol=1e-12)


def test_top_k():
    p = probs(LOGITS, sa(top_k=2))
    np.testing.assert_allclose(p, [5 / 7, 2 / 7, 0, 0, 0], rtol=1e-12)


def test_top_p_keeps_smallest_prefix_reaching_mass():
    p = probs(LOGITS, sa(top_p=0.8))          # 0.5 + 0.2 = 0.7 < 0.8 -> need the third token too
    np.testing.assert_allclose(p, [0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0], rtol=1e-12)
    p = probs(LOGITS, sa(top_p=0.7))          # exactly reached by two tokens
    assert np.count_nonzero(p) == 2


def test_min_p():
    p = probs(LOGITS, sa(min_p=0.25))         # keep p >= 0.125: 0.5, 0.2, 0.15
    np.testing.assert_allclose(p, [0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0], rtol=1e-12)


def test_repeat_penalty_divides_positive_multiplies_negative():
    logits = np.array([2.0, -1.0, 0.5])
    out = apply_repeat_penalty(logits, [0, 1], sa(repeat_penalty=2.0))
    assert out.tolist() == [1.0, -2.0, 0.5]
    assert apply_repeat_penalty(logits, [0], sa()) is logits   # disabled: untouched


def test_sample_follows_distribution():
    rng = np.random.default_rng(0)
    p = np.array([0.1, 0.0, 0.6, 0.3])
    draws = np.bincount([sample(p, rng) for _ in range(20000)], minlength=4) / 20000
    assert draws[1] == 0
    np.testing.assert_allclose(draws, p, atol=0.015)


@pytest.mark.parametrize("kw", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                                dict(min_p=1.0), dict(repeat_penalty=0), dict(temperature=float("nan"))])
def test_invalid_values_are_refused(kw):
    with pytest.raises(InvalidArgument):
        SamplingArgs(**kw)


# --- issue 20, defects 4, 6, 8: inputs that used to crash or sample garbage -------------------------

@pytest.mark.parametrize("t", [5e-324, 1e-310, 1e-5])
def test_subnormal_and_tiny_temperatures_sample_the_greedy_token(t):
    from edgerun.config import SamplingArgs

    logits = np.array([1.0, 3.0, 2.0, -1.0], dtype=np.float32)
    s = SamplingArgs(temperature=t, top_k=0, top_p=1.0, min_p=0.0)
    assert s.greedy
    p = probs(logits, s)
    assert np.isfinite(p).all() and p.argmax() == 1 and p[1] == 1.0


def test_the_sampler_never_samples_from_a_non_finite_distribution(caplog):
    from edgerun.config import SamplingArgs

    logits = np.array([0.0, np.inf, 1.0], dtype=np.float32)          # a backend gone wrong
    p = probs(logits, SamplingArgs(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0))
    assert np.isfinite(p).all() and p.sum() == 1.0 and p.argmax() == 1
    assert "non-finite" in caplog.text


@pytest.mark.parametrize("kw, needle", [
    (dict(repeat_penalty=1e-308), "repeat_penalty"), (dict(repeat_penalty=1e308), "repeat_penalty"),
    (dict(seed=-1), "seed"), (dict(seed=2 ** 64), "seed"),
])
def test_sampling_values_that_overflow_are_refused(kw, needle):
    from edgerun.config import SamplingArgs
    from edgerun.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match=needle):
        SamplingArgs(**kw)


def test_thread_counts_are_bounded():
    import os

    from edgerun.config import BackendArgs
    from edgerun.errors import InvalidArgument

    BackendArgs(n_threads=os.cpu_count())
    with pytest.raises(InvalidArgument, match="n_threads must be an integer in 1.."):
        BackendArgs(n_threads=100000)


@pytest.mark.parametrize("argv, needle", [
    (["--seed", "-1"], "seed must be"), (["--threads", "100000"], "n_threads must be"),
    (["--repeat-penalty", "1e-308"], "repeat_penalty must be"),
])
def test_cli_refuses_them_with_one_line(tiny_llama, argv, needle):
    from click.testing import CliRunner

    from edgerun.cli import main

    r = CliRunner().invoke(main, ["generate", "hello", "--model", str(tiny_llama), "-n", "2", *argv])
    assert r.exit_code == 2 and r.output.startswith("error: ") and needle in r.output, r.output
    assert "Traceback" not in r.output


# --- the sparse distribution (issue 21: no vocabulary-sized arrays per position) ---------------------

def _dense_reference(x, s):
    """The transforms written densely: sort the whole vocabulary, keep the top k, temperature, top-p, min-p."""
    order = np.argsort(-x, kind="stable")[: s.top_k or len(x)]
    z = x[order] / s.temperature
    w = np.exp(z - z.max())
    w /= w.sum()
    n_keep = int(np.searchsorted(np.cumsum(w), s.top_p, side="left")) + 1 if s.top_p < 1 else len(w)
    keep = np.arange(len(w)) < n_keep
    keep &= w >= s.min_p * w.max()
    out = np.zeros(len(x))
    out[order[keep]] = w[keep] / w[keep].sum()
    return out


@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0])     # 0.05: a flat row (the whole vocabulary is in the window)
def test_sparse_dist_equals_the_dense_transforms(scale):
    rng = np.random.default_rng(7)
    for trial in range(20):
        V = int(rng.integers(50, 20000))
        x = (rng.standard_normal(V) * scale * (1 + 30 * (trial % 3 == 0))).astype(np.float32)
        if trial % 4 == 1:                      # a grammar mask: most of the row -inf
            x[rng.random(V) < rng.choice([0.5, 0.99])] = -np.inf
            x[int(rng.integers(V))] = 1.0
        s = SamplingArgs(temperature=float(rng.uniform(0.3, 1.5)), top_k=int(rng.choice([0, 1, 5, 40, 300])),
                         top_p=float(rng.choice([1.0, 0.9, 0.5])), min_p=float(rng.choice([0.0, 0.05])))
        d = dist(x, s)
        assert np.all(np.diff(d.idx) > 0) and d.V == V and np.isclose(d.w.sum(), 1.0)
        np.testing.assert_allclose(d.dense(), _dense_reference(x.astype(np.float64), s), rtol=1e-9, atol=1e-15)
        # the same uniform draws the same token from the sparse and the dense form
        assert [d.sample(np.random.default_rng(i)) for i in range(30)] == \
            [sample(d.dense(), np.random.default_rng(i)) for i in range(30)]


def test_dist_lookups():
    d = Dist(np.array([2, 5, 9]), np.array([0.2, 0.3, 0.5]), 12)
    assert d.at(5) == 0.3 and d.at(4) == 0.0 and d.at(11) == 0.0
    np.testing.assert_array_equal(d.at_many(np.array([0, 2, 9, 10])), [0.0, 0.2, 0.5, 0.0])
