"""benchmarks/common/harness.py's process of its own, which the scripts trust for their figures: a child's peak
memory is its own high-water mark (not its parent's, which `resource` would give across the exec that starts it), a
child past its time limit is stopped, and a child that fails hands back its last line as the error."""

from __future__ import annotations

import importlib
import os

import pytest

from tests.conftest import REPO


@pytest.fixture
def harness(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    return importlib.import_module("common.harness")


def test_a_child_s_peak_memory_is_its_own_and_not_its_parent_s(harness):
    parent = harness.memory_mib(os.getpid(), "VmHWM")
    ballast = bytearray(max(0, int(600 - parent)) * 2**20 + 2**20)  # the parent's peak: over 600 MiB
    ballast[:: 2**12] = b"x" * len(ballast[:: 2**12])
    code = "data = bytearray(96 * 2**20); data[::4096] = b'x' * len(data[::4096]); print('result: {\"ok\": 1}')"
    child = harness.in_own_process(["-c", code])
    assert harness.python_result(child) == {"ok": 1}
    assert harness.memory_mib(os.getpid(), "VmHWM") > 600
    assert 96 < child.peak_mib < 300, child.peak_mib  # its 96 MiB and Python's own, not the parent's 600


def test_a_child_past_its_limit_is_stopped(harness):
    child = harness.in_own_process(["-c", "import time; time.sleep(60)"], timeout=1)
    assert child.status == "past its time limit: stopped" and child.seconds < 30


def test_a_child_that_fails_hands_back_its_last_line(harness, tmp_path):
    code = "print('result: {}'); raise ValueError('no such photo')"
    child = harness.in_own_process(["-c", code], log=tmp_path / "log")
    with pytest.raises(RuntimeError, match="ValueError: no such photo"):
        harness.python_result(child)
    assert "ValueError: no such photo" in (tmp_path / "log").read_text()
