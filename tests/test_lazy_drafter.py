"""The drafter loaded when it will be used (speculative/lazy.py, docs/coldstart.md), on real models.

The pair: SmolLM2-135M as the target and a copy of the same file as its drafter. A drafter as dear as its
target can never pay, so the gamma tuner's state learned on it (a real run, kept under the real keys) says
speculation is off: the next process starts without the drafter. What is arranged by hand is only what a
quiet machine caches by itself (the drafter's step time: the probe skips its cache when the load average is
high, as on a shared test machine) and, for the server's background load, a state in which speculation is on.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from edgerun.cli import main
from edgerun.util.home import cache_dir
from server_harness import ServerProcess, clean_env, wait_until

pytestmark = pytest.mark.real_model
MODEL = "smollm2-135m-instruct"
ARGS = ("--profile", "generic-x86_64-cpu", "--threads", "1", "--ctx", "256")
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def smol() -> Path:
    path = cache_dir() / "models" / f"{MODEL}.gguf"
    if not path.exists():
        r = CliRunner().invoke(main, ["pull", MODEL])
        assert r.exit_code == 0, r.output
    return path


@pytest.fixture(scope="module")
def draft_file(smol, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("drafter") / "smol-drafter.gguf"
    shutil.copyfile(smol, d)
    return d


def _generate(home: Path, target: Path, draft: Path, *extra: str, n: int = 8) -> dict:
    cmd = [sys.executable, "-m", "edgerun", "generate", PROMPT, "-m", str(target), "--draft", str(draft), *ARGS,
           "-n", str(n), "-t", "0", "--json", *extra]
    r = subprocess.run(cmd, env=clean_env(home), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


class _Home:
    """EDGERUN_HOME pointed at `home` in this process for the duration of a with-block."""

    def __init__(self, home: Path) -> None:
        self.home, self.old = home, None

    def __enter__(self):
        self.old = os.environ.get("EDGERUN_HOME")
        os.environ["EDGERUN_HOME"] = str(self.home)

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop("EDGERUN_HOME", None)
        else:
            os.environ["EDGERUN_HOME"] = self.old


def _state_paths(home: Path) -> list[Path]:
    return sorted((home / "probes").glob("tuner-*-greedy.json"))


@pytest.fixture(scope="module")
def learned(smol, draft_file, tmp_path_factory):
    """A home in which the pair has run once, loaded (the tuner's greedy state and the drafter's step time kept
    under the keys the loaded models give); returns (home, the eager run's --json, the predicted and real keys)."""
    from edgerun.device.costprobe import drafter_key, measure_draft_step
    from edgerun.device.measurements import atomic_write_json, probes_dir
    from edgerun.runtime import load
    from edgerun.speculative.lazy import LazyDrafter, predicted_key

    home = tmp_path_factory.mktemp("home-learned")
    first = _generate(home, smol, draft_file, n=16)
    with _Home(home):
        rt = load(str(smol), draft=str(draft_file), profile="generic-x86_64-cpu", n_threads=1, n_ctx=256, pull=False)
        try:
            drafter = rt.drafter
            if isinstance(drafter, LazyDrafter):     # the step time was cached by the first run: deferred here
                drafter.load(strict=True)
                drafter = drafter.loaded
            real = drafter_key(drafter, rt.target)
            predicted = predicted_key(draft_file, _args(), rt.target)
            dpath = probes_dir() / f"draft-{real}.json"
            if not dpath.exists():          # what a quiet machine's probe keeps by itself
                atomic_write_json(dpath, {"t_draft": measure_draft_step(drafter, rt.target),
                                          "drafter": drafter.name})
        finally:
            rt.close()
    return home, first, predicted, real


def _args():
    from edgerun.device.detect import resolve

    return resolve("generic-x86_64-cpu")[0].backend_args(n_threads=1, n_ctx=256)


def test_the_drafter_key_is_predicted_without_loading_it(learned):
    _, _, predicted, real = learned
    assert predicted == real


def test_without_a_stored_state_the_drafter_loads_first(smol, draft_file, tmp_path):
    out = _generate(tmp_path, smol, draft_file)
    assert out["drafter"]["state"] == "loaded"
    assert out["drafter"]["reason"] == "loaded before the first token"


def test_a_state_that_says_off_starts_without_the_drafter(learned, smol, draft_file):
    home, first, _, _ = learned
    states = _state_paths(home)
    assert states, "the first run kept no tuner state"
    assert all(json.loads(p.read_text())["_current"] == [0, 0, 0, 0] for p in states)
    out = _generate(home, smol, draft_file, n=16)
    assert out["drafter"]["state"] == "deferred", out["drafter"]
    assert "load_s" not in out["drafter"]
    assert out["text"] == first["text"]             # greedy: the same text as with the drafter loaded
    assert out["n_drafted"] == 0


def test_a_deferred_drafter_loads_at_its_first_draft(learned, smol, draft_file):
    from edgerun.runtime import load
    from edgerun.speculative.lazy import LazyDrafter

    home, first, _, _ = learned
    with _Home(home):
        rt = load(str(smol), draft=str(draft_file), profile="generic-x86_64-cpu", n_threads=1, n_ctx=256, pull=False)
        try:
            assert isinstance(rt.drafter, LazyDrafter) and rt.drafter.state == "deferred"
            plain = rt.generate(PROMPT, max_tokens=16, temperature=0)
            assert rt.drafter.state == "deferred" and plain.text == first["text"]
            drafted = rt.generate(PROMPT, max_tokens=16, temperature=0, gamma=2)     # every cycle drafts
            assert rt.drafter.state == "loaded" and rt.drafter.load_s > 0
            assert drafted.stats.n_drafted > 0 and drafted.stats.n_accepted > 0
            assert drafted.text == first["text"]
        finally:
            rt.close()


def _health(url: str) -> dict:
    r = httpx.get(url + "/health", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def _complete(url: str, model: Path) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": str(model), "prompt": PROMPT, "max_tokens": 16,
                                                  "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_serve_reports_a_deferred_drafter(learned, smol, draft_file):
    home, first, _, _ = learned
    srv = ServerProcess(["--model", smol, "--draft", draft_file, *ARGS, "--parallel", "1"], env=clean_env(home))
    try:
        srv.wait_ready(120)
        assert _health(srv.url)["drafter"]["state"] == "deferred"
        assert _complete(srv.url, smol)["choices"][0]["text"] == first["text"]
    finally:
        assert srv.terminate() == 0


def _home_where_it_drafts(home: Path, tmp_path: Path) -> Path:
    """A copy of the learned home whose tuner state has speculation on: a server loads the drafter."""
    on = tmp_path / "home-on"
    shutil.copytree(home, on)
    for p in _state_paths(on):
        doc = json.loads(p.read_text())
        doc["_current"] = [1, 1, 1, 1]
        p.write_text(json.dumps(doc))
    return on


@pytest.mark.parametrize("parallel", [1, 2])
def test_serve_is_ready_while_the_drafter_loads(learned, smol, draft_file, tmp_path, parallel):
    """Ready with the target alone while the drafter loads (held at the gate); the answers are the same. With
    --parallel 2, once it is loaded the next request (nothing else running) gives both slots their views of it."""
    home, first, _, _ = learned
    on = _home_where_it_drafts(home, tmp_path)
    gate = tmp_path / "gate"
    srv = ServerProcess(["--model", smol, "--draft", draft_file, *ARGS, "--parallel", str(parallel)],
                        env=clean_env(on, EDGERUN_TEST_DRAFT_LOAD_GATE=str(gate)))
    try:
        srv.wait_ready(120)             # the drafter's load is held at the gate: ready with the target alone
        h = _health(srv.url)
        assert h["drafter"]["state"] == "loading", h
        answer = _complete(srv.url, smol)
        assert answer["choices"][0]["text"] == first["text"]
        gate.touch()
        wait_until(lambda: _health(srv.url)["drafter"]["state"] == "loaded", 120, "the drafter loaded")
        assert _complete(srv.url, smol)["choices"][0]["text"] == first["text"]
        if parallel > 1:
            srv.wait_for_line(r"drafter .* joined the 2 generation slots", 10)
    finally:
        gate.touch()
        assert srv.terminate() == 0


def test_batching_slots_draft_with_a_drafter_that_joined_them(learned, smol, draft_file, tmp_path, monkeypatch):
    """The same through the Python API, with a fixed gamma so that the slots must draft: before the drafter
    joins they cannot (no model drafts, the same text), after it both slots draft through their own views."""
    from edgerun.runtime import load
    from edgerun.speculative.drafters import ModelDrafter
    from edgerun.speculative.lazy import GATE_ENV

    home, first, _, _ = learned
    gate = tmp_path / "gate"
    monkeypatch.setenv(GATE_ENV, str(gate))
    with _Home(home):
        rt = load(str(smol), draft=str(draft_file), profile="generic-x86_64-cpu", n_threads=1, n_ctx=256,
                  parallel=2, draft_background=True, pull=False)
    try:
        slots = rt.slots()
        before = slots[1].generate(PROMPT, max_tokens=16, temperature=0, gamma=2)
        assert (before.text, before.stats.n_drafted) == (first["text"], 0)
        gate.touch()
        wait_until(lambda: rt.drafter.loaded is not None, 120, "the drafter loaded")
        for slot in slots:
            after = slot.generate(PROMPT, max_tokens=16, temperature=0, gamma=2)
            assert after.text == first["text"]
            assert after.stats.n_drafted > 0 and isinstance(slot.drafter, ModelDrafter)
        assert [s.drafter.backend.seq for s in slots] == [0, 1]       # a view each, of the drafter's one context
        assert rt.drafter.loaded.backend in slots[0].group.backends
    finally:
        gate.touch()
        rt.close()
