"""`edgerun bundle` and hub names (hf:ORG/REPO...): refused up front, saying how to carry one by hand, before
anything is built or downloaded (the bundle's install.sh lays out registry files only)."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("args", [["--model", "hf:org/Model-GGUF:Q4_K_M"],
                                  ["--model", "smollm2-135m-instruct", "--draft", "hf:org/Small-GGUF"]])
def test_a_hub_name_is_refused_with_how_to_carry_it(args, tmp_path):
    r = subprocess.run([sys.executable, "-m", "edgerun", "bundle", "--profile", "generic-x86_64-cpu", *args,
                        "-o", str(tmp_path / "b")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: hf:org/") and "Traceback" not in r.stderr, r.stderr
    for words in ("does not carry hub models yet", "$EDGERUN_HOME/hub/ORG/REPO", "EDGERUN_NO_PULL=1"):
        assert words in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []
