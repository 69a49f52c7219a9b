"""Hardware probes: the bandwidth kernels (C and numpy) and the backend cost probe with its cache."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgerun.errors import BackendError, InvalidArgument
from edgerun.device import bandwidth as B
from edgerun.device import kernels
from edgerun.device import measurements as store
from edgerun.device.cost import CostCurve
from edgerun.device.costprobe import cost_curve_for, measure_verify_curve, probe_costs

MiB = 1024 ** 2


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGERUN_HOME", str(tmp_path / "home"))


def test_numpy_kernels_compute_and_time():
    t_copy, t_triad = B.numpy_stream(1 << 20, threads=2, reps=2)     # 8 MiB arrays: values checked inside
    assert 0 < t_copy < 10 and 0 < t_triad < 10


@pytest.mark.skipif(kernels.find_compiler("c") is None, reason="no C compiler on this machine")
def test_c_kernel_builds_once_and_checks_its_result():
    lib = kernels.build_stream_c()
    assert lib is not None and lib.is_file()
    assert kernels.build_stream_c() == lib          # cached by source + flags hash
    t_copy, t_triad = B.c_stream(1 << 20, threads=2, reps=2)
    assert 0 < t_copy < 10 and 0 < t_triad < 10
    with pytest.raises(BackendError, match="code 3"):
        B.c_stream(10, threads=1, reps=1)           # too small: refused by the kernel itself


@pytest.mark.skipif(kernels.find_compiler("c") is None, reason="no C compiler on this machine")
def test_bandwidth_probe_agrees_with_independent_numpy_copy():
    # arrays 4x the 32 MiB last-level cache of the development machine; the C copy and a threaded
    # numpy copy of the same size alternate in one run. The machine is shared, so this test checks
    # a loose bound; `edgerun profile probe` reports the precise ratio (within 10% when quiet).
    size = max(128 * MiB, 4 * B.last_level_cache_bytes())
    ratios = []
    for _ in range(2):
        bw = B.probe_bandwidth(array_bytes=size, reps=3, rounds=2, method="c")
        assert bw.method == "c" and bw.copy_gbs > 0.5 and bw.triad_gbs > 0.5
        ratios.append(bw.check_ratio)
        if 0.7 <= bw.check_ratio <= 1.43:
            break
    assert any(0.7 <= r <= 1.43 for r in ratios), ratios


def test_numpy_fallback_and_cache(monkeypatch):
    monkeypatch.setattr(kernels, "find_compiler", lambda kind="c": None)     # as on a board without cc
    assert kernels.build_stream_c() is None
    bw = B.measure_and_cache(array_bytes=16 * MiB, reps=2, rounds=1)
    assert bw.method == "numpy" and bw.copy_gbs > 0 and bw.check_copy_gbs > 0
    again = B.cached_bandwidth()
    assert again == bw
    with pytest.raises(BackendError):
        B.probe_bandwidth(array_bytes=16 * MiB, method="c")
    with pytest.raises(InvalidArgument):
        B.probe_bandwidth(method="stream")


def test_file_hash_is_memoised(tmp_path):
    f = tmp_path / "m.bin"
    f.write_bytes(b"x" * 1000)
    h = store.file_sha256(f)
    assert h == store.file_sha256(f)
    memo = json.loads((store.probes_dir() / "file-hashes.json").read_text())
    assert h in memo.values()
    f.write_bytes(b"y" * 1001)
    assert store.file_sha256(f) != h


# --- the backend cost probe on a real llama.cpp backend ---------------------------------------

@pytest.fixture
def tiny_target(tiny_llama):
    from edgerun.backends.llamacpp import LlamaCppBackend
    from edgerun.config import BackendArgs

    be = LlamaCppBackend(tiny_llama, BackendArgs(n_ctx=256, n_threads=1))
    yield be
    be.close()


def test_cost_probe_measures_and_caches(tiny_target, monkeypatch):
    from edgerun.device import costprobe

    monkeypatch.setattr(costprobe, "_busy", lambda: True)      # a busy machine's figures are provisional...
    busy = probe_costs(tiny_target, None, n_max=4, reps=1)
    [path] = store.probes_dir().glob("verify-*.json")
    assert json.loads(path.read_text())["provisional"] is True
    real_measure = costprobe.measure_verify_times

    def no_measuring(*a, **kw):
        raise AssertionError("measured again on a machine that is still busy")

    monkeypatch.setattr(costprobe, "measure_verify_times", no_measuring)
    assert probe_costs(tiny_target, None, n_max=4, reps=1) == busy      # ...used while it stays busy...
    monkeypatch.setattr(costprobe, "measure_verify_times", real_measure)
    path.unlink()
    monkeypatch.setattr(costprobe, "_busy", lambda: False)
    tv = measure_verify_curve(tiny_target, n_max=4, reps=1)
    assert len(tv) == 4 and all(t > 0 for t in tv)
    assert tiny_target.n_past == 0                    # the cache is left empty
    curve = probe_costs(tiny_target, None, n_max=4, reps=1)
    assert curve.source == "measured" and curve.t_draft == 0.0
    files = sorted(p.name for p in store.probes_dir().glob("verify-*.json"))
    assert len(files) == 1
    # the second call reads the cache: identical numbers
    assert probe_costs(tiny_target, None, n_max=4, reps=1) == curve
    assert "provisional" not in json.loads(store.probes_dir().joinpath(files[0]).read_text())


def test_a_provisional_curve_is_measured_again_on_a_quiet_machine_and_keeps_the_least_times(tiny_target, monkeypatch):
    from edgerun.device import costprobe

    runs = iter([np.array([[4.0, 6.0, 8.0, 9.0]]), np.array([[5.0, 5.0, 9.0, 8.0]]), np.array([[1.0, 2.0, 3.0, 4.0]])])
    monkeypatch.setattr(costprobe, "measure_verify_times", lambda *a, **kw: next(runs))
    busy = {"now": True}
    monkeypatch.setattr(costprobe, "_busy", lambda: busy["now"])
    assert probe_costs(tiny_target, None, n_max=4).t_verify == (4.0, 6.0, 8.0, 9.0)
    [path] = store.probes_dir().glob("verify-*.json")
    busy["now"] = False                        # quiet now: measured again, still unsteady -> least of the two
    monkeypatch.setattr(costprobe, "unsteady", lambda times: True)
    assert probe_costs(tiny_target, None, n_max=4).t_verify == (4.0, 5.0, 8.0, 8.0)
    assert json.loads(path.read_text())["provisional"] is True
    monkeypatch.setattr(costprobe, "unsteady", lambda times: False)     # a quiet, steady run replaces it for good
    assert probe_costs(tiny_target, None, n_max=4).t_verify == (1.0, 2.0, 3.0, 4.0)
    assert "provisional" not in json.loads(path.read_text())


def test_drafter_probe_beside_a_contended_target_step_is_not_cached(tiny_target, tiny_llama, monkeypatch):
    """Servers started together each probe while the others do: every repetition is slow alike, so only the
    target's step set beside the curve shows it; such a drafter cost is cached as provisional only, and measured
    again (and cached for good) at a start on a quiet machine."""
    from edgerun.backends.llamacpp import LlamaCppBackend
    from edgerun.config import BackendArgs
    from edgerun.device import costprobe
    from edgerun.speculative.drafters import ModelDrafter

    monkeypatch.setattr(costprobe, "_busy", lambda: False)
    draft_be = LlamaCppBackend(tiny_llama, BackendArgs(n_ctx=256, n_threads=1))
    try:
        drafter = ModelDrafter(draft_be, tiny_target)
        curve = probe_costs(tiny_target, None, n_max=4, reps=1)              # the quiet curve, cached
        real = costprobe.target_step_now
        assert 0 < real(tiny_target) and tiny_target.n_past == 0
        monkeypatch.setattr(costprobe, "target_step_now", lambda t, **kw: 2.0 * curve.t_verify[0])
        assert probe_costs(tiny_target, drafter, n_max=4, reps=1).t_draft > 0
        [path] = store.probes_dir().glob("draft-*.json")
        assert json.loads(path.read_text())["provisional"] is True     # kept provisional: measured again once quiet
        monkeypatch.setattr(costprobe, "target_step_now", lambda t, **kw: curve.t_verify[0])
        td = probe_costs(tiny_target, drafter, n_max=4, reps=1).t_draft
        assert len(list(store.probes_dir().glob("draft-*.json"))) == 1
        assert probe_costs(tiny_target, drafter, n_max=4, reps=1).t_draft == td     # read back
    finally:
        draft_be.close()


def test_unsteady_repetitions_are_not_trusted():
    from edgerun.device.costprobe import unsteady

    steady = np.array([[1.0, 2.0, 3.0], [1.1, 2.1, 2.9], [0.95, 2.2, 3.1]])
    assert not unsteady(steady) and not unsteady(steady[:1] * 9)
    spiky = steady.copy()
    spiky[1, 0] = 9.0                     # one repetition ran while another job held the second core
    assert unsteady(spiky)
    first = steady.copy()
    first[0, 1] = 9.0                     # the first evaluation of a batch size (llama.cpp sizes its buffers)
    assert not unsteady(first) and unsteady(first[:2])      # left out only where two repetitions remain


def test_cost_probe_with_lookup_drafter(tiny_target):
    from edgerun.device.profiles import load_profile
    from edgerun.speculative.drafters import PromptLookupDrafter

    d = PromptLookupDrafter()
    curve = cost_curve_for(tiny_target, d, load_profile("generic-x86_64-cpu"))
    assert curve.source == "measured" and len(curve.t_verify) == 16 and 0 < curve.t_draft < 0.05
    prior = cost_curve_for(tiny_target, d, load_profile("rpi5-8gb"), measure=False)
    assert prior.source == "roofline" and prior.t_draft > 0
    assert isinstance(prior, CostCurve) and np.all(np.diff(prior.t_verify) >= 0)


def test_the_probe_times_long_drafts_sparsely_and_interpolates(tiny_target):
    from edgerun.device.costprobe import DENSE, measure_verify_times, probe_points

    assert probe_points(9) == list(range(1, 10))
    pts = probe_points(25)
    assert pts[:DENSE] == list(range(1, DENSE + 1)) and pts[-1] == 25 and len(pts) < 25
    assert probe_points(49) == [*range(1, DENSE + 1), 12, 16, 20, 24, 28, 32, 49]   # sparser past 32
    times = measure_verify_times(tiny_target, n_max=25, reps=2)
    assert times.shape == (2, 25) and (times > 0).all()
    i, j = pts[DENSE], pts[DENSE + 1]                # between two timed points: on the line through them
    mid = (i + j) // 2
    want = times[:, i - 1] + (times[:, j - 1] - times[:, i - 1]) * (mid - i) / (j - i)
    assert np.allclose(times[:, mid - 1], want)
