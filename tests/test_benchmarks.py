"""The benchmark scripts, smoke-tested on the CPU (in .ci/run), so that a GPU's scarce minutes are spent measuring and
a table's command works when someone reruns it: benchmarks/gpu_check.py runs every part at tiny sizes (each
benchmark's --smoke, tests/test_cuda.py, the fit's host-wait stretch under HostSyncs), and one_image.py,
onnx_runtime.py, train_step.py, resize.py and browser.py run whole; in each, a form made to fail is a row with its
error, and the table goes on."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.ci
TORCH = ["torch, eager", "torch, compiled", "torch, compiled, encoder too"]
ONNX = ["onnx, float", "onnx, float, exact resize", "onnx, float16", "onnx, int8 step", "onnx, int8 all"]
FORMS = [TORCH[0], *ONNX]  # onnx_runtime.py's


def run(*args: str, timeout: float, fail: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {**os.environ, "BENCHMARKS_FAIL": "|".join(fail)}
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


def rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_gpu_check_runs_every_part_on_a_cpu_and_a_form_that_fails_is_a_row(tmp_path):
    fail = (
        "torch, compiled, encoder too",  # one_image.py
        "compile_decoder, a graph per 8 words (its default)",  # decode.py's tutorial table
        "the same steps alone: the fit's batches, on the device",  # fit.py, in the fit's own process
    )
    result = run("benchmarks/gpu_check.py", "--smoke", f"--out={tmp_path}", timeout=600, fail=fail)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = rows(tmp_path / "summary.jsonl")
    parts = ["preflight", "one_image", "decode", "fit", "test_cuda", "onnx_cuda"]
    assert [row["part"] for row in summary] == parts and all(row["status"] == "ok" for row in summary), summary
    made_to_fail = "RuntimeError: made to fail"
    # one_image: torch's forms; the failing form is a row with its error; the others, both models, are measured
    images = {(row["model"], row["form"]): row for row in rows(tmp_path / "one_image.jsonl")}
    assert len(images) == 6 and images["shapes", fail[0]]["error"].startswith(made_to_fail)
    assert all("1 image p50, ms" in row for key, row in images.items() if key[1] != fail[0])
    # decode: every form a row, as measured (before the table is printed whole), the failing one with its error;
    # the whole search compiled as one graph writes the eager search's captions
    searches = {row["beam 3"]: row for row in rows(tmp_path / "tutorial.jsonl")}
    assert len(searches) == 5 and searches[fail[1]]["error"].startswith(made_to_fail)
    assert searches["compile_decoder, the whole search one graph (check_every=16)"]["captions as eager"] == "same"
    output = (tmp_path / "decode.txt").read_text()
    assert output.index('row: {"beam 3": "tutorial') < output.index("| beam 3 | batch 1 |")
    # fit: the rows of its phases, written by the fit's process as each ended; the bare steps' row is an error and
    # the timed epoch, its validation and the projection are there; no host waits in the watched steps
    fit = {row["phase"]: row for row in rows(tmp_path / "fit_phases.jsonl") + rows(tmp_path / "fit.jsonl")}
    assert fit[fail[2]]["error"].startswith(made_to_fail)
    assert "captions/s" in fit["epoch 1: training"]["figure"] and "epoch 1: validation (8 images)" in fit
    assert any(phase.startswith("projected: the paper's schedule") for phase in fit)
    assert "0 host waits in 3 steps" in (tmp_path / "fit.txt").read_text()
    assert "wall" in (tmp_path / "fit_profile.txt").read_text()
    # onnx_cuda: on a machine without CUDA, torch's row and the export's say so
    cuda = {row["form"]: row["error"] for row in rows(tmp_path / "onnx_cuda.jsonl")}
    assert cuda == dict.fromkeys(["torch, eager", "onnx, float"], "not measured: no CUDA device"), cuda


def test_train_step_py_runs_whole_on_a_cpu_and_a_form_that_fails_is_a_row(tmp_path):
    result = run("benchmarks/train_step.py", "--smoke", f"--out={tmp_path}", timeout=300, fail=("tutorial",))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    forms = {row["form"]: row for row in rows(tmp_path / "train_step.jsonl")}
    grouped = ["grouped, a copy per caption", "grouped, each image once"]
    assert list(forms) == ["tutorial", "eager", "fixed shapes", "compiled", *grouped]
    assert forms["tutorial"]["error"].startswith("RuntimeError: made to fail")
    assert all("captions/s" in forms[form] for form in ("eager", "fixed shapes", "compiled", *grouped))
    assert "x a copy per caption" in forms["grouped, each image once"]


def test_one_image_py_measures_every_form_of_a_model_and_a_form_that_fails_is_a_row(tmp_path):
    result = run("benchmarks/one_image.py", "--smoke", "--models=shapes", f"--out={tmp_path}", timeout=600,
                 fail=("onnx, int8 all",))  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    latency = {row["form"]: row for row in rows(tmp_path / "one_image.jsonl")}
    assert list(latency) == TORCH + ONNX
    assert latency["onnx, int8 all"]["error"].startswith("RuntimeError: made to fail")
    measured = [row for form, row in latency.items() if form != "onnx, int8 all"]
    assert all("1 image p50, ms" in row and "8 images, ms" in row and "error" not in row for row in measured)


def test_onnx_runtime_py_measures_every_form_and_a_form_that_fails_is_a_row(tmp_path):
    result = run("benchmarks/onnx_runtime.py", "--smoke", f"--out={tmp_path}", timeout=600, fail=("onnx, int8 all",))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    quality = {row["form"]: row for row in rows(tmp_path / "onnx_quality.jsonl")}
    assert list(quality) == FORMS
    assert quality["onnx, int8 all"]["error"].startswith("RuntimeError: made to fail")
    # the float export writes torch's captions (tests/test_onnx.py: word for word), so it scores the same
    assert quality["onnx, float, exact resize"]["captions unchanged"] == "1.000"
    assert quality["onnx, float, exact resize"]["CIDEr-D"] == quality["torch, eager"]["CIDEr-D"]
    assert (
        quality["onnx, float"]["as the float export's"] == "1.000" and quality["onnx, float16"]["as the float export's"]
    )
    # the profile, phase by phase, for torch and the float export; the float export under each thread option
    profile = {row["form"]: row for row in rows(tmp_path / "onnx_profile.jsonl")}
    assert list(profile) == FORMS[:3]
    assert all(float(row[f"{phase}, ms"]) > 0 for row in profile.values() for phase in ("resize", "encoder", "search"))
    options = [
        (row["threads"], row["spinning"], "1 image p50, ms" in row) for row in rows(tmp_path / "onnx_threads.jsonl")
    ]
    assert options == [(1, False, True), (1, True, True), (2, False, True), (2, True, True)]


def test_resize_py_measures_both_forms_and_a_form_that_fails_is_a_row(tmp_path):
    result = run("benchmarks/resize.py", "--smoke", f"--out={tmp_path}", timeout=300, fail=("torchvision (v2.Resize)",))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    forms = {row["form"]: row for row in rows(tmp_path / "resize.jsonl")}
    assert list(forms) == ["numpy (captioner.onnx.resize)", "Pillow (Image.resize)", "torchvision (v2.Resize)"]
    assert forms["torchvision (v2.Resize)"]["error"].startswith("RuntimeError: made to fail")
    numpy = forms["numpy (captioner.onnx.resize)"]
    assert numpy["ms"] > 0 and numpy["peak extra, MiB"] >= 0 and numpy["photo, MiB (uint8)"] == 0.3


@pytest.mark.ci
@pytest.mark.skipif(shutil.which("chromium") is None, reason="no chromium on this machine (apt-get install chromium)")
@pytest.mark.skipif(not (REPO / ".web").is_dir(), reason="no onnxruntime-web in .web/ (npm install --prefix .web ...)")
def test_browser_py_measures_the_page_beside_python_and_a_form_that_fails_is_a_row(tmp_path):
    result = run("benchmarks/browser.py", "--models=shapes", "--smoke", f"--out={tmp_path}", timeout=600,
                 fail=("torch, eager",))  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (size,) = rows(tmp_path / "browser_size.jsonl")
    assert float(size["folder"]) > float(size["ONNX Runtime Web"]) > 0
    speed = {row["form"]: row for row in rows(tmp_path / "browser_latency.jsonl")}
    assert list(speed) == ["browser, not isolated", "browser, cross-origin isolated",
                           "captioner.onnx (ONNX Runtime, Python)", "torch, eager"]  # fmt: skip
    assert speed["browser, not isolated"]["threads"] == 1 <= speed["browser, cross-origin isolated"]["threads"]
    assert all(float(row["first caption, ms"]) > float(row["later p50, ms"]) > 0 for row in list(speed.values())[:3])
    assert speed["torch, eager"]["error"].startswith("RuntimeError: made to fail")
