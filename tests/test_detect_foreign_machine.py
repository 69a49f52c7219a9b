"""A copy of a board's identity files read on another kind of machine (`profile detect --root` on an x86 host):
the board profiles match aarch64 only, so the generic profile is chosen, and detection says why instead of
silently ignoring the Jetson's or Pi's files."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgerun.device.detect import detect

FIXTURES = Path(__file__).parent / "fixtures" / "boards"


@pytest.mark.parametrize("board, model", [("jetson-orin-nano-8gb", "NVIDIA Orin Nano Developer Kit"),
                                          ("rpi5-8gb", "Raspberry Pi 5")])
def test_board_files_on_an_x86_machine_pick_generic_and_say_so(board, model, caplog):
    prof, reason = detect(FIXTURES / board, machine="x86_64", system="Linux")
    assert prof.name == "generic-x86_64-cpu"
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and model in warned[0] and "this machine is x86_64" in warned[0]
    assert "--profile NAME" in warned[0] and "warning: " in reason


def test_the_same_files_on_aarch64_pick_the_board_without_a_warning(caplog):
    prof, _ = detect(FIXTURES / "jetson-orin-nano-8gb", machine="aarch64", system="Linux")
    assert prof.name == "jetson-orin-nano-8gb"
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_an_x86_machine_without_board_files_is_not_warned(tmp_path, caplog):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text("MemTotal:       16000000 kB\n")
    prof, reason = detect(tmp_path, machine="x86_64", system="Linux")
    assert prof.name == "generic-x86_64-cpu" and "warning" not in reason
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
