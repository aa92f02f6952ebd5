"""Lightning DDP on the CPU (gloo, two processes), as a user with two GPUs runs it: corpus metrics over the whole
split, and predictions written once per image."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import torch

from captioner.cli import run_lightning_cli
from tests.conftest import REPO, tiny_fit_args

DDP = ["--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.strategy=ddp"]
ODD = ["--data.init_args.val_size=15", "--data.init_args.test_size=15"]  # the DistributedSampler pads to 16
LEARN = ["--trainer.max_epochs=8", "--model.decoder_lr=0.01"]  # enough for a val BLEU-4 of about 0.2


def captioner(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "captioner.cli", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two processes on two cores
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_ddp_logs_the_corpus_bleu_of_the_whole_split_and_predicts_each_image_once(tmp_path):
    captioner("fit", *tiny_fit_args(tmp_path, *ODD, *LEARN), *DDP)
    last = tmp_path / "checkpoints" / "last.ckpt"
    epoch = torch.load(last, map_location="cpu", weights_only=True)["epoch"]
    rows = list(csv.DictReader(next((tmp_path / "logs").rglob("metrics.csv")).open()))
    logged = [float(row["val/bleu4"]) for row in rows if row.get("val/bleu4") and int(row["epoch"]) == epoch]
    assert len(logged) == 1

    # the same checkpoint, validated in one process over the whole split
    single = run_lightning_cli(["validate", *tiny_fit_args(tmp_path, *ODD), f"--ckpt_path={last}"])
    expected = float(single.trainer.callback_metrics["val/bleu4"])
    assert expected > 0.05  # a BLEU that half the split would change (0.0 would match whatever was scored)
    assert abs(logged[0] - expected) <= 1e-6, (logged, expected)

    output = tmp_path / "predictions.jsonl"
    captioner("predict", *tiny_fit_args(tmp_path, *ODD), *DDP, f"--ckpt_path={last}", f"--predictions.output={output}")
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["index"] for r in records] == list(range(15))  # each image once, though one rank decoded 8 images
