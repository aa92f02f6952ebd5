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
