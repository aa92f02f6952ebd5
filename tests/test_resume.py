"""A run killed with SIGKILL resumes from last.ckpt as if it had never stopped (a real run killed and resumed: .ci/run
runs it, `-m ci`); a kill while a checkpoint is being written leaves the previous checkpoint whole."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from captioner.cli import run_lightning_cli
from tests.conftest import REPO, tiny_fit_args

STEPS_PER_EPOCH = 4  # configs/debug.yaml: limit_train_batches
EPOCHS = 3
# A schedule that changes the learning rate at every epoch (cosine over the 3 epochs: 0.01, 0.0075, 0.0025), so
# the schedule's state in last.ckpt decides the resumed run's learning rates. (A plateau schedule would only change
# it if the tiny run's scores stalled, which depends on the data.)
SCHEDULE = ["--model.decoder_lr=0.01", "--model.lr_schedule=cosine"]


def fit_process(root: Path, data: Path, *extra: str) -> subprocess.CompletedProcess:
    """`captioner fit` on configs/debug.yaml in its own process, every file under root (the data under data)."""
    args = [
        *tiny_fit_args(root, f"--trainer.max_epochs={EPOCHS}", *SCHEDULE),
        f"--data.init_args.data_dir={data}",
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # for tests.callbacks
    command = [sys.executable, "-m", "captioner.cli", "fit", *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def steps(path: Path) -> list[tuple[int, int]]:
    return [tuple(map(int, line.split())) for line in path.read_text().splitlines()]


@pytest.mark.ci
def test_a_run_killed_mid_epoch_resumes_from_last_ckpt_to_the_same_weights(tmp_path):
    data = tmp_path / "data"
    uninterrupted = run_lightning_cli(
        ["fit", *tiny_fit_args(tmp_path / "whole", f"--trainer.max_epochs={EPOCHS}", *SCHEDULE)]
    )
    weights = uninterrupted.trainer.lightning_module.state_dict()
    # the same run, killed two steps into its second epoch, after last.ckpt was written at the end of the first
    kill_at = STEPS_PER_EPOCH + 2
    record = ["--trainer.callbacks+=tests.callbacks.StepRecorder", f"--trainer.callbacks.path={tmp_path / 'steps'}"]
    killed = fit_process(tmp_path / "run", data, *record, f"--trainer.callbacks.kill_at_step={kill_at}")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    state = torch.load(last, map_location="cpu", weights_only=True)
    assert (state["epoch"], state["global_step"]) == (0, STEPS_PER_EPOCH)

    resumed = fit_process(tmp_path / "run", data, *record, "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    done = steps(tmp_path / "steps")
    first_run, second_run = done[:kill_at], done[kill_at:]
    assert first_run == [(step // STEPS_PER_EPOCH, step + 1) for step in range(kill_at)]
    # the second run starts where last.ckpt ends, at the second epoch's first step: no epoch is trained twice, and
    # only the two steps after the checkpoint are done again
    total = EPOCHS * STEPS_PER_EPOCH
    assert second_run == [(step // STEPS_PER_EPOCH, step + 1) for step in range(STEPS_PER_EPOCH, total)]
    state = torch.load(last, map_location="cpu", weights_only=True)
    assert (state["epoch"], state["global_step"]) == (EPOCHS - 1, total)
    assert state["lr_schedulers"][0]["last_epoch"] == EPOCHS  # stepped once per epoch, across the kill
    schedule = uninterrupted.trainer.lr_scheduler_configs[0].scheduler
    assert state["lr_schedulers"][0]["_last_lr"] == schedule.get_last_lr()
    logged = [row for row in csv.DictReader(next((tmp_path / "run" / "logs").rglob("version_1/metrics.csv")).open())]
    assert sorted({int(row["epoch"]) for row in logged if row.get("val/bleu4")}) == list(range(1, EPOCHS))
    # The same weights: the optimizer, the learning-rate schedule and early stopping come back from last.ckpt, and so do
    # the random generators, so the resumed epochs shuffle the data and draw dropout masks as the first run did.
    assert set(state["state_dict"]) == {name for name in weights if not name.startswith("model.encoder.")}
    for name, tensor in state["state_dict"].items():  # the frozen pretrained encoder's weights are left out
        torch.testing.assert_close(tensor, weights[name], rtol=0, atol=1e-6, msg=name)


KILL_WHILE_WRITING = """
import os, signal, sys, torch
from captioner.lightning_cli import AtomicCheckpointIO

checkpoint = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
checkpoint["global_step"] += 1  # a newer checkpoint than the one on disk
save = torch.save

