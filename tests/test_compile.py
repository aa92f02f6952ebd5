"""The optional torch.compile of the decoder's step (`Captioner.load(..., compile_decoder=True)`), and of the training
step (`--model.compile`)."""

import math

import pytest
import torch

from captioner import Captioner
from captioner.data.shapes import ShapesDataset
from captioner.models.decoding import beam_search, greedy_search
from tests.helpers import SPECIAL, logged, random_decoder


def test_a_compiled_decoder_compiles_a_graph_per_shape_and_never_again(tmp_path):
    """One graph for the first word's rows and one for the later words', per number of images and beam size: none
    for a new image or another caption length. (A backend that counts Dynamo's graphs and runs them as traced.)"""
    graphs = []

    def counting(graph, example_inputs):
        graphs.append(tuple(x.shape[0] for x in example_inputs if isinstance(x, torch.Tensor) and x.dim() == 2))
        return graph.forward

    torch.compiler.reset()
    eager = random_decoder()
    compiled = random_decoder()
    with torch.no_grad():
        eager.L_o.bias[SPECIAL["end_index"]] += 1.5  # captions that end, at different words
    compiled.load_state_dict(eager.state_dict())
    assert compiled.compile_steps(backend=counting) is compiled and compiled.compiled and not eager.compiled
    step = compiled.step
    assert compiled.compile_steps() is compiled and compiled.step is step  # not wrapped a second time
    generator = torch.Generator().manual_seed(0)
    lengths = set()
    with torch.inference_mode():
        for _ in range(6):  # six images one at a time, then three, with captions of different lengths
            a = torch.randn(1, 9, 16, generator=generator)
            want, got = beam_search(eager, a, beam_size=3, **SPECIAL), beam_search(compiled, a, beam_size=3, **SPECIAL)
            assert torch.equal(got.tokens, want.tokens)
            lengths.add(int(got.lengths[0]))
        after_one = len(graphs)
        a = torch.randn(3, 9, 16, generator=generator)
        assert torch.equal(greedy_search(compiled, a, **SPECIAL).tokens, greedy_search(eager, a, **SPECIAL).tokens)
    assert len(lengths) > 1  # the captions' lengths differed
    assert after_one == 2 and len(graphs) == 3, graphs  # beam 3 of one image: 1 row, then 3; greedy of three: 3 rows
    # Past Dynamo's default limit of 8 graphs for a function (which every compiled decoder shares), the searches
    # still compile each new shape rather than run it uncompiled: beam 3 of 2 to 7 images, 12 graphs more (each
    # search's whole word is a function of its own: beam 3's first word of three images is not greedy's word).
    with torch.inference_mode():
        for images in range(2, 8):
            beam_search(compiled, torch.randn(images, 9, 16, generator=generator), beam_size=3, **SPECIAL)
    assert len(graphs) == 15, graphs


@pytest.fixture(scope="module")
def shapes_test_annotations() -> torch.Tensor:
    """The bundled model's annotations of the 500 images of the shapes test split."""
    model = Captioner.load("shapes").model
    test = ShapesDataset("test", 500, seed=0)
    transform = model.encoder.preprocessing.transforms()
    with torch.inference_mode():
        return torch.cat(
            [
                model.annotate(torch.stack([transform(test.load_image(i)) for i in range(start, start + 50)]))
                for start in range(0, 500, 50)
            ]
        )


def test_the_compiled_decoder_captions_the_bundled_model_s_500_test_images_word_for_word(shapes_test_annotations):
    """Beam 3, one image at a time (what the option is for) and in Captioner's batches of 16, through the same code
    path as on a GPU (Inductor here, CUDA graphs there): the same captions as the default search, word for word."""
    eager = Captioner.load("shapes").model
    compiled = Captioner.load("shapes", compile_decoder=True).model
    assert compiled.decoder.compiled
    a = shapes_test_annotations
    with torch.inference_mode():
        for batch in (1, 16):
            for start in range(0, 500 if batch == 1 else 64, batch):
                want = eager.generate(annotations=a[start : start + batch], beam_size=3)
                got = compiled.generate(annotations=a[start : start + batch], beam_size=3)
                assert torch.equal(got.tokens, want.tokens), start
                assert torch.allclose(got.scores, want.scores, atol=1e-4)
                assert torch.allclose(got.alphas, want.alphas, atol=1e-5)


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


def test_a_compiled_encoder_annotates_and_captions_as_the_eager_one(tmp_path):
    """`compile_encoder=True`: the bundled model's encoder compiled (Inductor here, CUDA graphs on a GPU), one graph per
    number of images a call has: the eager encoder's annotations to float rounding and the same captions, one image
    at a time and four at once, from files. (That a CUDA graph's next replay leaves them as they were:
    tests/test_cuda.py.)"""
    eager = Captioner.load("shapes")
    compiled = Captioner.load("shapes", compile_encoder=True)
    assert "forward" in compiled.model.encoder.__dict__ and "forward" not in eager.model.encoder.__dict__
    test = ShapesDataset("test", 8, seed=0)
    files = []
    for i in range(len(test)):
        files.append(tmp_path / f"{i}.png")
        test.load_image(i).save(files[-1])
    x = torch.stack([eager.transform(test.load_image(i)) for i in range(4)])
    with torch.inference_mode():
        for n in (1, 4):
            assert torch.allclose(compiled.model.annotate(x[:n]), eager.model.annotate(x[:n]), atol=1e-4, rtol=1e-4)
    for batch_size in (1, 4):
        want = [r.tokens for r in eager.caption(files, beam_size=3, batch_size=batch_size)]
        assert [r.tokens for r in compiled.caption(files, beam_size=3, batch_size=batch_size)] == want
