"""Callbacks that tests add to a real `captioner fit` process with --trainer.callbacks+=..."""

from __future__ import annotations

import os
import signal

from lightning.pytorch.callbacks import Callback


class StepRecorder(Callback):
    """Appends "epoch global_step" to `path` after every training step. With `kill_at_step`, it then kills its own
    process with SIGKILL right after that step: no handler, no cleanup, as when a node is preempted or OOM-killed.

    Args:
        path: the file of steps.
        kill_at_step: the global step after which to die (0: never).
    """

    def __init__(self, path: str, kill_at_step: int = 0):
        self.path, self.kill_at_step = path, kill_at_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        with open(self.path, "a") as file:
            file.write(f"{trainer.current_epoch} {trainer.global_step}\n")
        if trainer.global_step == self.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)


class PoisonBatch(Callback):
    """Fills one process's input annotations with NaN at one step, as an overflow on one GPU would make them.

    Args:
        rank: the process whose batch is poisoned.
        stage: "train" (the training batch of global step `step`) or "val" (the validation batch `step`).
        step: which batch.
    """

    def __init__(self, rank: int = 1, stage: str = "train", step: int = 1):
        self.rank, self.stage, self.step = rank, stage, step

    def _poison(self, trainer, batch, index: int) -> None:
        if trainer.global_rank == self.rank and index == self.step and "annotations" in batch:
            batch["annotations"].fill_(float("nan"))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.stage == "train":
            self._poison(trainer, batch, trainer.global_step)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if self.stage == "val" and not trainer.sanity_checking:
            self._poison(trainer, batch, batch_idx)
