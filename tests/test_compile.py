"""The optional torch.compile of the decoder's per-word methods (`Captioner.load(..., compile_decoder=True)`)."""

import math

import pytest
import torch

from captioner import Captioner
from captioner.data.shapes import ShapesDataset
from captioner.models.decoder import COMPILED_METHODS
from tests.helpers import logged


@pytest.mark.slow  # about 45 s, most of it compiling
def test_a_compiled_decoder_captions_as_the_eager_one(tiny_model):
    eager = Captioner.load(tiny_model)
    assert not any(name in eager.model.decoder.__dict__ for name in COMPILED_METHODS)
    compiled = Captioner.load(tiny_model, compile_decoder=True)
    decoder = compiled.model.decoder
    methods = [decoder.__dict__[name] for name in COMPILED_METHODS]
    assert decoder.compile_steps() is decoder
    assert [decoder.__dict__[name] for name in COMPILED_METHODS] == methods  # not wrapped a second time
    images = [ShapesDataset("test", 3, seed=0).load_image(i) for i in range(3)]
    for batch in (images[:1], images):  # one image, what the option is for, and several
        want, got = eager.caption(batch, beam_size=3), compiled.caption(batch, beam_size=3)
        assert [r.text for r in got] == [r.text for r in want]
        for a, b in zip(got, want, strict=True):
            assert abs(a.score - b.score) < 1e-4 and torch.allclose(a.alphas, b.alphas, atol=1e-5)


# The compiled training step (`--model.compile`, issue #45): on by default on CUDA; here forced on the CPU.


@pytest.mark.slow  # 40 s with aot_eager; the default run's share of this is the next test and tests/models
@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("aot_eager", id="aot_eager"),  # Dynamo's capture in Lightning's loop, without code generation
        pytest.param("inductor", id="inductor"),  # as on a GPU; minutes of C++ compiling when its cache is cold
    ],
)
def test_a_compiled_fit_logs_what_the_plain_fit_logs_and_their_checkpoints_are_interchangeable(
    tmp_path, backend, monkeypatch
):
    from captioner.cli import run_lightning_cli
    from captioner.models.show_attend_tell import ShowAttendTell
    from tests.conftest import tiny_fit_args

    compile_step = ShowAttendTell.compile_step
    monkeypatch.setattr(ShowAttendTell, "compile_step", lambda self, **o: compile_step(self, **o, backend=backend))
    torch.compiler.reset()
    data = f"--data.init_args.data_dir={tmp_path / 'data'}"
    plain, compiled = tmp_path / "plain", tmp_path / "compiled"
    precision = torch.get_float32_matmul_precision()
    try:
        run_lightning_cli(["fit", *tiny_fit_args(plain, data, "--model.dropout=0", "--model.compile=false")])
        assert torch.get_float32_matmul_precision() == precision  # auto: unchanged without CUDA
        cli = run_lightning_cli(
            [
                "fit",
                *tiny_fit_args(
                    compiled, data, "--model.dropout=0", "--model.compile=true", "--float32_matmul_precision=high"
                ),
            ]
        )
        assert torch.get_float32_matmul_precision() == "high"  # the CLI's choice, when asked for
    finally:
        torch.set_float32_matmul_precision(precision)
    assert cli.model.model.fixed_shape and "_compiled_loss" in cli.model.model.__dict__  # the step that ran
    want, got = logged(plain), logged(compiled)
    for key in ("val/loss", "train/loss_epoch", "val/nll_per_word"):
        assert got[key] == pytest.approx(want[key], rel=1e-3), key
    # A checkpoint trained compiled captions uncompiled, as one trained uncompiled does.
    images = [ShapesDataset("test", 3, seed=0).load_image(i) for i in range(3)]
    captions = {
        name: [r.text for r in Captioner.load(str(root / "checkpoints" / "best.ckpt")).caption(images)]
        for name, root in (("plain", plain), ("compiled", compiled))
    }
    assert captions["compiled"] == captions["plain"]
    # And one trained uncompiled goes on training compiled.
    resumed = run_lightning_cli(
        [
            "fit",
            *tiny_fit_args(
                plain, data, "--model.dropout=0", "--model.compile=true", "--trainer.max_epochs=2", "--ckpt_path=last"
            ),
        ]
    )
    assert resumed.trainer.current_epoch == 2 and resumed.model.model.fixed_shape


