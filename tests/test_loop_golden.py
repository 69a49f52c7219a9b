"""The decode loop behaves as the committed golden run says (bench/golden_loop.py).

generate() over the numpy reference backend, for a fixed matrix of cases (prompts, greedy and sampled, model
and lookup drafters, gamma 0/1/4, JSON schema and regex constraints with and without forced runs, stop
strings, max_tokens, a context that fills, evaluation begun ahead, a recording gamma policy, streams closed
early, a drafter that breaks the constraint contract): every case's record (the Steps, the counters of
GenStats, the backend's calls, the caches and constraint afterwards) hashes to the digest in
tests/fixtures/loop_golden.json. A change to the loop that changes any of it fails here, naming the cases.

The digests were taken from the loop before it was split into cycle() (the refactor had to keep them).
A real change of behaviour regenerates them (`python bench/golden_loop.py --digests
tests/fixtures/loop_golden.json`, run on the trees before and after to diff the full records).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# loaded from its file: bench/ is not put on sys.path (its onnx.py would shadow the onnx package)
_spec = importlib.util.spec_from_file_location("bench_golden_loop", ROOT / "bench" / "golden_loop.py")
golden_loop = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = golden_loop
_spec.loader.exec_module(golden_loop)


def test_the_loop_matches_its_golden_run(tmp_path):
    want = json.loads((ROOT / "tests" / "fixtures" / "loop_golden.json").read_text())
    got = golden_loop.digests(golden_loop.run_all(tmp_path))
    assert len(want) > 500
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    differ = sorted(k for k in set(want) & set(got) if want[k] != got[k])
    assert not (missing or extra or differ), (f"{len(differ)} cases differ, e.g. {differ[:5]}; "
                                              f"missing {missing[:5]}; new {extra[:5]}")
