"""Device profiles: every shipped profile loads, typos are caught, detection works on faked board files."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from edgerun.device import detect as D
from edgerun.device import memory as M
from edgerun.device import profiles as P
from edgerun.util.resources import data_dir
from edgerun.config import BackendArgs
from edgerun.errors import InvalidArgument, MemoryBudgetError, ProfileError

SHIPPED = sorted(p.stem for p in data_dir("device_profiles").glob("*.yaml"))

REQUIRED = {"jetson-orin-nano-8gb", "jetson-orin-nx-16gb", "jetson-agx-orin-64gb", "rpi5-8gb", "rpi4-8gb",
            "apple-m1", "apple-m2", "apple-m3", "apple-m4", "generic-x86_64-cpu", "generic-arm64-cpu"}


@pytest.fixture(autouse=True)
def _no_user_profiles(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGERUN_PROFILES_DIR", str(tmp_path / "user-profiles"))
    monkeypatch.delenv("EDGERUN_PROFILE", raising=False)


def test_required_profiles_are_shipped():
    assert REQUIRED <= set(SHIPPED)
    assert set(P.list_profiles()) == set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_each_shipped_profile_loads(name):
    p = P.load_profile(name)
    assert p.name == name and p.description
    args = p.backend_args()
    assert isinstance(args, BackendArgs) and args.flash_attn
    assert p.priors.bandwidth_gbs and p.priors.bandwidth_gbs > 0
    assert p.priors.peak_gflops and p.priors.peak_gflops > 0
    assert p.budget_bytes(16 * P.GiB) > 0
    if p.memory.budget_gib is not None and p.memory.total_gib is not None:
        assert p.memory.budget_gib < p.memory.total_gib
    if name.startswith("jetson"):
        assert "CMAKE_CUDA_ARCHITECTURES=87" in p.build.cmake_args and args.n_gpu_layers == -1
    if name.startswith("apple"):
        assert "GGML_METAL=on" in p.build.cmake_args and p.priors.compute == "metal"
    if name == "rpi5-8gb":
        assert "dotprod" in p.build.cmake_args
    if name == "rpi4-8gb":
        assert "dotprod" not in p.build.cmake_args


def test_backend_args_overrides():
    p = P.load_profile("rpi5-8gb")
    a = p.backend_args(n_ctx=1024, n_threads=None)     # None means "not given": the profile's value stays
    assert a.n_ctx == 1024 and a.n_threads == 4
    with pytest.raises(InvalidArgument, match="n_ctxx"):
        p.backend_args(n_ctxx=5)


def _write(d: Path, name: str, text: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    f = d / name
    f.write_text(text)
    return f


def test_unknown_key_names_key_and_file(tmp_path):
    f = _write(tmp_path, "mine.yaml", "name: mine\nllama:\n  n_thread: 4\n")
    with pytest.raises(ProfileError) as e:
        P.load_profile(str(f))
    assert "'llama.n_thread'" in str(e.value) and str(f) in str(e.value) and "n_threads" in str(e.value)


def test_top_level_typo_and_wrong_type(tmp_path):
    f = _write(tmp_path, "a.yaml", "name: a\ngama_max: 4\n")
    with pytest.raises(ProfileError, match="unknown key 'gama_max'"):
        P.load_profile(str(f))
    f = _write(tmp_path, "b.yaml", "name: b\nllama:\n  flash_attn: 'yes'\n")
    with pytest.raises(ProfileError, match=r"llama\.flash_attn must be true or false"):
        P.load_profile(str(f))
    f = _write(tmp_path, "c.yaml", "name: c\nllama:\n  n_threads: 2.5\n")
    with pytest.raises(ProfileError, match=r"llama\.n_threads must be an integer"):
        P.load_profile(str(f))
    f = _write(tmp_path, "d.yaml", "name: d\nname: e\n")
    with pytest.raises(ProfileError, match="duplicate key 'name'"):
        P.load_profile(str(f))
    f = _write(tmp_path, "e.yaml", "name: e\npriors:\n  bandwidth_gbs: fast\n")
    with pytest.raises(ProfileError, match=r"priors\.bandwidth_gbs must be a number"):
        P.load_profile(str(f))


def test_exponent_strings_are_numbers(tmp_path):
    # PyYAML reads '1e2' (no dot) as a string; float fields convert it explicitly
    f = _write(tmp_path, "x.yaml", "name: x\npriors:\n  bandwidth_gbs: 1e2\n  peak_gflops: 5e-1\n")
    p = P.load_profile(str(f))
    assert p.priors.bandwidth_gbs == 100.0 and p.priors.peak_gflops == 0.5


def test_user_dir_overrides_and_extends(tmp_path, monkeypatch):
    user = tmp_path / "user-profiles"
    _write(user, "rpi5-8gb.yaml", "extends: rpi5-8gb\nllama:\n  n_ctx: 1024\n")
    _write(user, "my-board.yaml", "extends: generic-arm64-cpu\nmemory:\n  budget_gib: 3\n")
    p = P.load_profile("rpi5-8gb")
    assert p.llama.n_ctx == 1024 and p.llama.n_threads == 4 and str(user) in p.path
    q = P.load_profile("my-board")
    assert q.name == "my-board" and q.memory.budget_gib == 3 and q.match.machine == ("aarch64", "arm64")
    assert "my-board" in P.list_profiles()
    _write(user, "bad.yaml", "extends: rpi5-8gb\nllama:\n  nctx: 1\n")
    with pytest.raises(ProfileError, match=r"bad\.yaml: unknown key 'llama\.nctx' \(did you mean 'n_ctx'\?\)"):
        P.load_profile("bad")
    with pytest.raises(ProfileError, match="unknown device profile 'nope'"):
        P.load_profile("nope")


# --- detection on faked board files -----------------------------------------------------------

def _board(root: Path, *, model: str | None = None, compatible: list[str] | None = None,
           tegra: str | None = None, mem_gib: float = 8.0) -> Path:
    (root / "proc").mkdir(parents=True, exist_ok=True)
    (root / "proc/meminfo").write_text(f"MemTotal:       {int(mem_gib * 1024 * 1024)} kB\nMemFree: 1 kB\n")
    if model is not None or compatible is not None:
        (root / "proc/device-tree").mkdir(parents=True)
        if model is not None:
            (root / "proc/device-tree/model").write_bytes(model.encode() + b"\x00")
        if compatible is not None:
            (root / "proc/device-tree/compatible").write_bytes(b"".join(c.encode() + b"\x00" for c in compatible))
    if tegra is not None:
        (root / "etc").mkdir(parents=True, exist_ok=True)
        (root / "etc/nv_tegra_release").write_text(tegra + "\n")
    return root


# Real boards' identity files (contents and sources: tests/fixtures/boards/README.md).
FIXTURES = Path(__file__).parent / "fixtures" / "boards"
LINUX_BOARDS = sorted(d.name for d in FIXTURES.iterdir() if d.is_dir())
APPLE = {"apple-m1": "Apple M1", "apple-m2": "Apple M2 Pro", "apple-m3": "Apple M3 Max", "apple-m4": "Apple M4"}


def _copy_board(name: str, dest: Path) -> Path:
    shutil.copytree(FIXTURES / name, dest)
    return dest


def test_every_shipped_profile_has_a_detection_case():
    assert set(LINUX_BOARDS) == {"rpi4-8gb", "rpi5-8gb", "jetson-orin-nano-8gb", "jetson-orin-nx-16gb",
                                 "jetson-agx-orin-64gb"}
    covered = set(LINUX_BOARDS) | set(APPLE) | {"generic-x86_64-cpu", "generic-arm64-cpu"}
    assert covered == set(SHIPPED)


@pytest.mark.parametrize("name", LINUX_BOARDS)
def test_detect_real_board_files(name, caplog):
    prof, reason = D.detect(FIXTURES / name, system="Linux", machine="aarch64")
    assert prof.name == name, reason
    assert "device tree" in reason and "OUTSIDE" not in reason and "warning" not in reason
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    facts = D.gather_facts(FIXTURES / name, system="Linux", machine="aarch64")
    assert facts.missing == (() if name.startswith("jetson") else ("/etc/nv_tegra_release",))
    assert facts.is_tegra == name.startswith("jetson")
    assert "asimd" in facts.cpu_features and ("asimddp" in facts.cpu_features) == (name != "rpi4-8gb")


@pytest.mark.parametrize("name", LINUX_BOARDS)
def test_one_missing_file_keeps_the_board_and_a_missing_meminfo_is_named(tmp_path, name):
    for f in sorted(p for p in (FIXTURES / name).rglob("*") if p.is_file()):
        rel = f.relative_to(FIXTURES / name)
        root = _copy_board(name, tmp_path / str(rel).replace("/", "_"))
        (root / rel).unlink()
        prof, reason = D.detect(root, system="Linux", machine="aarch64")
        assert prof.name == name, (rel, reason)          # another file still identifies the board
        assert ("/proc/meminfo missing" in reason) == (str(rel) == "proc/meminfo"), (rel, reason)


@pytest.mark.parametrize("name", LINUX_BOARDS)
def test_board_without_device_tree_falls_back_to_generic_with_a_warning_naming_the_files(tmp_path, name, caplog):
    root = _copy_board(name, tmp_path / "root")
    shutil.rmtree(root / "proc/device-tree")
    if name.startswith("rpi"):
        # a Raspberry Pi kernel also names the board in /proc/cpuinfo ("Model : Raspberry Pi 5 Model B Rev 1.0")
        prof, reason = D.detect(root, system="Linux", machine="aarch64")
        assert prof.name == name and "/proc/cpuinfo Model" in reason, reason
        (root / "proc/cpuinfo").unlink()
    prof, reason = D.detect(root, system="Linux", machine="aarch64")
    assert prof.name == "generic-arm64-cpu", reason
    assert "/proc/device-tree/model and /proc/device-tree/compatible missing" in reason
    assert ("a Tegra board" in reason) == name.startswith("jetson")
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("/proc/device-tree/model" in w and "--profile" in w for w in warned), warned


def test_a_dotprod_build_on_a_cpu_without_dotprod_is_warned(tmp_path):
    # the Pi 5 profile's build uses dotprod; a Pi 4's Cortex-A72 (its real cpuinfo) lacks it
    root = _copy_board("rpi5-8gb", tmp_path / "root")
    shutil.copy(FIXTURES / "rpi4-8gb/proc/cpuinfo", root / "proc/cpuinfo")
    prof, reason = D.detect(root, system="Linux", machine="aarch64")
    assert prof.name == "rpi5-8gb" and "SIGILL" in reason and "asimddp" in reason


def test_device_root_env_reaches_auto_resolution_and_the_cli(monkeypatch):
    import json
    import platform

    from click.testing import CliRunner

    from edgerun.cli import main

    monkeypatch.setattr(platform, "machine", lambda: "aarch64")   # the fixtures are arm64 boards
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    monkeypatch.setenv("EDGERUN_DEVICE_ROOT", str(FIXTURES / "rpi4-8gb"))
    assert D.resolve("auto")[0].name == "rpi4-8gb"
    r = CliRunner().invoke(main, ["service", "build-flags", "--profile", "auto"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["cmake_args"] == "-DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH=armv8-a"
    r = CliRunner().invoke(main, ["profile", "detect", "--json", "--root", str(FIXTURES / "jetson-orin-nx-16gb")])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["profile"] == "jetson-orin-nx-16gb" and d["facts"]["missing"] == []


def test_detect_jetson_from_compatible_only(tmp_path):
    # no /etc/nv_tegra_release (e.g. a container without L4T files) and no model file
    root = _board(tmp_path / "r", compatible=["nvidia,p3768-0000+p3767-0000", "nvidia,p3767-0000", "nvidia,tegra234"],
                  mem_gib=15.3)
    prof, reason = D.detect(root, system="Linux", machine="aarch64")
    assert prof.name == "jetson-orin-nx-16gb" and "tegra" in reason


@pytest.mark.parametrize("name", sorted(APPLE))
def test_detect_apple(tmp_path, name):
    values = {"machdep.cpu.brand_string": APPLE[name], "hw.memsize": str(16 * 1024 ** 3)}
    prof, reason = D.detect(tmp_path, system="Darwin", machine="arm64", sysctl=values.get)
    assert prof.name == name and APPLE[name] in reason


@pytest.mark.parametrize("machine,name", [("x86_64", "generic-x86_64-cpu"), ("aarch64", "generic-arm64-cpu"),
                                          ("arm64", "generic-arm64-cpu")])
def test_detect_generic(tmp_path, machine, name):
    root = _board(tmp_path / "root", mem_gib=23.4)
    prof, reason = D.detect(root, system="Linux", machine=machine)
    assert prof.name == name and "generic" in reason


def test_detect_unknown_arm_board_and_intel_mac_are_generic(tmp_path):
    root = _board(tmp_path / "root", model="Pine64 RockPro64 v2.1", compatible=["pine64,rockpro64", "rockchip,rk3399"])
    assert D.detect(root, system="Linux", machine="aarch64")[0].name == "generic-arm64-cpu"
    intel = {"machdep.cpu.brand_string": "Intel(R) Core(TM) i7-8559U", "hw.memsize": str(16 * 1024 ** 3)}
    assert D.detect(tmp_path, system="Darwin", machine="x86_64", sysctl=intel.get)[0].name == "generic-x86_64-cpu"


def test_memory_breaks_ties_and_is_reported(tmp_path):
    # a Pi 5 with 4 GB still gets the Pi 5 build flags, and the reason says memory is outside the range
    root = _copy_board("rpi5-8gb", tmp_path / "root")
    (root / "proc/meminfo").write_text(f"MemTotal:       {int(3.9 * 1024 * 1024)} kB\n")
    prof, reason = D.detect(root, system="Linux", machine="aarch64")
    assert prof.name == "rpi5-8gb" and "OUTSIDE" in reason


def test_detect_no_match(tmp_path):
    with pytest.raises(ProfileError, match="no device profile matches"):
        D.detect(tmp_path, system="Linux", machine="riscv64")


def test_resolve(monkeypatch):
    assert D.resolve("rpi4-8gb")[0].name == "rpi4-8gb"
    monkeypatch.setenv("EDGERUN_PROFILE", "apple-m2")
    prof, reason = D.resolve("auto")
    assert prof.name == "apple-m2" and "EDGERUN_PROFILE" in reason


# --- memory fit -------------------------------------------------------------------------------

def test_memory_fit_passes_and_refuses_with_numbers():
    p = P.load_profile("jetson-orin-nano-8gb")   # budget 5.5 GiB
    M.check_memory_fit(p, target_bytes=1 * P.GiB, draft_bytes=500 * P.MiB, kv_bytes=200 * P.MiB,
                       available_bytes=7 * P.GiB)
    with pytest.raises(MemoryBudgetError) as e:
        M.check_memory_fit(p, target_bytes=4 * P.GiB, draft_bytes=1 * P.GiB, kv_bytes=2 * P.GiB, n_ctx=8192,
                           available_bytes=7 * P.GiB)
    msg = str(e.value)
    assert "4.00 GiB" in msg and "5.50 GiB" in msg and "--n-ctx" in msg and "--draft none" in msg
    # the memory available right now limits too, whatever the profile says
    with pytest.raises(MemoryBudgetError, match="available now"):
        M.check_memory_fit(p, target_bytes=1 * P.GiB, available_bytes=1 * P.GiB)


# --- CLI --------------------------------------------------------------------------------------

def test_cli_profile_show_detect_list():
    import json

    from click.testing import CliRunner

    from edgerun.cli import main

    r = CliRunner().invoke(main, ["profile", "show", "jetson-orin-nano-8gb"])
    assert r.exit_code == 0, r.output
    assert "CMAKE_CUDA_ARCHITECTURES=87" in r.output and "n_gpu_layers=-1" in r.output
    r = CliRunner().invoke(main, ["profile", "detect", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["profile"] in SHIPPED and d["reason"] and "machine" in d["facts"]
    r = CliRunner().invoke(main, ["profile", "list"])
    assert r.exit_code == 0 and all(n in r.output for n in REQUIRED)
    r = CliRunner().invoke(main, ["profile", "show", "no-such-board"])
    assert r.exit_code == 2 and r.output.startswith("error: unknown device profile 'no-such-board'")


# --- issue 20, defects 5 and 8: YAML bombs, non-finite numbers, non-UTF-8, directories -------------

BOMB = ('name: bomb\ndescription: &a ["x","x","x","x","x","x","x","x","x"]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n'
        'c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\nd: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\n'
        'f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]\ng: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]\nh: [*g,*g,*g,*g,*g,*g,*g,*g,*g]\n')


def test_yaml_aliases_are_refused_so_a_bomb_cannot_expand(tmp_path):
    f = tmp_path / "bomb.yaml"
    f.write_text(BOMB)
    with pytest.raises(ProfileError, match=r"aliases \(\*a\) are not allowed") as e:
        P.load_profile(f)
    assert len(str(e.value)) < 600


@pytest.mark.parametrize("content, needle", [
    ("name: x\nmemory:\n  budget_gib: .nan\n", "memory.budget_gib must be a number"),
    ("name: x\nmemory:\n  budget_gib: .inf\n", "memory.budget_gib must be a number"),
    (b"name: \xff\xfe\n", "not UTF-8"),
    ("name: x\ndescription: " + "y" * (2 << 20) + "\n", "at most"),
])
def test_bad_profile_files_get_one_clear_error(tmp_path, content, needle):
    f = tmp_path / "bad.yaml"
    f.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ProfileError, match=needle) as e:
        P.load_profile(f)
    assert len(str(e.value)) < 600


def test_a_profile_path_that_is_a_directory_says_so(tmp_path):
    d = tmp_path / "dir.yaml"
    d.mkdir()
    with pytest.raises(ProfileError, match="is a directory"):
        P.load_profile(d)
