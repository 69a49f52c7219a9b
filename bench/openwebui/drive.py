"""Open WebUI against the real `edgerun serve`, end to end, in a headless chromium (run by run.sh).

Starts `edgerun serve` on a loopback port behind an API key, starts Open WebUI (its own venv, offline
settings, no login, its data under WORK) with two connections to that one port: the Ollama connection
(OLLAMA_BASE_URL, the key through OLLAMA_API_CONFIGS) and the OpenAI connection (OPENAI_API_BASE_URL,
OPENAI_API_KEY). In the browser: one chat through each connection (the model as the Ollama connection
lists it, `NAME:latest`, then as the OpenAI connection lists it, `NAME`), each waited on until the
streamed answer stops growing, each screenshotted. Then reads edgerun's /metrics: the requests Open
WebUI made per endpoint label and status, and fails if a chat route was not called or any answer was an
error. Writes WORK/result.json (and a copy under bench/results/ in the repo) and prints a table.

    WORK/venv/bin/python bench/openwebui/drive.py --work WORK --edgerun-python PY [--shots docs]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import secrets
import signal
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
CHROME_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1280,800")
# the same prompt through both connections: with greedy decoding, the two answers should be the same text
PROMPTS = {"ollama": "Name three colours of the rainbow.", "openai": "Name three colours of the rainbow."}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen, what: str, headers=None) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"error: {what} exited with {proc.returncode} before answering {url}")
        try:
            if httpx.get(url, timeout=5, headers=headers).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"error: {what} did not answer {url} within {timeout:.0f} s")


def metrics(base: str, key: str) -> dict[tuple[str, str], float]:
    """edgerun_requests_total by (endpoint, status)."""
    text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=10).text
    out: dict[tuple[str, str], float] = {}
    for m in re.finditer(r'^edgerun_requests_total\{([^}]*)\}\s+(\S+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        out[(labels.get("endpoint", "?"), labels.get("status", "?"))] = float(m.group(2))
    return out


def gauges(base: str, key: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(edgerun_\w+) (\S+)$", text, re.M)}


def wait_idle(base: str, key: str, quiet: float, timeout: float) -> None:
    """Until edgerun has run nothing and queued nothing for `quiet` seconds: Open WebUI's follow-up
    requests (the chat's title, tags, follow-up questions) come after the answer."""
    t0 = since = time.monotonic()
    while time.monotonic() - t0 < timeout:
        g = gauges(base, key)
        if g.get("edgerun_busy", 0) or g.get("edgerun_queue_depth", 0) or g.get("edgerun_running", 0):
            since = time.monotonic()
        elif time.monotonic() - since >= quiet:
            return
        time.sleep(0.5)
    raise SystemExit(f"error: edgerun still busy after {timeout:.0f} s")


def diff(before: dict, after: dict) -> dict[str, int]:
    """Requests answered between two snapshots, as 'endpoint status': count (the /metrics reads left out)."""
    return {f"{e} {s}": int(after[(e, s)] - before.get((e, s), 0)) for (e, s) in sorted(after)
            if after[(e, s)] - before.get((e, s), 0) > 0 and e != "/metrics"}


def chat_in_browser(driver, ui: str, model: str, prompt: str, shot: Path, timeout: float, idle) -> str:
    """Open a new chat with `model` preselected, send `prompt`, wait for the answer to stop growing."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(f"{ui}/?models={model}")
    wait = WebDriverWait(driver, timeout)
    box = wait.until(lambda d: d.find_element(By.ID, "chat-input"))
    wait.until(lambda d: model in d.find_element(By.TAG_NAME, "body").text
               or d.find_elements(By.CSS_SELECTOR, f'[data-value="{model}"]'))
    time.sleep(2)
    for button in driver.find_elements(By.XPATH, "//button[contains(., 'Okay, Let')]"):
        button.click()                      # the release notes Open WebUI shows on a first visit
        time.sleep(1)
    box.click()
    box.send_keys(prompt)
    box.send_keys(Keys.ENTER)
    text, stable_since, t0 = "", time.monotonic(), time.monotonic()
    while time.monotonic() - t0 < timeout:
        now = (driver.execute_script(    # read in one go: the page re-renders the answer as it streams
            "const e = document.querySelectorAll('#response-content-container');"
            "return e.length ? e[e.length - 1].innerText : '';") or "").strip()
        if now != text:
            text, stable_since = now, time.monotonic()
        elif text and time.monotonic() - stable_since > 6:
            break
        time.sleep(0.5)
    else:
        driver.save_screenshot(str(shot.with_suffix(".timeout.png")))
        raise SystemExit(f"error: no answer through {model} within {timeout:.0f} s (screenshot beside {shot})")
    idle()
    time.sleep(1)
    driver.save_screenshot(str(shot))
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--edgerun-python", default=sys.executable, help="a Python that imports edgerun")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--shots", type=Path, default=ROOT / "docs", help="where the two screenshots go")
    ap.add_argument("--ctx", help="edgerun serve --ctx (default: the device profile's)")
    ap.add_argument("--builtin-tools", action="store_true",
                    help="keep Open WebUI's built-in tools on (its default; needs --ctx 8192)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per wait")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # so that `finally` stops what this started
    signal.signal(signal.SIGINT, signal.default_int_handler)
    work = args.work.resolve()
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for old in ("data", "chromium-profile"):          # each run is Open WebUI's first start, in a fresh browser
        shutil.rmtree(work / old, ignore_errors=True)
    key = secrets.token_urlsafe(16)
    er_port, ui_port = free_port(), free_port()
    er = f"http://127.0.0.1:{er_port}"
    ui = f"http://127.0.0.1:{ui_port}"
    procs: list[subprocess.Popen] = []

    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGERUN_")}
    env.update(PYTHONPATH=str(ROOT), EDGERUN_API_KEY=key)
    if os.environ.get("EDGERUN_HOME"):
        env["EDGERUN_HOME"] = os.environ["EDGERUN_HOME"]
    er_log = open(logs / "edgerun.log", "w")
    procs.append(subprocess.Popen(
        ["nice", "-n", "19", args.edgerun_python, "-m", "edgerun", "serve", "--model", args.model,
         "--port", str(er_port), "--threads", args.threads, *(("--ctx", args.ctx) if args.ctx else ())],
        cwd=ROOT, env=env, stdout=er_log, stderr=subprocess.STDOUT))
    # Open WebUI's offline settings: no model downloads (embedding, reranking, whisper), no version check,
    # no retrieval (so no embedding model is needed at all), no login (one local user), data under WORK.
    owui_env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "OLLAMA_"))}
    owui_env.update(
        DATA_DIR=str(work / "data"), WEBUI_SECRET_KEY=secrets.token_hex(32), WEBUI_AUTH="False",
        OFFLINE_MODE="true", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
        BYPASS_EMBEDDING_AND_RETRIEVAL="true", RAG_EMBEDDING_MODEL_AUTO_UPDATE="false",
        RAG_RERANKING_MODEL_AUTO_UPDATE="false", WHISPER_MODEL_AUTO_UPDATE="false",
        ENABLE_VERSION_UPDATE_CHECK="false", DO_NOT_TRACK="true", SCARF_NO_ANALYTICS="true",
        ANONYMIZED_TELEMETRY="false", ENABLE_PERSISTENT_CONFIG="false",
        ENABLE_OLLAMA_API="true", OLLAMA_BASE_URL=er, OLLAMA_API_CONFIGS=json.dumps({"0": {"key": key}}),
        ENABLE_OPENAI_API="true", OPENAI_API_BASE_URL=f"{er}/v1", OPENAI_API_KEY=key)
    # greedy decoding, at most 256 tokens (Open WebUI sends them as options.temperature and options.num_predict
    # to /api/chat, temperature and max_tokens to /v1/chat/completions): the same answers each run, and a
    # small model's greedy answer that repeats itself stops
    owui_env["DEFAULT_MODEL_PARAMS"] = json.dumps({"temperature": 0, "max_tokens": 256})
    if not args.builtin_tools:
        # Open WebUI's built-in tools (memory, notes, chats, knowledge, ... as native tool calls) add about
        # 7000 tokens of tool schemas to every chat from its page: more than a board's context holds
        owui_env["DEFAULT_MODEL_METADATA"] = json.dumps({"capabilities": {"builtin_tools": False}})
    owui = shutil.which("open-webui", path=str(Path(sys.executable).parent)) or "open-webui"
    ui_log = open(logs / "open-webui.log", "w")
    t_start = time.monotonic()
    procs.append(subprocess.Popen(["nice", "-n", "19", owui, "serve", "--host", "127.0.0.1", "--port", str(ui_port)],
                                  cwd=work, env=owui_env, stdout=ui_log, stderr=subprocess.STDOUT))
    driver = None
    try:
        wait_http(f"{er}/health", args.timeout, procs[0], "edgerun serve")
        wait_http(f"{ui}/health", args.timeout, procs[1], "open-webui")
        owui_start_s = time.monotonic() - t_start
        before = metrics(er, key)

        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        opts = webdriver.ChromeOptions()
        for flag in CHROME_FLAGS:
            opts.add_argument(flag)
        opts.add_argument(f"--user-data-dir={work / 'chromium-profile'}")
        driver = webdriver.Chrome(options=opts, service=Service(shutil.which("chromedriver")))
        args.shots.mkdir(parents=True, exist_ok=True)
        answers = {}
        idle = lambda: wait_idle(er, key, 8, args.timeout)  # noqa: E731
        snap = before
        for conn, model in (("ollama", f"{args.model}:latest"), ("openai", args.model)):
            shot = args.shots / f"openwebui-{conn}.png"
            t0 = time.monotonic()
            text = chat_in_browser(driver, ui, model, PROMPTS[conn], shot, args.timeout, idle)
            now = metrics(er, key)
            answers[conn] = {"model": model, "prompt": PROMPTS[conn], "answer": text,
                             "seconds": round(time.monotonic() - t0, 1), "screenshot": str(shot.relative_to(ROOT))
                             if shot.is_relative_to(ROOT) else str(shot), "edgerun_requests": diff(snap, now)}
            snap = now
        after = snap
    finally:
        if driver is not None:
            driver.quit()
        for p in procs[::-1]:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()

    calls = diff(before, after)
    errors = {k: v for k, v in calls.items() if not k.endswith(" 200")}
    chats = {c: sum(v for k, v in calls.items() if k.startswith(c + " "))
             for c in ("/api/chat", "/v1/chat/completions")}
    version = importlib.metadata.version("open-webui")
    same = answers["ollama"]["answer"] == answers["openai"]["answer"]
    result = {"open_webui": version, "same_answer_through_both": same, "model": args.model, "ctx": args.ctx, "builtin_tools": args.builtin_tools,
              "open_webui_start_s": round(owui_start_s, 1),
              "chats": answers, "edgerun_requests": calls, "errors": errors}
    (work / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "openwebui.json").write_text(json.dumps(result, indent=2) + "\n")

    print(f"open-webui {version}, edgerun serve --model {args.model}; Open WebUI up in {owui_start_s:.0f} s")
    for conn, a in answers.items():
        print(f"  {conn:7s} {a['model']:30s} {a['seconds']:6.1f} s  {a['answer'][:60]!r}")
        print(f"          edgerun answered: {', '.join(f'{k} x{v}' for k, v in a['edgerun_requests'].items())}")
    print(f"the two connections' answers are {'the same text' if same else 'different'}")
    print("edgerun_requests_total during the run (endpoint status: count):")
    for k, v in calls.items():
        print(f"  {k:40s} {v:5.0f}")
    failed = [c for c, n in chats.items() if n == 0]
    if failed or errors:
        print(f"error: chat routes not called: {failed}; error answers: {errors}", file=sys.stderr)
        return 1
    print(f"ok: both connections answered; screenshots in {args.shots}; logs in {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
