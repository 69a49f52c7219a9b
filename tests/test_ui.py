"""The page at / in a real headless browser (Debian's chromium + chromedriver through selenium; skipped with
the reason where they are missing: deploy/ci-deps.sh installs them), on the real `edgerun serve` with
smollm2-135m-instruct behind an API key: the page loads and asks for the key once, no request leaves the
machine, a message gets a streamed answer, Stop ends a generation (the server counts it cancelled), the
status panel shows the model and a tokens/s figure. Also /status itself, the board's sysfs readings on a
tree laid out as a Raspberry Pi's, --no-ui, and the page's files in the wheel and the sdist.

EDGERUN_UI_SCREENSHOT=PATH saves the browser's screenshot there as well (docs/ui.png is one)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
from click.testing import CliRunner

from edgerun.cli import main
from edgerun.registry.cache import cache_dir
from edgerun.serve.ui import pi_throttled, thermal_zones
from server_harness import TINY_ARGS, ServerProcess, clean_env, wait_until

MODEL = "smollm2-135m-instruct"
KEY = "ui-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ROOT = Path(__file__).resolve().parents[1]
STATIC = ("index.html", "app.js", "style.css")
CHROME_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1280,860")


def _browser_missing() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (the test extra installs it)"
    for tool, package in (("chromium", "chromium"), ("chromedriver", "chromium-driver")):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian package '{package}'; deploy/ci-deps.sh installs it)"
    return None


# --- without a browser ----------------------------------------------------------------------------

def _pi_sysfs(root: Path) -> Path:
    """A /sys laid out as a Raspberry Pi's: two thermal zones, one without a temperature, the firmware's word."""
    sysfs = root / "sys"
    for i, (kind, milli) in enumerate([("cpu-thermal", "51234"), ("gpu", "48000")]):
        zone = sysfs / f"class/thermal/thermal_zone{i}"
        zone.mkdir(parents=True)
        (zone / "temp").write_text(milli + "\n")
        (zone / "type").write_text(kind + "\n")
    (sysfs / "class/thermal/thermal_zone2").mkdir()             # a zone without a temperature: skipped
    fw = sysfs / "devices/platform/soc/soc:firmware"
    fw.mkdir(parents=True)
    (fw / "get_throttled").write_text("50005\n")
    return sysfs


PI_ZONES = [{"zone": "thermal_zone0", "type": "cpu-thermal", "celsius": 51.2},
            {"zone": "thermal_zone1", "type": "gpu", "celsius": 48.0}]
PI_THROTTLED = {"raw": "0x50005", "flags": ["under-voltage now", "throttled now", "under-voltage has occurred",
                                            "throttling has occurred"]}


def test_sysfs_readings_of_a_pi(tmp_path):
    sysfs = _pi_sysfs(tmp_path)
    assert thermal_zones(sysfs) == PI_ZONES and pi_throttled(sysfs) == PI_THROTTLED
    assert pi_throttled(tmp_path / "elsewhere") is None and thermal_zones(tmp_path / "elsewhere") == []


def test_status_page_files_and_no_ui(tiny_llama, tmp_path):
    board = tmp_path / "board"
    _pi_sysfs(board)
    srv = ServerProcess(["--model", tiny_llama, *TINY_ARGS, "--api-key", KEY],
                        env=clean_env(tmp_path, EDGERUN_DEVICE_ROOT=str(board)))
    try:
        srv.wait_ready()
        page = httpx.get(srv.url + "/")                     # the page needs no key; it holds no secret
        assert page.status_code == 200 and "<script src=\"/ui/app.js\">" in page.text
        assert "default-src 'none'" in page.headers["content-security-policy"]
        assert "http" not in page.text.replace("http-equiv", "")      # nothing loaded from anywhere
        for name in ("app.js", "style.css"):
            r = httpx.get(f"{srv.url}/ui/{name}")
            assert r.status_code == 200 and "//cdn" not in r.text and "https://" not in r.text
        assert httpx.get(srv.url + "/status").status_code == 401
        assert httpx.get(srv.url + "/", headers={"Host": "evil.example"}).status_code == 403   # DNS rebinding
        s = httpx.get(srv.url + "/status", headers=AUTH).json()
        assert s["status"] == "ready" and s["model"] == str(tiny_llama) and s["profile"]["name"] == "generic-x86_64-cpu"
        assert s["files"][0]["role"] == "target" and s["files"][0]["bytes"] == Path(tiny_llama).stat().st_size
        assert s["queue"]["slots"] >= 1 and s["memory"]["rss_bytes"] > 0 and s["memory"]["budget_bytes"] > 0
        assert s["speed"]["generations"] == 0
        assert s["thermal"] == PI_ZONES and s["throttled"] == PI_THROTTLED      # the board's sysfs, as a Pi has it
        httpx.post(srv.url + "/v1/completions", headers=AUTH, json={"model": str(tiny_llama), "prompt": "a",
                                                                     "max_tokens": 5}).raise_for_status()
        s = httpx.get(srv.url + "/status", headers=AUTH).json()
        assert s["speed"]["generations"] == 1 and s["speed"]["tokens_per_s"] > 0
        # the page's own calls carry its Origin (same-origin: allowed); another page's are refused
        body = {"model": str(tiny_llama), "prompt": "a", "max_tokens": 2}
        assert httpx.post(srv.url + "/v1/completions", headers={**AUTH, "Origin": srv.url}, json=body).status_code == 200
        r = httpx.post(srv.url + "/v1/completions", headers={**AUTH, "Origin": "http://localhost:1"}, json=body)
        assert r.status_code == 403
    finally:
        assert srv.terminate() == 0, srv.output
    srv = ServerProcess(["--model", tiny_llama, *TINY_ARGS, "--no-ui"], env=clean_env(tmp_path))
    try:
        assert httpx.get(srv.url + "/").status_code == 404
        assert httpx.get(srv.url + "/ui/app.js").status_code == 404
    finally:
        assert srv.terminate() == 0, srv.output


def test_the_page_travels_in_the_sdist_and_the_wheel_built_from_it(tmp_path):
    r = subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(tmp_path), str(ROOT)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (sdist,) = tmp_path.glob("edgerun-*.tar.gz")
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {f"edgerun/serve/static/{n}" for n in STATIC} <= names
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp_path), str(sdist)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (whl,) = tmp_path.glob("edgerun-*.whl")
    with zipfile.ZipFile(whl) as z:
        assert {f"edgerun/serve/static/{n}" for n in STATIC} <= set(z.namelist())


# --- in the browser -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    r = CliRunner().invoke(main, ["pull", MODEL])
    assert r.exit_code == 0, r.output
    srv = ServerProcess(["--model", MODEL, "--no-pull", "--draft", "lookup", "--threads", "1", "--ctx", "2048",
                         "--api-key", KEY], env=clean_env(cache_dir()))
    srv.wait_ready(timeout=120)
    yield srv
    assert srv.terminate() == 0, srv.output


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    missing = _browser_missing()
    if missing:
        pytest.skip(missing)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for flag in CHROME_FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    opts.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=Service(shutil.which("chromedriver")))
    driver.set_script_timeout(120)
    yield driver
    driver.quit()


def _requested_urls(driver) -> list[str]:
    urls = []
    for entry in driver.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg["method"] == "Network.requestWillBeSent":
            urls.append(msg["params"]["request"]["url"])
    return urls


def _wait(driver, condition, timeout: float = 120):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition(d))


def _assistant(driver):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]


def _ask(driver, text: str, max_tokens: int) -> None:
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.ID, "max-tokens")
    box.clear()
    box.send_keys(str(max_tokens))
    driver.find_element(By.ID, "prompt").send_keys(text)
    # count the answer's text changes while it streams (each one a piece that came over the wire)
    driver.execute_script("""
        window.__updates = 0;
        new MutationObserver(() => {
          const m = [...document.querySelectorAll('.msg.assistant')].pop();
          if (m && m.dataset.state === 'streaming' && m.textContent) window.__updates++;
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});""")
    driver.find_element(By.ID, "send").click()


def test_the_page_in_a_browser(server, browser, tmp_path):
    from selenium.webdriver.common.by import By

    d = browser
    d.get(server.url + "/")
    dialog = d.find_element(By.ID, "key-dialog")
    _wait(d, lambda d: dialog.get_attribute("open") is not None, 30)      # /status answered 401: the key is asked
    d.find_element(By.ID, "key").send_keys(KEY)
    d.find_element(By.ID, "key-ok").click()
    _wait(d, lambda d: d.find_element(By.ID, "model").text == MODEL, 30)
    assert d.find_element(By.ID, "drafter").text == "lookup"
    assert d.find_element(By.ID, "phase").text == "ready"
    assert d.execute_script("return sessionStorage.getItem('edgerun-api-key')") == KEY

    # a message gets a streamed answer
    _ask(d, "Name three fruits.", 60)
    _wait(d, lambda d: _assistant(d).get_attribute("data-state") != "streaming")
    answer = _assistant(d)
    assert answer.get_attribute("data-state") == "done", d.find_element(By.ID, "chat-error").text
    assert answer.text.strip() and "tok/s" in answer.find_element(By.CLASS_NAME, "meta").text
    assert d.execute_script("return window.__updates") >= 2            # it came in pieces, not at once
    _wait(d, lambda d: "tok/s" in d.find_element(By.ID, "s-tps").text, 10)
    tps = float(d.find_element(By.ID, "s-tps").text.split()[0])
    assert tps > 0
    assert "smollm2-135m-instruct.gguf" in d.find_element(By.ID, "s-files").text
    assert "generic" in d.find_element(By.ID, "s-profile").text or d.find_element(By.ID, "s-profile").text != "–"
    shot = tmp_path / "ui.png"
    d.save_screenshot(str(shot))
    if os.environ.get("EDGERUN_UI_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["EDGERUN_UI_SCREENSHOT"])

    # Stop ends the generation: the page says so and the server counts it cancelled
    def outcomes() -> dict[str, float]:
        text = httpx.get(server.url + "/metrics", headers=AUTH).text
        return {l.split('outcome="')[1].split('"')[0]: float(l.split()[-1])
                for l in text.splitlines() if l.startswith("edgerun_generations_total{")}

    counted, seen = False, []
    for _attempt in range(5):
        # an answer that ends on its own before the click (the page shows it done, or the abort races its
        # last bytes and the server counts a normal end) is asked again; a counted cancel must come
        before = outcomes()
        # free prose: a text the drafter can copy (counting) can finish 1,500 tokens before the click lands
        _ask(d, "Write a long story about a dragon who learns to bake bread, chapter by chapter.", 1500)
        _wait(d, lambda d: len(_assistant(d).text) > 0)
        d.find_element(By.ID, "stop").click()
        _wait(d, lambda d: _assistant(d).get_attribute("data-state") != "streaming", 30)
        stopped = _assistant(d).get_attribute("data-state") == "stopped"
        if stopped:
            assert "stopped" in _assistant(d).find_element(By.CLASS_NAME, "meta").text
        wait_until(lambda: sum(outcomes().values()) == sum(before.values()) + 1, timeout=120,
                   what="the generation accounted for in /metrics")
        after = outcomes()
        seen.append({k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)})
        if after.get("cancelled", 0) == before.get("cancelled", 0) + 1:
            assert stopped, "the server counted a cancel the page did not show"
            counted = True
            break
    assert counted, f"no Stop click was counted cancelled by the server in 5 attempts; outcomes counted: {seen}"
    assert not d.find_element(By.ID, "send").get_attribute("disabled")

    # the page still answers after a stop, and nothing it did left this machine
    urls = _requested_urls(d)
    assert any(u.endswith("/v1/chat/completions") for u in urls) and any(u.endswith("/status") for u in urls)
    here = urlparse(server.url).netloc
    network = [u for u in urls if urlparse(u).scheme in ("http", "https", "ws", "wss", "ftp")]   # not chrome://, data:
    strangers = [u for u in network if urlparse(u).netloc != here]
    assert not strangers, strangers
    errors = [e for e in d.get_log("browser") if e["level"] == "SEVERE" and "401" not in e["message"]]
    assert not errors, errors
