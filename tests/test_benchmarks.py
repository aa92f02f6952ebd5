"""The GPU scripts, smoke-tested on the CPU (in .ci/run: about three minutes), so that a GPU's scarce minutes are spent
measuring: benchmarks/gpu_check.py runs every part at tiny sizes (each benchmark's --smoke, tests/test_cuda.py, the
sync stretch of the fit under HostSyncs), and benchmarks/gpu.py --smoke its whole script."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.ci


def run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_the_gpu_check_runs_every_part_on_a_cpu(tmp_path):
    result = run("benchmarks/gpu_check.py", "--smoke", f"--out={tmp_path}", timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    parts = ["preflight", "fit", "one_image", "decode", "test_cuda"]
    assert [line.split(":")[0] for line in summary] == parts and all(": ok," in line for line in summary), summary
    # The fixed-shape step in a real fit of configs/coco_resnet101.yaml: nothing waits between logging steps
    fit = (tmp_path / "fit.txt").read_text()
    assert "0 host waits in 3 steps" in fit
    assert "| epoch 1: training |" in fit and "captions/s" in fit and "s per 1,000 images" in fit
    assert "| paper | compiled |" in (tmp_path / "one_image.txt").read_text()


def test_gpu_py_runs_whole_on_a_cpu():
    result = run("benchmarks/gpu.py", "--smoke", timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for title in ("training, captions/s", "beam 3, images/s", "`captioner fit --config configs/debug.yaml`"):
        assert title in result.stdout, result.stdout[-3000:]
