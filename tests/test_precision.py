import types
import warnings

import lightning as L
import pytest
import torch

from captioner import precision as precision_module
from captioner.errors import ConfigError
from captioner.precision import PRECISIONS, autocast, cast_weights_once, cpu_has_fast_bfloat16, decoding, resolve
from tests.conftest import cast_count


@pytest.mark.filterwarnings("ignore:.*not supported on CPU")  # 16-mixed: both warn, as tested below
@pytest.mark.filterwarnings("ignore:bf16-mixed emulates bfloat16")  # on CPUs without it; tested below
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


def test_cast_weights_once_in_lightnings_eval_loops_and_nothing_elsewhere():
    layer, x = torch.nn.Linear(8, 16), torch.randn(4, 8)

    def three_calls():  # as in Lightning's validate loop: inference mode, and an autocast with its cache off
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            with cast_weights_once("cpu"):
                assert not torch.is_inference_mode_enabled() and not torch.is_grad_enabled()
                assert all(layer(x).dtype == torch.bfloat16 for _ in range(3))
            assert layer(x).dtype == torch.bfloat16  # after the block: autocast's own, uncached cast again

    assert cast_count((16, 8), three_calls) == 2
    with torch.inference_mode(), cast_weights_once("cpu"):  # no autocast: nothing to cache, nothing changes
        assert torch.is_inference_mode_enabled()
    with autocast("bf16-mixed", "cpu"), cast_weights_once("cpu"):  # autograd on (training): nothing changes
        assert torch.is_grad_enabled()
        assert layer(x).requires_grad


def test_bf16_mixed_warns_on_a_cpu_without_fast_bfloat16_and_names_the_callers_line(monkeypatch):
    monkeypatch.setattr(precision_module, "cpu_has_fast_bfloat16", lambda: False)
    with pytest.warns(UserWarning, match=r"^bf16-mixed emulates bfloat16 on this CPU .* 10x slower"):
        assert resolve("bf16-mixed", "cpu") == "bf16-mixed"
    with pytest.warns(UserWarning, match="^bf16-mixed emulates") as caught, autocast("bf16-mixed", "cpu"):
        pass
    assert len(caught) == 1 and caught[0].filename == __file__  # attributed to autocast's caller, not to captioner
    with pytest.warns(UserWarning) as caught, decoding("16-mixed", "cpu"):  # runs as bf16-mixed: both warnings
        pass
    assert sorted(str(w.message)[:10] for w in caught) == ["16-mixed (", "bf16-mixed"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        for precision, device in (("32-true", "cpu"), ("bf16-mixed", "cuda"), ("16-mixed", "cuda")):
            assert resolve(precision, device) == precision
        monkeypatch.setattr(precision_module, "cpu_has_fast_bfloat16", lambda: True)
        with decoding("bf16-mixed", "cpu"):
            assert torch.is_autocast_enabled("cpu")


def test_cpu_has_fast_bfloat16_asks_onednn_and_assumes_yes_when_torch_cannot_tell(monkeypatch):
    assert cpu_has_fast_bfloat16() == torch.ops.mkldnn._is_mkldnn_bf16_supported()

    def unusable():
        raise RuntimeError("not built with oneDNN")

    try:  # the answer is cached per process: clear it for each torch below, and after them
        for mkldnn in (types.SimpleNamespace(), types.SimpleNamespace(_is_mkldnn_bf16_supported=unusable)):
            monkeypatch.setattr(torch.ops, "mkldnn", mkldnn)  # a torch without the check; one whose check fails
            cpu_has_fast_bfloat16.cache_clear()
            assert cpu_has_fast_bfloat16() is True
    finally:
        monkeypatch.undo()
        cpu_has_fast_bfloat16.cache_clear()
