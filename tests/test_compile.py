"""The optional torch.compile of the decoder's per-word methods (AttentionDecoder.compile_steps)."""

import os
import subprocess
import sys

import pytest
import torch
from torch._inductor import cpp_builder

from captioner import Captioner
from captioner.cli import run_lightning_cli
from captioner.decoding import beam_search, greedy_search
from captioner.errors import ConfigError
from captioner.lit_module import CaptioningModule, caption_loss
from captioner.models.decoder import COMPILED_METHODS, RECOMPILE_LIMIT, check_compiler
from tests.conftest import tiny_fit_args


@pytest.fixture(autouse=True)
def _dynamo_config():
    """Restore the recompile limit that compile_steps raises, and fail where dynamo would run a method uncompiled."""
    config = torch._dynamo.config
    with config.patch({RECOMPILE_LIMIT: getattr(config, RECOMPILE_LIMIT), "fail_on_recompile_limit_hit": True}):
        yield


def test_captioner_compiles_only_when_asked_and_compiling_twice_changes_nothing(tiny_model):
    assert not any(name in Captioner.load(tiny_model).model.decoder.__dict__ for name in COMPILED_METHODS)
    decoder = Captioner.load(tiny_model, compile_decoder=True).model.decoder
    compiled = [decoder.__dict__[name] for name in COMPILED_METHODS]
    assert decoder.compile_steps() is decoder
    assert [decoder.__dict__[name] for name in COMPILED_METHODS] == compiled  # not wrapped a second time
    assert getattr(torch._dynamo.config, RECOMPILE_LIMIT) >= 32


def test_a_missing_cpp_compiler_is_a_config_error_where_inductor_needs_one(tiny_model, monkeypatch):
    def no_compiler(*args, **kwargs):
        raise cpp_builder.exc.InvalidCxxCompiler

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    with pytest.raises(ConfigError, match=r"^compile_decoder: torch.compile needs a working C\+\+ compiler .*"):
        Captioner.load(tiny_model, compile_decoder=True)
    Captioner.load(tiny_model)  # no compiling asked, no compiler needed
    check_compiler("cuda")  # Inductor compiles for a GPU with Triton, not C++
    check_compiler("cpu", backend="eager")
    with pytest.raises(ConfigError):
        check_compiler(torch.device("cpu"))


def test_fit_with_compile_decoder_and_no_cpp_compiler_is_one_line(tmp_path):
    """The real condition, not a patched probe: CXX names no compiler, as Inductor reads it when it starts."""
    command = [sys.executable, "-m", "captioner.cli", "fit", *tiny_fit_args(tmp_path, "--model.compile_decoder=true")]
    env = os.environ | {"CXX": str(tmp_path / "no-such-g++")}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "torch.compile needs a working C++ compiler" in errors[0], result.stderr
    assert "no-such-g++" in errors[0]
    assert not (tmp_path / "checkpoints").exists()  # stopped before training


@pytest.mark.slow  # 30-100 s of compiling, depending on Inductor's cache
def test_fit_with_a_compiled_decoder_trains_and_decodes_as_the_eager_decoder_does(tmp_path):
    """A fast_dev_run fit and validation through Lightning with `--model.compile_decoder=true`, then the trained
    weights in an eager decoder: teacher forcing (loss and gradients) and greedy and beam search must agree, with
    every call compiled (the fixture fails a call that dynamo would run uncompiled)."""
    cli = run_lightning_cli(
        ["fit", *tiny_fit_args(tmp_path, "--trainer.fast_dev_run=true", "--model.compile_decoder=true")]
    )
    assert torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    model = cli.model.model
    compiled = model.decoder
    special = {"start_index": model.start_index, "end_index": model.end_index, "pad_index": model.pad_index}
    assert all(name in compiled.__dict__ for name in COMPILED_METHODS)

    # Images of two kinds, annotations near +v or -v, and <end>'s output weights along L_z v: the first kind says
    # <end> at once, the second never (margins over 10 nats when this test was written), so every search shrinks.
    B, P, E = 6, model.encoder.num_pixels, model.encoder.out_dim
    torch.manual_seed(0)
    v = 4 * torch.randn(E)
    annotations = 0.1 * torch.randn(B, P, E) + torch.tensor([1.0, -1.0] * (B // 2)).view(B, 1, 1) * v
    with torch.no_grad():
        u = compiled.L_z.weight @ v
        compiled.L_o.weight[model.end_index] = 40 * u / u.norm() ** 2
    # LightningCLI adds _instantiator to the saved hyper-parameters
    hparams = {name: value for name, value in cli.model.hparams.items() if not name.startswith("_")}
    eager_module = CaptioningModule(**hparams | {"compile_decoder": False})
    eager_module.load_state_dict(cli.model.state_dict())
    eager = eager_module.model.decoder
    assert not any(name in eager.__dict__ for name in COMPILED_METHODS)

    lengths = torch.tensor([9, 7, 7, 5, 4, 3])
    captions = torch.randint(4, len(cli.model.vocab), (B, 9))  # words after the four special tokens
    captions[:, 0] = model.start_index
    losses, gradients = [], []
    for decoder in (eager, compiled):
        decoder.eval().zero_grad()  # eval: dropout draws different masks compiled; the graph is otherwise training's
        logits, alphas = decoder(annotations, captions, lengths)
        loss = caption_loss(logits, captions[:, 1:], alphas)[0]
        loss.backward()
        losses.append(loss.item())
        gradients.append([p.grad.clone() for p in decoder.parameters() if p.grad is not None])
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert len(gradients[1]) == len(gradients[0]) > 10
    largest = max(float(grad.abs().max()) for grad in gradients[0])  # rounding differs: against the largest gradient
    for eager_grad, compiled_grad in zip(*gradients, strict=True):
        assert (compiled_grad - eager_grad).abs().max() <= 1e-4 * largest

    rows = []  # decoder rows per step, of each search
    with torch.inference_mode():
        for search in (
            lambda d: greedy_search(d, annotations, max_len=8, **special),
            lambda d: greedy_search(d, annotations[:1], max_len=8, **special),
            lambda d: beam_search(d, annotations, beam_size=3, max_len=8, **special),
        ):
            expected, got = search(eager), search(compiled)
            rows.append(got.decoder_rows)
            assert torch.equal(got.tokens, expected.tokens) and torch.equal(got.lengths, expected.lengths)
            assert torch.allclose(got.scores, expected.scores, atol=1e-4)
            assert torch.allclose(got.alphas, expected.alphas, atol=1e-5)
    assert min(rows[0]) < B and min(rows[2][1:]) < B * 3  # shrank: beam search also ran attend and update alone
