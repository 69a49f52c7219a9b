"""`edgerun bundle` carries hub models (hf:ORG/REPO...) to a board with no network.

Against the local hub stand-in (tests/hubstandin.py): a tiny GGUF repo pulled by name and an AWQ checkpoint
the bundle pulls itself are put in a bundle with everything of it but the wheels (make.fill_rest: the full
bundle needs pip and a llama-cpp-python wheel, which tests/test_bundle.py covers), laid out on a fresh board
by the bundle's place_hub.py (the step its install.sh runs), then generated with `--no-pull`, the hub's
address a closed port, and no network at all where `unshare -n` is allowed. The bundle's install.sh refuses
a corrupted or extra hub file before anything is installed, and its dry run shows the hub layout.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("huggingface_hub")

from edgerun.bundle import BundleSpec, Target  # noqa: E402
from edgerun.bundle.make import fill_rest, resolve_models  # noqa: E402
from edgerun.cli import main  # noqa: E402
from edgerun.errors import InvalidArgument  # noqa: E402
from hubstandin import Server, StandIn  # noqa: E402
from tinymodel import write_tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIX = Path(__file__).parent / "fixtures" / "int4"
GGUF, AWQ = "hf:tiny/tiny-GGUF", "hf:tiny/awq-llama"


from test_hub import _closed_port  # noqa: E402


def _can_unshare() -> bool:
    try:
        return subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(bundle folder, its manifest, the stand-in) made on the 'connected machine' (its own EDGERUN_HOME)."""
    root = tmp_path_factory.mktemp("hub_bundle")
    repos = root / "repos"
    write_tiny_model(repos / "tiny-GGUF" / "tiny-Q8_0.gguf", wtype="q8_0")
    write_tiny_model(repos / "tiny-GGUF" / "tiny-F32.gguf")
    shutil.copytree(FIX / "awq-gemm-llama", repos / "awq-llama", ignore=shutil.ignore_patterns("dequant.npz"))
    standin = StandIn()
    standin.add("tiny/tiny-GGUF", repos / "tiny-GGUF")
    standin.add("tiny/awq-llama", repos / "awq-llama")
    with Server(standin) as url, pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_ENDPOINT", url)
        mp.setenv("EDGERUN_HOME", str(root / "connected"))
        mp.setenv("HF_HOME", str(root / "hf_home"))
        mp.delenv("HF_TOKEN", raising=False)
        mp.delenv("HF_HUB_OFFLINE", raising=False)
        for name in (GGUF, "hf:tiny/tiny-GGUF:F32"):        # the AWQ one is not pulled: the bundle pulls it
            r = CliRunner().invoke(main, ["pull", name])
            assert r.exit_code == 0, (r.output, r.exception)
        spec = BundleSpec(profile="generic-x86_64-cpu", out=root / "b", models=(GGUF, AWQ), draft="none")
        models, draft = resolve_models(spec)
        target = Target(profile="generic-x86_64-cpu", machine="x86_64", python="%d.%d" % sys.version_info[:2],
                        glibc="2.17", tegra=False)
        d = root / "b"
        d.mkdir()
        manifest = fill_rest(d, target, models, draft, root=ROOT, llama_name="none (models only)",
                             extras=("serve",))
    return d, manifest, standin


def _board_env(cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "EDGERUN_"))}
    env.update(EDGERUN_HOME=str(cache), HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}",
               HF_HOME=str(cache.parent / "hf_home"), PYTHONPATH=str(ROOT))
    return env


def _place(bundle: Path, board: Path) -> subprocess.CompletedProcess:
    """The bundle's place_hub.py, as its install.sh runs it (after verifying every file)."""
    return subprocess.run([sys.executable, str(bundle / "place_hub.py"), str(bundle), str(board / "opt"),
                           str(board / "cache")], capture_output=True, text=True, timeout=300)


