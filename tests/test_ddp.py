"""Lightning DDP on the CPU (gloo, two processes), as a user with two GPUs runs it: corpus metrics over the whole
split, predictions written once per image, and batches in which no image can be read skipped by one process while
the other trains on. Real DDP runs, slow by nature: .ci/run runs them (`-m ci`), not `make test`."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from captioner.cli import run_lightning_cli
from captioner.data.shapes import ShapesDataset
from tests.conftest import REPO, tiny_fit_args

pytestmark = pytest.mark.ci

DDP = ["--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.strategy=ddp"]
# Batches of 2 images read from PNG files (some broken, below); the DistributedSampler pads val and test's 15 to 16.
DATA = [
    "--data.init_args.val_size=15",
    "--data.init_args.test_size=15",
    "--data.init_args.batch_size=2",
    "--data.init_args.cache_images=true",
    "--trainer.limit_val_batches=1.0",  # every batch (debug.yaml validates 2)
]
LEARN = ["--trainer.max_epochs=8", "--trainer.limit_train_batches=16", "--model.decoder_lr=0.01"]  # val BLEU-4 ~0.2
CAPTIONS_PER_IMAGE = 5  # shapes; debug.yaml trains on every (image, caption) pair


def captioner(*args: str, status: int = 0, timeout: float = 600) -> subprocess.CompletedProcess:
    """`captioner ...` in a process of its own. It returns once every process that shares its output has ended (the
    other DDP ranks too)."""
    command = [sys.executable, "-m", "captioner.cli", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}  # two processes on two cores; tests.callbacks
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == status, result.stderr[-3000:]
    return result


def break_images(data_dir, split: str, size: int, indices: set[int]) -> None:
    """Write a broken PNG where the shapes set keeps image `index` of `split` (cache_images): it cannot be read."""
    identity = ShapesDataset(split, size).identity
    for index in indices:
        path = data_dir / "images" / f"{identity}-{index:06d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\x89PNG\r\n\x1a\n truncated")


def first_batches(items: int, batch_size: int, seed: int = 0) -> list[list[int]]:
    """The items of each rank's first training batch at epoch 0: Lightning's DistributedSampler shuffles with
    randperm seeded by seed + epoch (the seed_everything seed), and rank r takes every second item from r."""
    order = torch.randperm(items, generator=torch.Generator().manual_seed(seed)).tolist()
    return [order[rank::2][:batch_size] for rank in range(2)]


def test_ddp_scores_the_whole_split_predicts_each_image_once_and_skips_a_rank_s_unreadable_batch(tmp_path):
    data = tmp_path / "data"
    # Rank 1's first training batch, and its first validation and test batches (images 1 and 3), are all broken files,
    # while rank 0's first batches are whole: one process skips its batch as the other trains and scores on.
    rank0, rank1 = ({i // CAPTIONS_PER_IMAGE for i in items} for items in first_batches(64 * CAPTIONS_PER_IMAGE, 2))
    assert rank0.isdisjoint(rank1)
    break_images(data, "train", 64, rank1)
    break_images(data, "val", 15, {1, 3})
    break_images(data, "test", 15, {1, 3})

    captioner("fit", *tiny_fit_args(tmp_path, *DATA, *LEARN), *DDP)
    last = tmp_path / "checkpoints" / "last.ckpt"
    state = torch.load(last, map_location="cpu", weights_only=True)
    assert state["epoch"] == 7 and state["global_step"] == 8 * 16  # every step of every epoch, on both ranks
    rows = list(csv.DictReader(next((tmp_path / "logs").rglob("metrics.csv")).open()))
    logged = [float(row["val/bleu4"]) for row in rows if row.get("val/bleu4") and int(row["epoch"]) == 7]
    assert len(logged) == 1

    # the same checkpoint, validated in one process over the whole split (the same two images unreadable)
    single = run_lightning_cli(["validate", *tiny_fit_args(tmp_path, *DATA), f"--ckpt_path={last}"])
    expected = float(single.trainer.callback_metrics["val/bleu4"])
    assert expected > 0.05  # a BLEU that half the split would change (0.0 would match whatever was scored)
    assert abs(logged[0] - expected) <= 1e-6, (logged, expected)

    # Self-critical training from that checkpoint, in two processes: each rewards the captions of its own images,
    # and the corpus metrics are gathered as in cross-entropy training.
    scst = ["--model.objective=scst", f"--model.init_from={last}", "--data.init_args.train_captions=random"]
    steps = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=4"]
    captioner("fit", *tiny_fit_args(tmp_path / "scst", *DATA, *scst, *steps, f"--data.init_args.data_dir={data}"), *DDP)
    scst_last = tmp_path / "scst" / "checkpoints" / "last.ckpt"
    rows = list(csv.DictReader(next((tmp_path / "scst" / "logs").rglob("metrics.csv")).open()))
    assert [int(row["epoch"]) for row in rows if row.get("train/loss_epoch")] == [0]  # it trained
    logged = [float(row["val/cider"]) for row in rows if row.get("val/cider")]
    single = run_lightning_cli(
        [
            "validate",
            *tiny_fit_args(tmp_path / "scst", *DATA, f"--data.init_args.data_dir={data}"),
            f"--ckpt_path={scst_last}",
        ]
    )
    assert logged and abs(logged[-1] - float(single.trainer.callback_metrics["val/cider"])) <= 1e-6

    output = tmp_path / "predictions.jsonl"
    captioner("predict", *tiny_fit_args(tmp_path, *DATA), *DDP, f"--ckpt_path={last}", f"--predictions.output={output}")
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["index"] for r in records] == [i for i in range(15) if i not in (1, 3)]  # each readable image once


@pytest.mark.parametrize("stage", ["train", "val"])
def test_a_non_finite_loss_in_one_process_stops_every_process_at_once_with_one_line(tmp_path, stage):
    """A NaN in rank 1's batch alone: rank 0's loss is finite, yet both stop with the same line, within seconds, rather
    than rank 0 waiting in a collective for a process that has gone (gloo's timeout is 30 minutes)."""
    step = 1 if stage == "train" else 0  # a process's second training step, or its one validation batch
    poison = ["--trainer.callbacks+=tests.callbacks.PoisonBatch", f"--trainer.callbacks.stage={stage}"]
    poison.append(f"--trainer.callbacks.step={step}")
    start = time.monotonic()
    result = captioner("fit", *tiny_fit_args(tmp_path, *poison), *DDP, status=2, timeout=300)
    assert time.monotonic() - start < 120  # both processes started, trained a step and stopped
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors and errors[0].startswith(f"error: {stage}/loss is nan at epoch 0, step "), result.stderr[-3000:]
    assert result.stderr.count(errors[0]) == 2 and "Traceback" not in result.stderr  # the same line from each
    assert "GPU available" in result.stderr and "Tip" not in result.stderr  # Lightning's lines, not its advertisements


def test_under_ddp_the_encoded_splits_and_cider_s_frequencies_are_made_once_and_a_later_run_reads_them(tmp_path):
    """The shipped configs/coco_lite0.yaml on a Karpathy file of real photos, two processes, self-critical training:
    each split's file (data_dir/splits/) and CIDEr-D's document frequencies (cider-*.npz) are written once, by one
    process while the other waits, and a second run of two processes reads them rather than making them again."""
    from tests.data.test_coco import fit_args
    from tests.datasets import write_karpathy

    write_karpathy(tmp_path)
    args = [*fit_args(tmp_path, "configs/coco_lite0.yaml", "--model.objective=scst"), *DDP]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}

    def fit() -> dict[str, tuple[int, int]]:
        command = [sys.executable, "-m", "captioner.cli", *args]
        result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        made = [*(tmp_path / "splits").glob("*.npz"), *tmp_path.glob("cider-*.npz")]
        return {path.name: (path.stat().st_ino, path.stat().st_mtime_ns) for path in made}

    first = fit()
    assert sorted(name.split("-")[0] for name in first) == ["cider", *[tmp_path.name] * 3]  # train, val, test
    assert fit() == first  # the same files, none written again
