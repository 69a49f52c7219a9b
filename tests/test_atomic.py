"""edgerun/util/atomic.py: a stopped writer commits nothing, even when its first SystemExit was lost."""

import os
import signal
import time

import pytest

from edgerun.util import atomic


@pytest.fixture
def stop_handler(monkeypatch):
    old = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(atomic, "_stop_signal", None)
    atomic.stop_on_signal()
    yield
    signal.signal(signal.SIGTERM, old)


def _swallowed_sigterm():
    """SIGTERM arriving where Python drops the exception (a __del__, a ctypes callback from llama.cpp)."""
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
    except SystemExit:
        pass


def test_a_swallowed_sigterm_still_stops_the_commit(stop_handler, tmp_path):
    dest = tmp_path / "m.gguf"
    with pytest.raises(SystemExit) as e:
        with atomic.atomic_path(dest) as tmp:
            tmp.write_bytes(b"half")
            _swallowed_sigterm()
            tmp.write_bytes(b"looks complete")
    assert e.value.code == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []             # neither the destination nor the temporary


def test_a_swallowed_sigterm_still_stops_a_directory_export(stop_handler, tmp_path):
    dest = tmp_path / "export"
    with pytest.raises(SystemExit):
        with atomic.atomic_dir(dest) as tmp:
            (tmp / "model.onnx").write_bytes(b"x")
            _swallowed_sigterm()
    assert list(tmp_path.iterdir()) == []


def test_without_a_stop_the_file_is_committed(stop_handler, tmp_path):
    dest = tmp_path / "m.gguf"
    with atomic.atomic_path(dest) as tmp:
        tmp.write_bytes(b"ok")
    assert dest.read_bytes() == b"ok" and list(tmp_path.iterdir()) == [dest]
    atomic.raise_if_stopped()                          # no stop requested: a no-op