def torn_save(obj, file):  # write half of the checkpoint, then die
    import io
    buffer = io.BytesIO()
    save(obj, buffer)
    file.write(buffer.getvalue()[: buffer.tell() // 2])
    file.flush()
    os.kill(os.getpid(), signal.SIGKILL)

torch.save = torn_save
AtomicCheckpointIO().save_checkpoint(checkpoint, sys.argv[1])
"""


def test_a_kill_while_a_checkpoint_is_written_leaves_the_previous_one_whole(copy_of_tiny_run):
    run = copy_of_tiny_run  # a debug run of one epoch: last.ckpt is at step 4
    last = run / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    command = [sys.executable, "-c", KILL_WHILE_WRITING, str(last)]
    killed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert last.read_bytes() == before  # untouched: the torn half went to a temporary file beside it
    assert 0 < (run / "checkpoints" / ".last.ckpt.part").stat().st_size < len(before)
    state = torch.load(last, map_location="cpu", weights_only=True)
    assert state["global_step"] == 4
    resumed = run_lightning_cli(["fit", *tiny_fit_args(run, "--trainer.max_epochs=2", "--ckpt_path=last")])
    assert resumed.trainer.global_step == 8  # `--ckpt_path last` found last.ckpt, not the torn file


def test_a_checkpoint_written_before_the_generators_states_were_a_callback_resumes_as_one_written_now(
    copy_of_tiny_run, tmp_path
):
    """The random generators' states are `RandomStates`'s, in the checkpoint's callbacks; a checkpoint written when
    the module kept them ("rng_states", beside its own) resumes to the same weights; one without them to others (the
    states decide the next epoch's shuffling and dropout)."""
    import shutil

    def resumed_from(state: dict, name: str) -> dict[str, torch.Tensor]:
        run = tmp_path / name
        shutil.copytree(copy_of_tiny_run, run)
        torch.save(state, run / "checkpoints" / "last.ckpt")
        cli = run_lightning_cli(["fit", *tiny_fit_args(run, "--trainer.max_epochs=2", "--ckpt_path=last")])
        assert cli.trainer.global_step == 2 * STEPS_PER_EPOCH
        return {k: v.clone() for k, v in cli.trainer.lightning_module.state_dict().items()}

    now = torch.load(copy_of_tiny_run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert "RandomStates" in now["callbacks"] and "rng_states" not in now
    before = {**now, "callbacks": {k: v for k, v in now["callbacks"].items() if k != "RandomStates"}}
    before["rng_states"] = now["callbacks"]["RandomStates"]["states"]
    without = {**before}
    del without["rng_states"]
    want = resumed_from(now, "now")
    got = resumed_from(before, "before")
    assert all(torch.equal(got[k], want[k]) for k in want)
    other = resumed_from(without, "without")
    assert any(not torch.equal(other[k], want[k]) for k in want)


@pytest.mark.parametrize("mode", ["random", "grouped"])
def test_a_run_that_draws_captions_resumed_at_an_epoch_s_end_ends_with_the_uninterrupted_run_s_weights(
    tmp_path, mode, monkeypatch
):
    """`train_captions: random` and `grouped` read the cache's batches ahead in a thread (prefetch 2), and each epoch
    is cut short (limit_train_batches) while that thread reads ahead, here slowly, as on a busy machine: the resumed
    run still draws the captions the uninterrupted one drew."""
    import threading
    import time

    from captioner.data.dataset import CaptionDataset

    read = CaptionDataset.__getitems__

    def slow_ahead(self, indices):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.3)
        return read(self, indices)

    monkeypatch.setattr(CaptionDataset, "__getitems__", slow_ahead)
    options = [
        f"--data.init_args.train_captions={mode}",
        "--data.init_args.captions_per_image=2",  # grouped: two of each image's five captions drawn
        "--data.init_args.train_size=48",
        "--trainer.limit_train_batches=2",  # of 3 batches of 16 images
        f"--data.init_args.data_dir={tmp_path / 'data'}",
    ]  # (no cosine schedule: its length is max_epochs, which differs between the first run's parts)

    def fit(name: str, epochs: int, *extra: str) -> dict[str, torch.Tensor]:
        args = tiny_fit_args(tmp_path / name, *options, f"--trainer.max_epochs={epochs}", *extra)
        trainer = run_lightning_cli(["fit", *args]).trainer
        assert trainer.global_step == 2 * epochs
        return {k: v.clone() for k, v in trainer.lightning_module.state_dict().items()}

    whole = fit("whole", 2)
    fit("resumed", 1)
    resumed = fit("resumed", 2, "--ckpt_path=last")
    assert whole.keys() == resumed.keys()
    for name, weight in whole.items():
        assert torch.equal(resumed[name], weight), name