def _install(bundle: Path, board: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(bundle / "install.sh"), "--python", sys.executable, "--prefix", str(board / "opt"),
                           "--etc-dir", str(board / "etc"), "--unit-dir", str(board / "units"),
                           "--cache-dir", str(board / "cache"), "--offline", *extra],
                          capture_output=True, text=True, timeout=300)


def test_the_bundle_carries_only_the_named_revisions_files_and_records(made):
    d, m, standin = made
    gguf_commit, awq_commit = standin.repos["tiny/tiny-GGUF"].commit, standin.repos["tiny/awq-llama"].commit
    hub_files = sorted(f["path"] for f in m["files"] if f["path"].startswith("hub/"))
    awq = sorted(p.name for p in (standin.repos["tiny/awq-llama"].folder).iterdir())
    assert hub_files == sorted([f"hub/tiny/tiny-GGUF/{gguf_commit}/.files.json",
                                f"hub/tiny/tiny-GGUF/{gguf_commit}/tiny-Q8_0.gguf",   # not F32: another pick
                                "hub/tiny/tiny-GGUF/picks/default.json",
                                f"hub/tiny/awq-llama/{awq_commit}/.files.json", "hub/tiny/awq-llama/picks/default.json",
                                *(f"hub/tiny/awq-llama/{awq_commit}/{n}" for n in awq)])
    listed = json.loads((d / f"hub/tiny/tiny-GGUF/{gguf_commit}/.files.json").read_text())
    assert list(listed) == ["tiny-Q8_0.gguf"]          # the connected cache lists tiny-F32.gguf there too
    for f in m["files"]:
        assert hashlib.sha256((d / f["path"]).read_bytes()).hexdigest() == f["sha256"], f["path"]
    q8 = (d / f"hub/tiny/tiny-GGUF/{gguf_commit}/tiny-Q8_0.gguf").read_bytes()
    assert q8 == (standin.repos["tiny/tiny-GGUF"].folder / "tiny-Q8_0.gguf").read_bytes()
    by_name = {r["name"]: r for r in m["models"]}
    assert by_name[GGUF]["file"] == f"hub/tiny/tiny-GGUF/{gguf_commit}/tiny-Q8_0.gguf"
    conv = by_name[AWQ]["hub"]["converted"]
    assert conv == by_name[AWQ]["file"] and conv.startswith("models/converted/awq-llama-") and (d / conv).is_file()
    record = json.loads((d / "hub/tiny/tiny-GGUF/picks/default.json").read_text())
    assert record["revision"] == gguf_commit and record["extra"]["vocab_fingerprint"]
    env = (d / "deploy" / "edgerun.env").read_text()
    assert f"\nEDGERUN_MODEL={GGUF}\n" in env and "\nEDGERUN_NO_PULL=1\n" in env
    assert (d / "place_hub.py").is_file() and os.access(d / "install.sh", os.X_OK)


