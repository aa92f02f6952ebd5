"""The optional torch.compile of the decoder's step (`Captioner.load(..., compile_decoder=True)`), and of the training
step (`--model.compile`)."""

import contextlib
import math

import pytest
import torch

from captioner import Captioner
from captioner.data.shapes import ShapesDataset
from captioner.models.beam_search import beam_search
from captioner.models.decoding import greedy_search
from tests.cuda_graphs import cuda_graph_stand_in
from tests.helpers import SPECIAL, logged, random_decoder


def test_a_compiled_decoder_compiles_a_graph_per_shape_and_never_again():
    """A graph per shape of a search's run of words between two reads: for beam search, the run that holds the first
    word (one row per image, then K) and the later runs, per number of images and beam size; none for a new image or
    another caption length. (A backend that counts Dynamo's graphs and runs them as traced.)"""
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
    assert compiled.compile_search(backend=counting) is compiled and compiled.compiled and not eager.compiled
    step = compiled.step
    assert compiled.compile_search() is compiled and compiled.step is step  # not wrapped a second time
    generator = torch.Generator().manual_seed(0)
    lengths = set()
    every = {"check_every": 2, **SPECIAL}  # runs of two words: the captions here end within a few
    with torch.inference_mode():
        for _ in range(6):  # six images one at a time, then three, with captions of different lengths
            a = torch.randn(1, 9, 16, generator=generator)
            want, got = beam_search(eager, a, beam_size=3, **every), beam_search(compiled, a, beam_size=3, **every)
            assert torch.equal(got.tokens, want.tokens)
            lengths.add(int(got.lengths[0]))
        after_one = len(graphs)
        a = torch.randn(3, 9, 16, generator=generator)
        assert torch.equal(greedy_search(compiled, a, **every).tokens, greedy_search(eager, a, **every).tokens)
    assert len(lengths) > 1  # the captions' lengths differed
    assert after_one == 2 and len(graphs) == 3, graphs  # beam 3 of one image: the first run, the later; greedy: one
    # Past Dynamo's default limit of 8 graphs for a function (which every compiled decoder shares), the searches
    # still compile each new shape rather than run it uncompiled, and once only: beam 3 of 2 to 7 images, twice.
    images = [torch.randn(n, 9, 16, generator=generator) for n in range(2, 8)]
    with torch.inference_mode():
        for a in images:
            beam_search(compiled, a, beam_size=3, **every)
        compiled_so_far = len(graphs)
        for a in images:
            assert torch.equal(
                beam_search(compiled, a, beam_size=3, **every).tokens,
                beam_search(eager, a, beam_size=3, **every).tokens,
            )
    assert len(graphs) == compiled_so_far > 8, graphs


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


@pytest.mark.parametrize(
    "backend",
    [
        # Dynamo's graphs run as traced, with a CUDA-graph tree's output lifetimes (tests/cuda_graphs.py): what a
        # replay on CUDA does to the searches' state, emulated; nothing is compiled to code
        pytest.param("cuda-graph stand-in", id="cuda-graph-stand-in"),
        # Inductor's code, as on a GPU: minutes of C++ compiling on 2 cores with an empty cache (.ci/run)
        pytest.param("inductor", id="inductor", marks=pytest.mark.ci),
    ],
)
def test_the_compiled_decoder_captions_the_bundled_model_s_500_test_images_word_for_word(
    shapes_test_annotations, backend
):
    """Beam 3, one image at a time (what the option is for) and in Captioner's batches of 16, and greedy in batches
    of 16, sync-free in runs of 8 words (CHECK_EVERY: the compiled decoder's default, on a GPU as here): the same
    captions as the default search, word for word, and their scores and attention."""
    eager = Captioner.load("shapes").model
    a = shapes_test_annotations
    with cuda_graph_stand_in() if backend != "inductor" else contextlib.nullcontext() as stand_in:
        compiled = Captioner.load("shapes", compile_decoder=True).model
        assert compiled.decoder.compiled
        with torch.inference_mode():
            for beam, batch, count in ((3, 1, 500), (3, 16, 64), (1, 16, 500)):
                for start in range(0, count, batch):
                    want = eager.generate(annotations=a[start : start + batch], beam_size=beam)
                    got = compiled.generate(annotations=a[start : start + batch], beam_size=beam)
                    assert torch.equal(got.tokens, want.tokens), (beam, start)
                    assert torch.allclose(got.scores, want.scores, atol=1e-4)
                    assert torch.allclose(got.alphas, want.alphas, atol=1e-5)
    if stand_in is not None:  # the replays' rule was applied: outputs were overwritten at the calls after them
        assert stand_in.calls > 1000 and stand_in.overwritten > 1000, (stand_in.calls, stand_in.overwritten)


