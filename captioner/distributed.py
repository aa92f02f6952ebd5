"""What training shares between processes (DDP) and across a resume: the gather of records, the random generators,
the stop on a non-finite loss."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

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
    """The random generators that training draws from: Python's (a random caption per image) and torch's."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {"python": random.getstate(), "torch": torch.get_rng_state(), "cuda": cuda}


def set_rng_states(states: dict) -> None:
    random.setstate((states["python"][0], tuple(states["python"][1]), states["python"][2]))
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def zero_loss(module: torch.nn.Module) -> torch.Tensor:
    """A loss of zero over every trainable weight of `module`: under DDP, the loss of a process with nothing to train
    on (a batch with no readable image), where Lightning refuses None. It takes part in the gradient all-reduce like
    the other processes' losses, and its zero gradient counts as such in their average; Adam's step then still moves
    the weights a little, by its momentum."""
    return torch.stack([p.sum() for p in module.parameters() if p.requires_grad]).sum() * 0.0


class FiniteLosses:
    """Stops training on a NaN or infinite loss, every process at once with the same line, rather than train and log
    NaN to the end (a process that stopped alone would leave the others waiting in their next collective until it
    timed out).

    Training losses are summed since the last optimizer step and checked there (`check_step`): after the backward
    pass was queued (reading a loss in the step would make the host wait for the device), before the optimizer can
    write non-finite weights, and summed over the processes first (the strategy's `reduce`). A validation's or test's
    first non-finite loss is kept on the device (`add`: no read of it per batch) and said at the epoch's end
    (`check_epoch`), gathered from every process (the strategy's `all_gather`), the first in rank order: every process
    says the same line. The processes share values through Lightning's strategy, whatever it is; without one (a
    module used without a Trainer) the checks are this process's alone.

    Args:
        where: says where training is (epoch and step), for the error.
    """

    def __init__(self, where: Callable[[], str]):
        self.where = where
        self.pending: torch.Tensor | None = None  # the training losses since the last optimizer step
        self.first: torch.Tensor | None = None  # this validation's or test's first non-finite loss, or a finite one
        self.stage = "val"

    def add(self, stage: str, loss: torch.Tensor) -> None:
        loss = loss.detach()
        if stage == "train":  # accumulated batches: their sum is finite only if every loss is
            self.pending = loss if self.pending is None else self.pending + loss
        else:  # kept once it is not finite
            self.stage, first = stage, loss if self.first is None else self.first
            self.first = torch.where(torch.isfinite(first), loss, first)

    def check_step(self, strategy: Strategy | None, device: torch.device) -> None:
        loss = self.pending if self.pending is not None else torch.zeros((), device=device)
        self.pending = None
        if strategy is not None:  # every process takes part, with or without a loss of its own
            loss = strategy.reduce(loss.clone(), reduce_op="sum")  # in place: not the logged loss
        if not torch.isfinite(loss):
            raise CaptionerError(self.explain("train", loss.item()))

    def check_epoch(self, strategy: Strategy | None, device: torch.device) -> None:
        first = self.first if self.first is not None else torch.zeros((), device=device)
        self.first = None
        values = strategy.all_gather(first) if strategy is not None else first  # (processes,)
        bad = [value for value in values.reshape(-1).tolist() if not math.isfinite(value)]
        if bad:
            raise CaptionerError(self.explain(self.stage, bad[0]))

    def explain(self, stage: str, value: float) -> str:
        return (
            f"{stage}/loss is {value} at {self.where()}: the model overflowed (annotations too large for the decoder, "
            "a learning rate too high, or float16 precision: try --model.decoder_lr lower, "
            "--trainer.precision=bf16-mixed or 32, or a pretrained backbone)"
        )
