"""The scripts in benchmarks/ still import against the library.

`make bench` is not part of the test run: it takes about 15 minutes and wants an idle machine. These tests catch a
library change that breaks a script's imports (a renamed function, a moved module), which would otherwise show only
at the next `make bench`. They import each script, they do not time anything.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

from captioner.models.onednn import AVAILABLE as ONEDNN_AVAILABLE

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(path.stem for path in BENCHMARKS.glob("*.py") if path.stem != "common")


@pytest.fixture
def benchmarks(monkeypatch):
    """benchmarks/ on sys.path, as when a script runs from that folder; the scripts' modules (common, decode, ...) are
    dropped from sys.modules afterwards, so that no other test sees them."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        module = sys.modules[name]
        if Path(getattr(module, "__file__", None) or "").parent == BENCHMARKS:
            del sys.modules[name]


def test_every_script_is_found():
    assert {"train_step", "decode", "encoder", "epoch", "caption_cli"} <= set(SCRIPTS)  # the five


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_script_imports_and_has_a_main(benchmarks, name):
    module = importlib.import_module(name)
    assert callable(module.main)


def test_the_decode_benchmark_searches_in_the_library_s_context(benchmarks):
    """decode.py's `search` (which precision.py, onednn.py, mkl_packed.py and others time) runs the library's
    searches: the same tokens as `captioner.decoding` on the same inputs, every call MAX_LEN steps long."""
    from decode import MAX_LEN, SPECIAL, random_decoder, search

    from captioner.decoding import beam_search, greedy_search

    decoder = random_decoder("shapes")
    annotations = torch.randn(2, 49, 1280)
    with torch.inference_mode():
        expected = {
            1: greedy_search(decoder, annotations, max_len=MAX_LEN, **SPECIAL),
            3: beam_search(decoder, annotations, beam_size=3, max_len=MAX_LEN, **SPECIAL),
        }
    for beam, reference in expected.items():
        out = search(decoder, annotations, beam)
        assert out.tokens.shape == (2, MAX_LEN)  # <end> is suppressed: no caption ends early
        assert torch.equal(out.tokens, reference.tokens)


def test_the_gradient_modes_of_decode_py_decode_the_same_captions(benchmarks):
    """decode.py's gradient-tracking table compares the same work: each mode's search gives the same tokens, and only
    "autograd on" builds a graph."""
    from decode import GRAD_MODES, INFERENCE, MAX_LEN, SPECIAL, random_decoder

    from captioner.decoding import beam_search
    from captioner.models import onednn

    decoder = random_decoder("shapes")
    annotations = torch.randn(2, 49, 1280)
    outputs = {}
    with onednn.use(False):
        for mode, context in GRAD_MODES.items():
            with context():
                outputs[mode] = beam_search(decoder, annotations, beam_size=3, max_len=MAX_LEN, **SPECIAL)
    reference = outputs.pop(INFERENCE)
    assert reference.scores.is_inference()
    for mode, out in outputs.items():
        assert torch.equal(out.tokens, reference.tokens), mode
        torch.testing.assert_close(out.scores, reference.scores)
    assert outputs["autograd on"].scores.requires_grad
    assert not outputs["no_grad"].scores.requires_grad


def test_the_training_benchmark_runs_mixed_precision_as_captioner_fit_does(benchmarks):
    """train_step.py's bf16-mixed step runs under the autocast of Lightning's own precision plugin, as `captioner fit`
    does: its cast cache is off, so the LSTM's weight is cast at every word (and its gradient cast back). Its batches
    differ in caption lengths, as an epoch's do."""
    from common import SIZES
    from train_step import BATCHES, make_batch, trainer

    from captioner.models.decoder import AttentionDecoder
    from tests.conftest import cast_count

    P, E, D, _, M, V = SIZES["shapes"]
    step = trainer(AttentionDecoder, "shapes", "cpu", "bf16-mixed")
    assert cast_count((4 * D, M + E), step) >= 2 * 7  # captions of at least 8 tokens: at least 7 words to predict
    lengths = [make_batch(P, E, V, seed=seed)[2] for seed in range(BATCHES["shapes"])]
    assert len({tuple(sorted(batch.tolist())) for batch in lengths}) == BATCHES["shapes"]


@pytest.mark.skipif(not ONEDNN_AVAILABLE, reason="this torch build has no oneDNN linear")
def test_onednn_py_trains_through_its_own_onednn_function_with_the_same_gradients(benchmarks):
    """onednn.py's training table (not adopted in the library) times a step whose large products go through its own
    autograd Function: the gradients must be the library's, and the Function must actually run."""
    from unittest.mock import patch

    import onednn as script

    function = script.OneDNNLinearFunction
    with patch.object(function, "apply", side_effect=function.apply) as apply:
        difference = script.gradient_difference("shapes")
    assert apply.call_count > 0  # the LSTM's input weight (1024 x 1408) is over the threshold at the shapes sizes
    assert difference < 1e-5


def test_the_training_benchmark_refuses_a_device_this_machine_lacks(benchmarks, capsys):
    from train_step import main, mixed_precisions

    assert mixed_precisions(torch.device("cpu")) == ("bf16-mixed",)  # 16-mixed is for GPUs, as in Lightning
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit) as exit_info:
        main(["--device", "cuda"])
    assert exit_info.value.code == 2
    assert "--device cuda: this machine has no cuda device" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--device", "nonsense"])
    assert "--device nonsense:" in capsys.readouterr().err