def test_inductor_s_code_for_a_search_survives_replays(shapes_test_annotations):
    """The one case of make test that generates code, as on a GPU (Inductor: seconds of C++ compiling with an empty
    cache; the 500-image run above is .ci/run's): greedy over four images, a word per call, under the stand-in's
    replays: the eager search's captions and attention."""
    eager = Captioner.load("shapes").model
    a = shapes_test_annotations[:4]
    with cuda_graph_stand_in(backend="inductor") as stand_in:
        compiled = Captioner.load("shapes", compile_decoder=True).model
        with torch.inference_mode():
            got = compiled.generate(annotations=a, beam_size=1, check_every=1)
            want = eager.generate(annotations=a, beam_size=1)
    assert torch.equal(got.tokens, want.tokens) and torch.allclose(got.alphas, want.alphas, atol=1e-5)
    assert stand_in.calls == got.tokens.size(1) and stand_in.overwritten > 0


def test_the_compiled_step_that_a_shrinking_search_calls_survives_replays(shapes_test_annotations):
    """With `sync_free=False` a compiled decoder's searches call its compiled `step` word by word, each word's state
    the next one's input: under the CUDA-graph stand-in, the eager search's captions (greedy and beam 3)."""
    eager = Captioner.load("shapes").model
    a = shapes_test_annotations[:16]
    with cuda_graph_stand_in() as stand_in:
        compiled = Captioner.load("shapes", compile_decoder=True).model
        with torch.inference_mode():
            for beam in (1, 3):
                want = eager.generate(annotations=a, beam_size=beam)
                got = compiled.generate(annotations=a, beam_size=beam, sync_free=False)
                assert torch.equal(got.tokens, want.tokens) and torch.allclose(got.alphas, want.alphas, atol=1e-5)
    assert stand_in.overwritten > 10


# The compiled training step (`--model.compile`): on by default on CUDA; here forced on the CPU.


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

    compile_step = ShowAttendTell.compile_training_step
    monkeypatch.setattr(
        ShowAttendTell, "compile_training_step", lambda self, **o: compile_step(self, **o, backend=backend)
    )
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


