"""captioner.distributed's FiniteLosses through a strategy: what the other processes' losses do to this one's checks.
(Real DDP processes: tests/test_ddp.py, in .ci/run.)"""

import pytest
import torch

from captioner.distributed import FiniteLosses
from captioner.errors import CaptionerError


class SecondProcess:
    """Lightning's strategy as rank 0 of two sees it: rank 1's loss takes part in every reduce and gather."""

    world_size = 2

    def __init__(self, loss: float):
        self.loss, self.calls = torch.tensor(loss), []

    def reduce(self, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        self.calls.append(("reduce", reduce_op))
        return tensor.add_(self.loss)  # in place, as DDP's all_reduce

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        self.calls.append(("all_gather", None))
        return torch.stack([tensor, self.loss])


def losses() -> FiniteLosses:
    return FiniteLosses(lambda: "epoch 0, step 3")


@pytest.mark.parametrize("own", [[1.0, 2.0], []])  # two accumulated batches, or none (a batch with no image)
def test_another_process_s_non_finite_training_loss_stops_this_one_at_its_next_optimizer_step(own):
    finite, strategy = losses(), SecondProcess(float("inf"))
    logged = [torch.tensor(value) for value in own]
    for loss in logged:
        finite.add("train", loss)
    finite.check_step(strategy, torch.device("cpu"))  # reduced and copied to the host; read at the next step
    assert strategy.calls == [("reduce", "sum")] and [loss.item() for loss in logged] == own  # not changed in place
    finite.where = lambda: "epoch 0, step 4"
    with pytest.raises(CaptionerError, match=r"^train/loss is inf at epoch 0, step 3: the model overflowed"):
        finite.check_step(SecondProcess(2.0), torch.device("cpu"))  # names the step whose loss it was
    finite.add("train", torch.tensor(1.0))
    finite.check_step(SecondProcess(2.0), torch.device("cpu"))  # every process finite: it trains on
    finite.flush()
    assert finite.last_loss == 1.5  # the progress bar's: the mean of the two processes' losses


def test_the_last_training_loss_is_read_when_flushed():
    finite = losses()
    finite.add("train", torch.tensor(float("nan")))
    finite.check_step(SecondProcess(1.0), torch.device("cpu"))
    with pytest.raises(CaptionerError, match=r"^train/loss is nan at epoch 0, step 3"):
        finite.flush()
    finite.flush()  # said once


def test_the_first_non_finite_validation_loss_of_any_process_is_said_by_every_process():
    here, strategy = losses(), SecondProcess(float("nan"))
    for value in (1.0, 2.0):
        here.add("val", torch.tensor(value))
    with pytest.raises(CaptionerError, match=r"^val/loss is nan at epoch 0, step 3"):
        here.check_epoch(strategy, torch.device("cpu"))
    # rank 1's view of the same epoch: its own first non-finite loss is the one said, whatever came after it
    there = losses()
    for value in (1.0, float("nan"), float("inf"), 3.0):
        there.add("test", torch.tensor(value))
    with pytest.raises(CaptionerError, match=r"^test/loss is nan at epoch 0, step 3"):
        there.check_epoch(SecondProcess(1.0), torch.device("cpu"))
    there.add("test", torch.tensor(1.0))
    there.check_epoch(SecondProcess(1.0), torch.device("cpu"))  # the next epoch starts afresh