def test_a_fresh_board_runs_the_hub_models_with_no_network(made, tmp_path):
    d, m, _ = made
    board = tmp_path / "board"
    r = _place(d, board)
    assert r.returncode == 0, r.stderr
    assert f"hub model {GGUF}" in r.stdout and "already there" in r.stdout
    cache = board / "cache"
    gguf = cache / next(x["file"] for x in m["models"] if x["name"] == GGUF)
    assert gguf.is_symlink() and gguf.resolve() == board / "opt" / gguf.relative_to(cache)
    assert oct(gguf.resolve().stat().st_mode & 0o777) == "0o644"
    netns = ["unshare", "-n"] if _can_unshare() else []
    env = _board_env(cache)
    # install.sh's check after placing them: each hub name resolves from the cache offline (its code, run here)
    check = re.search(r"^resolve_check='(.*?)'$", (ROOT / "deploy" / "bundle-install.sh").read_text(), re.S | re.M)
    r = subprocess.run([*netns, sys.executable, "-c", check.group(1), str(d / "manifest.json")],
                       capture_output=True, text=True, env={**env, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"==> {GGUF} resolves offline: {gguf}" in r.stdout and f"==> {AWQ} resolves offline:" in r.stdout
    for name in (GGUF, AWQ):
        r = subprocess.run([*netns, sys.executable, "-m", "edgerun", "generate", "The", "--model", name, "--no-pull",
                            "--draft", "none", "-n", "6", "-t", "0", "--threads", "1", "--json"],
                           capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert json.loads(r.stdout)["n_tokens"] == 6
    converted = sorted((cache / "models" / "converted").glob("*.gguf"))       # the carried one, not converted again
    assert [p.name for p in converted] == [Path(next(x["file"] for x in m["models"] if x["name"] == AWQ)).name]
    assert converted[0].is_symlink()
    r = subprocess.run([sys.executable, "-m", "edgerun", "list", "--json"], capture_output=True, text=True, env=env)
    rows = {x["name"]: x for x in json.loads(r.stdout)}
    assert rows[GGUF]["cached"] and rows[AWQ]["cached"]
    # a re-install after a bundle of an older revision: nothing copied again, and the older commit (no record
    # names it any more: the bundle's record replaced its own) goes, in the cache and under the prefix
    old = [board / where / "hub/tiny/tiny-GGUF" / ("0" * 40) for where in ("cache", "opt")]
    for o in old:
        o.mkdir()
        (o / "tiny-Q8_0.gguf").write_bytes(b"an older revision")
    r = _place(d, board)
    assert r.returncode == 0 and "hub files: 0 copied" in r.stdout, r.stdout
    assert not any(o.exists() for o in old) and gguf.is_file() and gguf.resolve().is_file()


@pytest.mark.parametrize("damage", ["corrupt", "unlisted"])
def test_the_install_refuses_a_damaged_hub_file_before_anything_is_installed(made, tmp_path, damage):
    d, m, _ = made
    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    target = bad / next(x["file"] for x in m["models"] if x["name"] == GGUF)
    if damage == "corrupt":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
        named = target.relative_to(bad).as_posix()
    else:
        extra = target.parent / "extra.gguf"
        shutil.copyfile(target, extra)
        named = extra.relative_to(bad).as_posix()
    board = tmp_path / "board"
    r = _install(bad, board)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"install.sh: {named}:" in r.stderr and "nothing was installed" in r.stderr, r.stderr
    assert not board.exists()


def test_the_install_dry_run_shows_the_hub_layout_and_the_offline_check(made, tmp_path):
    d, _, _ = made
    board = tmp_path / "board"
    r = _install(d, board, "--dry-run")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "verified" in r.stdout and "hub models in" in r.stdout and "+ copy" in r.stdout and "tiny-Q8_0.gguf" in r.stdout
    assert "HF_HUB_OFFLINE=1" in r.stdout and f"EDGERUN_MODEL={GGUF}" in r.stdout
    assert not board.exists()


def test_hub_names_are_taken_and_checked_before_anything_is_fetched():
    spec = lambda **kw: BundleSpec(profile="generic-x86_64-cpu", out=Path("x"), **kw)      # noqa: E731
    assert resolve_models(spec(models=("hf:org/Model-GGUF:Q4_K_M",))) == (["hf:org/Model-GGUF:Q4_K_M"], "auto")
    assert resolve_models(spec(models=("smollm2-135m-instruct",), draft="hf:org/Small-GGUF@abc")) == \
        (["smollm2-135m-instruct", "hf:org/Small-GGUF@abc"], "hf:org/Small-GGUF@abc")
    assert resolve_models(spec(models=("hf:org/M-GGUF",), draft="none")) == (["hf:org/M-GGUF"], None)
    with pytest.raises(InvalidArgument, match="not a hub name"):
        resolve_models(spec(models=("hf:no-repo",)))
    with pytest.raises(InvalidArgument, match="hub names"):
        resolve_models(spec(models=("./model.gguf",)))