def fit_as_on_cuda(tmp_path, monkeypatch, accumulate: int, options=None):
    """A compiled fit with the options that a CUDA run gets (`compile_options("cuda", ...)`, or `options`), under the
    CUDA-graph stand-in, which gives the pool's rules to what asks for CUDA graphs: the step's outputs and the
    gradients its backward gives, overwritten at the next step (tests/cuda_graphs.py)."""
    from captioner import lit_module
    from captioner.cli import run_lightning_cli
    from captioner.models.show_attend_tell import compile_options
    from tests.conftest import tiny_fit_args

    chosen = (lambda device, n, backend: (options, None)) if options is not None else compile_options
    monkeypatch.setattr(lit_module, "compile_options", lambda device, n, backend: chosen("cuda", n, backend))
    same = [f"--data.init_args.data_dir={tmp_path / 'data'}", "--model.dropout=0"]
    args = [*same, f"--trainer.accumulate_grad_batches={accumulate}", "--model.compile=true"]
    with cuda_graph_stand_in(graphs_only=True) as stand_in:
        cli = run_lightning_cli(["fit", *tiny_fit_args(tmp_path / "compiled", *args)])
    return cli, stand_in


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_compiled_fit_logs_what_the_plain_fit_logs(tmp_path, monkeypatch, accumulate):
    """The compiled step, really compiled (Dynamo's graphs, no code generation), in Lightning's loop with the options
    of a CUDA run, against the shrinking batch: the same losses. Without accumulation the step is captured as CUDA
    graphs: under the stand-in, each step's outputs and gradients are overwritten at the next step. With it, the
    step is compiled without CUDA graphs (`compile_options`), since the first batch's gradients would be overwritten
    by the second's replay (the next test). With dropout 0 and soft attention the two forms draw nothing at random
    (docs/benchmarks.md, "Speed on a GPU and on a CPU")."""
    from captioner.cli import run_lightning_cli
    from tests.conftest import tiny_fit_args

    torch.compiler.reset()
    same = [f"--data.init_args.data_dir={tmp_path / 'data'}", "--model.dropout=0"]
    plain = [*same, f"--trainer.accumulate_grad_batches={accumulate}", "--model.compile=false"]
    run_lightning_cli(["fit", *tiny_fit_args(tmp_path / "plain", *plain)])
    cli, stand_in = fit_as_on_cuda(tmp_path, monkeypatch, accumulate)
    assert cli.model.model.fixed_shape and "_compiled_loss" in cli.model.model.__dict__  # the step that ran
    assert cli.trainer.global_step == 4 // accumulate  # 4 batches
    if accumulate == 1:  # each step's loss parts and its gradients, overwritten at the next step
        assert stand_in.calls == 4 and stand_in.overwritten >= 3 * 4 and stand_in.gradients >= 4
    else:
        assert stand_in.calls == 0  # no CUDA graphs asked for
    want, got = logged(tmp_path / "plain"), logged(tmp_path / "compiled")
    for key in ("val/loss", "train/loss_epoch", "val/nll_per_word", "val/bleu4"):
        assert got[key] == pytest.approx(want[key], rel=1e-4), key


def test_without_compile_options_workaround_accumulated_gradients_are_overwritten(tmp_path, monkeypatch):
    """The stand-in can see the hazard that `compile_options` avoids: with CUDA graphs asked for and gradients
    accumulated over two batches, the first batch's gradients are pool memory, overwritten by the second batch's
    replay, and the run stops on a non-finite loss."""
    from captioner.errors import CaptionerError

    torch.compiler.reset()
    with pytest.raises(CaptionerError, match=r"train/loss is nan"):
        fit_as_on_cuda(tmp_path, monkeypatch, 2, options={"mode": "reduce-overhead"})


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


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("cuda-graph stand-in", id="cuda-graph-stand-in"),  # tests/cuda_graphs.py
        pytest.param("inductor", id="inductor", marks=pytest.mark.ci),  # 35 s of C++ compiling with an empty cache
    ],
)
def test_a_compiled_encoder_annotates_and_captions_as_the_eager_one(tmp_path, backend):
    """`compile_encoder=True`: the bundled model's encoder compiled, one graph per number of images a call has: the
    eager encoder's annotations to float rounding and the same captions, one image at a time and four at once, from
    files; annotations kept from one call are left as they were by the replays of the calls after it."""
    eager = Captioner.load("shapes")
    test = ShapesDataset("test", 8, seed=0)
    files = []
    for i in range(len(test)):
        files.append(tmp_path / f"{i}.png")
        test.load_image(i).save(files[-1])
    x = torch.stack([eager.transform(test.load_image(i)) for i in range(4)])
    with cuda_graph_stand_in() if backend != "inductor" else contextlib.nullcontext() as stand_in:
        compiled = Captioner.load("shapes", compile_encoder=True)
        assert "forward" in compiled.model.encoder.__dict__ and "forward" not in eager.model.encoder.__dict__
        with torch.inference_mode():
            kept = [compiled.model.annotate(x[:n]) for n in (1, 4, 1)]
            for n, annotations in zip((1, 4, 1), kept, strict=True):
                assert torch.allclose(annotations, eager.model.annotate(x[:n]), atol=1e-4, rtol=1e-4)
        for batch_size in (1, 4):
            want = [r.tokens for r in eager.caption(files, beam_size=3, batch_size=batch_size)]
            assert [r.tokens for r in compiled.caption(files, beam_size=3, batch_size=batch_size)] == want
    if stand_in is not None:
        assert stand_in.calls == 3 + 8 + 2 and stand_in.overwritten == stand_in.calls - 1
