"""Replicas behind a real nginx: deploy/nginx-edgerun.conf as shipped (its upstream pointed at two `edgerun
serve` processes on loopback), the official openai client, and a kill -9 of one replica mid-burst.

Skips, with the reason, where nginx is not installed (Debian: nginx-light; deploy/ci-deps.sh installs it).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from server_harness import TINY_ARGS, ServerProcess, clean_env

NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)
pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (Debian package nginx-light; "
                                "deploy/ci-deps.sh installs it)")
CONF = Path(__file__).resolve().parents[1] / "deploy" / "nginx-edgerun.conf"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shipped_config_for(replicas: list[int], listen: int) -> str:
    """deploy/nginx-edgerun.conf with its example upstream servers replaced by these loopback replicas."""
    text = CONF.read_text()
    servers = re.findall(r"^ *server \S+:8080 (.*);$", text, re.M)
    assert len(servers) == 2, "the shipped upstream lists two example boards"
    opts = servers[0]
    text = re.sub(r"^ *server \S+:8080 .*;\n", "", text, flags=re.M)
    lines = "".join(f"    server 127.0.0.1:{p} {opts};\n" for p in replicas)
    text = text.replace("    least_conn;\n", "    least_conn;\n" + lines)
    assert "listen 8000;" in text
    return text.replace("listen 8000;", f"listen 127.0.0.1:{listen};")


class Nginx:
    def __init__(self, root: Path, replicas: list[int]) -> None:
        self.port = free_port()
        root.mkdir(parents=True, exist_ok=True)
        (root / "conf.d").mkdir(exist_ok=True)
        (root / "conf.d" / "edgerun.conf").write_text(shipped_config_for(replicas, self.port))
        user = "user root;\n" if os.getuid() == 0 else ""
        (root / "nginx.conf").write_text(
            f"{user}worker_processes 1;\ndaemon off;\npid {root}/nginx.pid;\nerror_log {root}/error.log info;\n"
            "events { worker_connections 256; }\n"
            f"http {{\n access_log off;\n client_body_temp_path {root}/body;\n proxy_temp_path {root}/proxy;\n"
            f" fastcgi_temp_path {root}/fcgi;\n uwsgi_temp_path {root}/uwsgi;\n scgi_temp_path {root}/scgi;\n"
            f" include {root}/conf.d/*.conf;\n}}\n")
        check = subprocess.run([NGINX, "-t", "-p", str(root), "-c", str(root / "nginx.conf")], capture_output=True,
                               text=True)
        assert check.returncode == 0, check.stderr
        self.proc = subprocess.Popen([NGINX, "-p", str(root), "-c", str(root / "nginx.conf")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                assert time.monotonic() < deadline and self.proc.poll() is None, (root / "error.log").read_text()
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGQUIT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def generations(url: str) -> int:
    text = httpx.get(url + "/metrics", timeout=5).text
    return int(sum(float(m) for m in re.findall(r"^edgerun_generations_total\{[^}]*\} (\S+)$", text, re.M)))


@pytest.fixture
def fleet(tmp_path, tiny_llama):
    env = clean_env(tmp_path)
    reps = [ServerProcess(["--model", tiny_llama, *TINY_ARGS, "--port", str(free_port()), "--queue", "8"], env=env)
            for _ in range(2)]
    for r in reps:
        r.wait_ready(60)
    ports = [int(r.url.rsplit(":", 1)[1]) for r in reps]
    nginx = Nginx(tmp_path / "nginx", ports)
    nginx.model = Path(tiny_llama).stem
    yield reps, nginx
    nginx.stop()
    for r in reps:
        if r.proc.poll() is None:
            r.proc.kill()


def _client(nginx) -> openai.OpenAI:
    return openai.OpenAI(base_url=nginx.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def ask(nginx, i: int, *, stream: bool, max_tokens: int = 48):
    """('ok', text) for a complete answer, ('error', what) for one the client saw fail; a 200 that ends
    early without the stream's end (or a non-JSON body) is 'truncated', which must never happen."""
    c = _client(nginx)
    try:
        if not stream:
            r = c.completions.create(model=nginx.model, prompt=f"request {i}:", max_tokens=max_tokens, temperature=0)
            return ("ok", r.choices[0].text) if r.choices[0].finish_reason in ("length", "stop") else ("truncated", r)
        with httpx.stream("POST", nginx.url + "/v1/completions", timeout=60,
                          json={"model": nginx.model, "prompt": f"request {i}:", "max_tokens": max_tokens, "stream": True,
                                "temperature": 0}) as r:
            if r.status_code != 200:
                return "error", r.status_code
            lines = list(r.iter_lines())
        return ("ok", lines) if "data: [DONE]" in lines else ("truncated", lines)
    except (openai.APIStatusError, openai.APIConnectionError, httpx.TransportError) as e:
        return "error", type(e).__name__


def test_a_burst_spreads_over_both_replicas(fleet):
    reps, nginx = fleet
    before = [generations(r.url) for r in reps]
    with ThreadPoolExecutor(12) as ex:
        results = list(ex.map(lambda i: ask(nginx, i, stream=i % 2 == 0), range(12)))
    assert all(kind == "ok" for kind, _ in results), results
    served = [generations(r.url) - b for r, b in zip(reps, before)]
    assert sum(served) == 12 and min(served) >= 3, served       # least_conn: both take a share


def test_killing_a_replica_mid_burst_loses_no_answer_silently(fleet):
    reps, nginx = fleet
    with ThreadPoolExecutor(12) as ex:
        futures = [ex.submit(ask, nginx, i, stream=i % 2 == 0, max_tokens=200) for i in range(12)]
        deadline = time.monotonic() + 30
        while generations(reps[0].url) == 0 and time.monotonic() < deadline:   # replica 0 is mid-burst
            time.sleep(0.005)
        reps[0].proc.send_signal(signal.SIGKILL)
        burst = [f.result() for f in futures]
    assert not [r for r in burst if r[0] == "truncated"], burst
    assert any(kind == "ok" for kind, _ in burst)
    # new requests after the kill: all answered, by the surviving replica
    before = generations(reps[1].url)
    after = [ask(nginx, 100 + i, stream=i % 2 == 0) for i in range(6)]
    assert all(kind == "ok" for kind, _ in after), after
    assert generations(reps[1].url) - before == 6
