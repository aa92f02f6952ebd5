import lightning as L
import pytest
import torch

from captioner.errors import ConfigError
from captioner.precision import PRECISIONS, autocast, decoding, resolve


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


def cast_count(shape: tuple[int, ...], fn) -> int:
    """How many times running `fn` cast a tensor of `shape` to another dtype (torch profiler)."""
    with torch.profiler.profile(record_shapes=True) as profiler:
        fn()
    return sum(
        e.count
        for e in profiler.key_averages(group_by_input_shape=True)
        if e.key == "aten::_to_copy" and e.input_shapes and list(e.input_shapes[0]) == list(shape)
    )


def test_decoding_is_inference_mode_in_float32_and_casts_each_weight_once_per_block_under_autocast():
    layer, x = torch.nn.Linear(8, 16), torch.randn(4, 8)
    with decoding("32-true", "cpu"):
        assert torch.is_inference_mode_enabled() and not torch.is_autocast_enabled("cpu")
        assert layer(x).dtype == torch.float32

    def three_calls():
        with decoding("bf16-mixed", "cpu"):
            assert not torch.is_grad_enabled() and torch.is_autocast_enabled("cpu")
            assert all(layer(x).dtype == torch.bfloat16 for _ in range(3))

    assert cast_count((16, 8), three_calls) == 1  # autocast's cache kept the weight's cast (inference mode would not)
