"""What training shares between processes (DDP) and across a resume: the gather of records, the random generators,
the stop on a non-finite loss."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from captioner.errors import CaptionerError

if TYPE_CHECKING:
    from lightning.pytorch.strategies import Strategy


def distributed() -> bool:
    """Whether this process is one of several (DDP)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def gather(records: list) -> list:
    """Every rank's `records`, concatenated in rank order (under DDP; otherwise `records` itself). Records are Python
    objects (captions, random generators' states), which Lightning's strategies do not gather (their `all_gather`
    takes tensors): torch.distributed's all_gather_object does, in the process group that DDP, FSDP and DeepSpeed
    all run in."""
    if not distributed():
        return records
    everyone: list[list | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, records)
    return [record for part in everyone for record in part]


def rng_states() -> dict:
    """The random generators that training draws from: Python's (each epoch's seed of the caption draws) and torch's."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {"python": random.getstate(), "torch": torch.get_rng_state(), "cuda": cuda}


def set_rng_states(states: dict) -> None:
    random.setstate((states["python"][0], tuple(states["python"][1]), states["python"][2]))
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class RandomStates(Callback):
    """Every process's random generators (Python's, which seeds each epoch's caption draws; torch's and CUDA's, which
    shuffle and drop out), kept in each checkpoint and put back when a fit resumes from it: a run resumed from an
    epoch's end shuffles, draws and drops out as the first would have, and ends with the same weights
    (tests/test_resume.py). The states go back at the fit's start (after Lightning's sanity check, which runs on a
    copy of them), not when a checkpoint is loaded for testing or captioning. On by default:
    `CaptioningModule.configure_callbacks` gives it to any Trainer of the module. A checkpoint written before it was
    a callback kept the states beside the module's ("rng_states"): those are read too."""

    def __init__(self):
        self.saved: list[dict] | None = None  # from the checkpoint being resumed: one per process of its run

    def state_dict(self) -> dict:
        return {"states": gather([rng_states()])}  # every process takes part; rank 0 writes the file

    def load_state_dict(self, state_dict: dict) -> None:
        self.saved = state_dict["states"]

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if self.saved is None and "rng_states" in checkpoint:  # a checkpoint written before this callback
            self.saved = checkpoint["rng_states"]

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.saved is not None:
            set_rng_states(self.saved[trainer.global_rank % len(self.saved)])
            self.saved = None


def zero_loss(module: torch.nn.Module) -> torch.Tensor:
    """A loss of zero over every trainable weight of `module`: under DDP, the loss of a process with nothing to train
    on (a batch with no readable image), where Lightning refuses None. It takes part in the gradient all-reduce like
    the other processes' losses, and its zero gradient counts as such in their average; Adam's step then still moves
    the weights a little, by its momentum."""
    return torch.stack([p.sum() for p in module.parameters() if p.requires_grad]).sum() * 0.0


class FiniteLosses:
    """Stops training on a NaN or infinite loss, every process at once with the same line, rather than train and log
    NaN to the end (a process that stopped alone would leave the others waiting in their next collective until it
    timed out). No checkpoint is ever written after a non-finite training loss.

    Training losses are summed since the last optimizer step (`add`), and at the optimizer step (`check_step`), after
    the backward pass was queued, summed over the processes (the strategy's `reduce`) and copied to the host without
    waiting for the device (on CUDA, into pinned memory, with an event recorded behind the copy). That copy is read at
    the next optimizer step, by when the device has long finished the step it comes from while the host has queued the
    next one: the host never waits for the device here, and the device never runs dry. (Reading the loss at its own
    step would make the host wait for the whole step at every step.) A bad loss is said one step late, naming its own
    step; every process reads the same reduced sum, so every process stops at the same step. Before anything trusts
    the weights, the last copy is read at once (`flush`: before a checkpoint is written, before validation, at
    training's end), so a checkpoint never holds weights a bad step wrote.

    A validation's or test's first non-finite loss is kept on the device (`add`: no read of it per batch) and said at
    the epoch's end (`check_epoch`), gathered from every process (the strategy's `all_gather`), the first in rank
    order: every process says the same line. The processes share values through Lightning's strategy, whatever it
    is; without one (a module used without a Trainer) the checks are this process's alone.

    Args:
        where: says where training is (epoch and step), for the error.
    """

    def __init__(self, where: Callable[[], str]):
        self.where = where
        self.pending: torch.Tensor | None = None  # the training losses since the last optimizer step
        self.batches = 0  # how many
        self.first: torch.Tensor | None = None  # this validation's or test's first non-finite loss, or a finite one
        self.stage = "val"
        self.host: torch.Tensor | None = None  # the last optimizer step's summed loss, copied to the host
        self._copied: tuple[torch.cuda.Event | None, str, int] | None = None  # (its copy's event, where, losses summed)
        self.last_loss: float | None = None  # the mean training loss of the last step read (the progress bar's)

    def add(self, stage: str, loss: torch.Tensor) -> None:
        loss = loss.detach()
        if stage == "train":  # accumulated batches: their sum is finite only if every loss is
            self.pending = loss if self.pending is None else self.pending + loss
            self.batches += 1
        else:  # kept once it is not finite
            self.stage, first = stage, loss if self.first is None else self.first
            self.first = torch.where(torch.isfinite(first), loss, first)

    def check_step(self, strategy: Strategy | None, device: torch.device) -> None:
        """At an optimizer step: raises if the previous step's loss was not finite, then queues this step's copy."""
        loss = self.pending if self.pending is not None else torch.zeros((), device=device)
        count, self.pending, self.batches = self.batches, None, 0
        processes = 1
        if strategy is not None:  # every process takes part, with or without a loss of its own
            loss = strategy.reduce(loss.clone(), reduce_op="sum")  # in place: not the logged loss
            processes = getattr(strategy, "world_size", 1)  # a single-device strategy has none
        self.flush()
        if self.host is None or self.host.dtype != loss.dtype:
            self.host = torch.empty((), dtype=loss.dtype, pin_memory=loss.is_cuda)  # allocated once
        # On CUDA the copy is queued behind the step and the host goes on; elsewhere it is made now.
        self.host.copy_(loss, non_blocking=loss.is_cuda)
        event = None
        if loss.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self._copied = (event, self.where(), count * processes)

    def flush(self) -> None:
        """Reads the last optimizer step's copied loss (waiting for the device to have made it, if it has not yet)
        and raises if it was not finite. Called by the next step, and before anything trusts the weights."""
        if self._copied is None:
            return
        event, where, count = self._copied
        self._copied = None
        if event is not None:
            event.synchronize()  # the step's own work, not the steps queued since
        value = self.host.item()  # a host tensor: no read of the device
        if not math.isfinite(value):
            raise CaptionerError(self.explain("train", value, where))
        self.last_loss = value / count if count else None

    def check_epoch(self, strategy: Strategy | None, device: torch.device) -> None:
        first = self.first if self.first is not None else torch.zeros((), device=device)
        self.first = None
        values = strategy.all_gather(first) if strategy is not None else first  # (processes,)
        bad = [value for value in values.reshape(-1).tolist() if not math.isfinite(value)]
        if bad:
            raise CaptionerError(self.explain(self.stage, bad[0]))

    def explain(self, stage: str, value: float, where: str | None = None) -> str:
        return (
            f"{stage}/loss is {value} at {where or self.where()}: the model overflowed (annotations too large for the "
            "decoder, a learning rate too high, or float16 precision: try --model.decoder_lr lower, "
            "--trainer.precision=bf16-mixed or 32, or a pretrained backbone)"
        )
