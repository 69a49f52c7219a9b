"""`edgerun serve` as systemd runs it: sd_notify readiness and watchdog on a real notify socket,
SIGTERM in the middle of a stream (clean end of the stream, exit 0), and start-up failures (exit 2)."""

from __future__ import annotations

import os
import secrets
import socket
import threading

import httpx
import pytest

from server_harness import TINY_ARGS, ServerProcess, clean_env, sse_events, wait_until


class NotifyListener:
    """An AF_UNIX datagram socket in the abstract namespace, like systemd's NOTIFY_SOCKET."""

    def __init__(self) -> None:
        self.name = f"edgerun-test-{os.getpid()}-{secrets.token_hex(4)}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.name)
        self.sock.settimeout(0.2)
        self.messages: list[str] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def env_value(self) -> str:
        return "@" + self.name

    def _run(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                continue
            self.messages.extend(data.decode().splitlines())

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)
        self.sock.close()


@pytest.fixture()
def notify():
    listener = NotifyListener()
    yield listener
    listener.close()


@pytest.mark.parametrize("parallel", [1, 4], ids=["parallel1", "parallel4"])
def test_sigterm_mid_stream_ends_the_stream_cleanly_and_exits_zero(tiny_llama, tmp_path, notify, parallel):
    env = clean_env(tmp_path, NOTIFY_SOCKET=notify.env_value, WATCHDOG_USEC="300000")
    srv = ServerProcess(["--model", tiny_llama, *TINY_ARGS, "--shutdown-grace", "0", "--parallel", parallel], env=env)
    try:
        srv.wait_ready()
        wait_until(lambda: "READY=1" in notify.messages, what="READY=1")
        wait_until(lambda: notify.messages.count("WATCHDOG=1") >= 2, what="watchdog pings")
        assert any(m.startswith("STATUS=loading") for m in notify.messages)
        assert notify.messages.index("READY=1") > next(i for i, m in enumerate(notify.messages)
                                                      if m.startswith("STATUS=loading"))
        body = {"model": str(tiny_llama), "prompt": "held", "max_tokens": 200, "temperature": 0, "stream": True}
        lines = []
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            it = r.iter_lines()
            for line in it:
                lines.append(line)
                if line.startswith("data: "):
                    break                           # the first token is out: now stop the service
            srv.proc.send_signal(15)
            lines.extend(it)                        # the stream must still end properly
        rc = srv.wait_exit(60)
    finally:
        srv.terminate()
    assert rc == 0, srv.output
    events = sse_events(lines)
    assert events[-1] == "[DONE]"
    last = events[-2]
    if "error" in last:                             # cancelled by the drain (grace 0)
        assert last["error"]["code"] == "shutting_down"
    else:                                           # or it had finished already
        assert last["choices"][0]["finish_reason"] in ("stop", "length")
    assert "STOPPING=1" in notify.messages
    assert "shutting down" in srv.output and "Traceback" not in srv.output


def test_model_that_fails_to_load_exits_2(tmp_path, notify):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"this is not a GGUF file" * 10)
    srv = ServerProcess(["--model", broken, *TINY_ARGS], env=clean_env(tmp_path, NOTIFY_SOCKET=notify.env_value))
    rc = srv.wait_exit(60)
    assert rc == 2, srv.output
    assert srv.output.splitlines()[-1].startswith("error: "), srv.output
    assert "Traceback" not in srv.output
    assert any(m.startswith("STATUS=failed to load") for m in notify.messages)
    assert "READY=1" not in notify.messages


def test_unknown_model_fails_before_binding(tmp_path):
    srv = ServerProcess(["--model", "no-such-model-anywhere", *TINY_ARGS], env=clean_env(tmp_path),
                        wait_listening=False)
    rc = srv.wait_exit(60)
    assert rc == 2 and "error: " in srv.output and "listening" not in srv.output, srv.output


def test_port_in_use_is_a_clean_error(tiny_llama, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        srv = ServerProcess(["--model", tiny_llama, *TINY_ARGS, "--port", port], env=clean_env(tmp_path),
                            wait_listening=False)
        rc = srv.wait_exit(60)
    assert rc == 2 and "cannot listen on 127.0.0.1:%d" % port in srv.output, srv.output


def test_uncached_model_with_no_pull_exits_2_after_binding(tmp_path):
    """A registry model passes the pre-bind check (it could be pulled); with --no-pull and an empty
    cache the background load fails, and the server stops with the load error."""
    srv = ServerProcess(["--model", "smollm2-135m-instruct", "--no-pull", *TINY_ARGS], env=clean_env(tmp_path))
    rc = srv.wait_exit(60)
    assert rc == 2 and "edgerun pull smollm2-135m-instruct" in srv.output, srv.output


def test_the_watchdog_probe_asks_the_servers_own_socket(tiny_llama, tmp_path):
    """Issue 20, defect 1: the watchdog also withholds its ping when the HTTP side stops answering; its
    probe is a real GET /health on the bound socket."""
    import asyncio
    import socket

    from edgerun.serve.app import http_answers

    srv = ServerProcess(["--model", tiny_llama, *TINY_ARGS], env=clean_env(tmp_path))
    try:
        host, port = srv.url.rsplit("//", 1)[1].rsplit(":", 1)
        assert asyncio.run(http_answers(host, int(port), timeout=5))          # answering (loading or ready)
    finally:
        assert srv.terminate() == 0, srv.output
    with socket.socket() as s:                  # a port that accepts nothing: no answer
        s.bind(("127.0.0.1", 0))
        s.listen(0)
        silent_port = s.getsockname()[1]
        assert not asyncio.run(http_answers("127.0.0.1", silent_port, timeout=1))
    assert not asyncio.run(http_answers("127.0.0.1", silent_port, timeout=1))    # closed: refused