def test_the_step_compiles_with_cuda_graphs_on_cuda_unless_gradients_are_accumulated():
    from captioner.models.show_attend_tell import compile_options

    assert compile_options("cpu") == ({}, None)
    assert compile_options("cpu", 2, "aot_eager") == ({"backend": "aot_eager"}, None)
    assert compile_options("cuda") == ({"mode": "reduce-overhead"}, None)
    options, note = compile_options("cuda", 4)
    assert options == {} and "without CUDA graphs" in note and "over 4 batches" in note


def test_a_fit_compiled_with_accumulated_gradients_logs_what_the_plain_fit_logs(tmp_path):
    """The compiled step, really compiled (aot_eager: Dynamo's and AOTAutograd's graphs, no code generation), in
    Lightning's loop with gradients accumulated over two batches, against the shrinking batch: the same losses. With
    dropout 0 and soft attention the two forms draw nothing at random (README, "Speed")."""
    from captioner.cli import run_lightning_cli
    from tests.conftest import tiny_fit_args

    torch.compiler.reset()
    data = f"--data.init_args.data_dir={tmp_path / 'data'}"
    same = [data, "--model.dropout=0", "--trainer.accumulate_grad_batches=2"]
    run_lightning_cli(["fit", *tiny_fit_args(tmp_path / "plain", *same, "--model.compile=false")])
    compiled = ["--model.compile=true", "--model.compile_backend=aot_eager"]
    cli = run_lightning_cli(["fit", *tiny_fit_args(tmp_path / "compiled", *same, *compiled)])
    assert cli.model.model.fixed_shape and "_compiled_loss" in cli.model.model.__dict__  # the step that ran
    assert cli.trainer.global_step == 2  # 4 batches, 2 optimizer steps
    want, got = logged(tmp_path / "plain"), logged(tmp_path / "compiled")
    for key in ("val/loss", "train/loss_epoch", "val/nll_per_word", "val/bleu4"):
        assert got[key] == pytest.approx(want[key], rel=1e-4), key


def test_the_compile_option_is_auto_true_or_false():
    from captioner.errors import ConfigError
    from captioner.lit_module import CaptioningModule

    vocab = ["<pad>", "<start>", "<end>", "<unk>", "a"]
    options = {"pretrained": False, "embed_dim": 8, "decoder_dim": 8, "attention_dim": 8}
    assert not CaptioningModule(vocab, **options).compiles_step()  # auto, on a CPU
    assert CaptioningModule(vocab, compile=True, **options).compiles_step()
    assert not CaptioningModule(vocab, compile="false", **options).compiles_step()
    with pytest.raises(ConfigError, match="compile must be auto, true or false"):
        CaptioningModule(vocab, compile="sometimes", **options)


@pytest.mark.slow  # Inductor compiles each graph in C++: minutes on 2 cores
def test_a_compiled_fit_with_hard_attention_bf16_and_clipping_trains_with_finite_losses(tmp_path):
    """Hard attention's two kinds of batch (sampled locations, expected context) as two graphs, under bf16 autocast
    and gradient clipping, in Lightning's optimizer loop."""
    from captioner.cli import run_lightning_cli
    from tests.conftest import tiny_fit_args

    torch.compiler.reset()
    options = ["--model.compile=true", "--model.attention_mode=hard", "--trainer.precision=bf16-mixed"]
    cli = run_lightning_cli(["fit", *tiny_fit_args(tmp_path, *options, "--trainer.gradient_clip_val=1.0")])
    assert cli.model.model.fixed_shape
    values = logged(tmp_path)
    assert {"val/loss", "train/loss_epoch"} <= values.keys()
    assert all(math.isfinite(value) for value in values.values())
    assert cli.model.model.reward_baseline.item() < 0  # sampled batches moved the baseline
