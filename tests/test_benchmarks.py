"""The scripts in benchmarks/ still import against the library, and their pieces do what they say.

`make bench` is not part of the test run: it takes half an hour or more and wants an idle machine. These tests catch a
library change that breaks a script's imports (a renamed function, a moved module), which would otherwise show only
at the next `make bench`, and check pieces of the scripts (their switches, their settings, their outputs with fake
timings). They time nothing.
"""

from __future__ import annotations

import importlib
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="grad_memory.py reads Linux's /proc")
def test_grad_memory_py_sees_the_graph_that_autograd_keeps(benchmarks):
    """grad_memory.py's figure responds to what a search holds: with autograd on, every step's graph (about 240 MiB
    at the shapes sizes, beam 3, batch 64) on top of the 30 MiB or so that inference mode's search rises by."""
    from decode import INFERENCE
    from grad_memory import search_memory

    rise = {}
    for mode in (INFERENCE, "autograd on"):
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as new:
            rise[mode] = new.submit(search_memory, mode, "shapes").result()
    assert 0 < rise[INFERENCE] < 100
    assert rise["autograd on"] > 3 * rise[INFERENCE]


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
    assert mixed_precisions(torch.device("cpu"), cpu_bf16=False) == ()
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit) as exit_info:
        main(["--device", "cuda"])
    assert exit_info.value.code == 2
    assert "--device cuda: this machine has no cuda device" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--device", "nonsense"])
    assert "--device nonsense:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("switch", "native", "timed"),
    [(None, True, True), (None, False, False), ("auto", False, False), ("0", True, False), ("1", False, True)],
)
def test_bf16_is_timed_on_a_cpu_where_it_is_native_or_when_asked(benchmarks, monkeypatch, switch, native, timed):
    import common

    monkeypatch.setattr(common, "cpu_has_fast_bfloat16", lambda: native)
    if switch is None:
        monkeypatch.delenv(common.BF16_SWITCH, raising=False)
    else:
        monkeypatch.setenv(common.BF16_SWITCH, switch)
    assert common.bf16_timed_on_cpu() is timed


def test_a_wrong_bf16_switch_stops_the_script_with_one_line(benchmarks, monkeypatch):
    import common

    monkeypatch.setenv(common.BF16_SWITCH, "yes")
    with pytest.raises(SystemExit, match="BENCH_BF16='yes': use 1"):
        common.bf16_timed_on_cpu()


@pytest.mark.parametrize("switch", ["0", "1"])
def test_caption_cli_py_leaves_bf16_out_of_its_table_and_result_when_not_timed(benchmarks, monkeypatch, capsys, switch):
    """caption_cli.py without its bf16-mixed run still prints the acceptance figures (the command is not run here:
    each run is a fake 2 s and 100 MiB, 150 MiB for 512 images)."""
    import caption_cli
    import common

    monkeypatch.setenv(common.BF16_SWITCH, switch)
    monkeypatch.setattr(common, "cpu_has_fast_bfloat16", lambda: True)  # so "0" is the reason given
    runs = []

    def fake_run(folder, precision="32-true"):
        runs.append((len(list(folder.iterdir())), precision))
        return 2.0, 100.0 if runs[-1][0] == 32 else 150.0

    monkeypatch.setattr(caption_cli, "run", fake_run)
    caption_cli.main()
    out = capsys.readouterr().out
    result = dict(pair.split("=") for pair in out.strip().splitlines()[-1].removeprefix("RESULT ").split())
    assert result["peak_growth"] == "50.0%"
    if switch == "1":
        assert runs == [(32, "32-true"), (512, "32-true"), (512, "bf16-mixed")]
        assert result["bf16_speedup_512"] == "1.00"
        assert "not timed" not in out
    else:
        assert runs == [(32, "32-true"), (512, "32-true")]
        assert "wall_512_bf16_s" not in result and "bf16_speedup_512" not in result
        assert "bf16-mixed not timed: BENCH_BF16=0" in out
        assert "bf16-mixed |" not in out
