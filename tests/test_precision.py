import lightning as L
import pytest
import torch

from captioner.errors import ConfigError
from captioner.precision import PRECISIONS, autocast, resolve


@pytest.mark.filterwarnings("ignore:.*not supported on CPU")  # 16-mixed: both warn, as tested below
@pytest.mark.parametrize("precision", PRECISIONS)
def test_each_precision_runs_on_cpu_as_lightnings_trainer_runs_it(precision):
    trainer = L.Trainer(precision=precision, accelerator="cpu", logger=False, enable_checkpointing=False)
    assert resolve(precision, "cpu") == trainer.precision


def test_mixed_precision_autocasts_matmuls_and_32_true_does_not():
    x = torch.randn(4, 8)
    with autocast("bf16-mixed", "cpu"):
        assert (x @ x.T).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")
    with autocast("32-true", torch.device("cpu")):
        assert (x @ x.T).dtype == torch.float32


def test_16_mixed_on_cpu_warns_and_runs_in_bfloat16():
    with pytest.warns(UserWarning, match="using bf16-mixed"), autocast("16-mixed", "cpu"):
        assert (torch.randn(4, 8) @ torch.randn(8, 4)).dtype == torch.bfloat16


def test_unknown_precision_is_refused():
    with pytest.raises(ConfigError, match="unknown precision 'bf16'; choose one of 32-true, bf16-mixed, 16-mixed"):
        autocast("bf16", "cpu")
