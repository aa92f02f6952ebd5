"""On a CUDA GPU only (skipped elsewhere, CI included): the compiled training step as `captioner fit` runs it there by
default, against the plain step, with and without gradient accumulation (which turns CUDA graphs off)."""

from __future__ import annotations

import math

import pytest
import torch

from captioner.cli import run_lightning_cli
from tests.conftest import tiny_fit_args
from tests.helpers import logged

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = ["--trainer.accelerator=cuda", "--float32_matmul_precision=highest", "--model.dropout=0"]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_compiled_step_on_cuda_logs_what_the_plain_step_logs(tmp_path, accumulate):
    """compile auto: on CUDA the fixed-shape step under torch.compile, with CUDA graphs (mode="reduce-overhead")
    unless gradients are accumulated."""
    torch.compiler.reset()
    same = [*CUDA, f"--data.init_args.data_dir={tmp_path / 'data'}", f"--trainer.accumulate_grad_batches={accumulate}"]
    run_lightning_cli(["fit", *tiny_fit_args(tmp_path / "plain", *same, "--model.compile=false")])
    cli = run_lightning_cli(["fit", *tiny_fit_args(tmp_path / "compiled", *same, "--trainer.max_epochs=2")])
    assert cli.trainer.strategy.root_device.type == "cuda" and cli.model.model.fixed_shape
    # The compiled run's first epoch is the plain run's one epoch; its second shows that the replays train on.
    want, got = logged(tmp_path / "plain"), logged(tmp_path / "compiled", epoch=0)
    for key in ("val/loss", "train/loss_epoch", "val/nll_per_word"):
        assert got[key] == pytest.approx(want[key], rel=1e-3), key
    second = logged(tmp_path / "compiled", epoch=1)
    assert all(math.isfinite(value) for value in second.values()) and second["val/loss"] != got["val/loss"]
    assert cli.trainer.global_step == 2 * 4 // accumulate


def test_hard_attention_bf16_and_clipping_compiled_on_cuda_train_with_finite_losses(tmp_path):
    """Hard attention's draws (torch.multinomial) inside a CUDA graph, under bf16 autocast and gradient clipping."""
    torch.compiler.reset()
    options = ["--model.attention_mode=hard", "--trainer.precision=bf16-mixed", "--trainer.gradient_clip_val=1.0"]
    cli = run_lightning_cli(["fit", *tiny_fit_args(tmp_path, *CUDA, *options, "--trainer.max_epochs=2")])
    values = logged(tmp_path)
    assert cli.model.model.fixed_shape and {"val/loss", "train/loss_epoch"} <= values.keys()
    assert all(math.isfinite(value) for value in values.values())
    assert cli.model.model.reward_baseline.item() < 0  # sampled batches moved the baseline


@pytest.mark.parametrize("encoder", [False, True], ids=["decoder", "decoder-and-encoder"])
def test_the_compiled_decoder_on_cuda_captions_as_the_eager_one(encoder):
    """`compile_decoder=True` on CUDA: each search's runs of words captured as CUDA graphs (mode="reduce-overhead"),
    one image at a time and in batches of 16, writes the eager search's captions: beam 3 and greedy, sync-free in runs
    of 8 words (the default) and of 30 (the whole search one graph), and not sync-free (the compiled step word by
    word, the batch shrinking). With `compile_encoder=True` the encoder's forward is captured too. What a call returns
    (annotations, scores) is left as it was by the replays of the calls after it. (On a CPU: tests/test_compile.py,
    under tests/cuda_graphs.py's stand-in.)"""
    from captioner import Captioner
    from captioner.data.shapes import ShapesDataset

    torch.compiler.reset()
    eager = Captioner.load("shapes", device="cuda")
    compiled = Captioner.load("shapes", device="cuda", compile_decoder=True, compile_encoder=encoder)
    images = [ShapesDataset("test", 48, seed=0).load_image(i) for i in range(48)]
    want = [r.tokens for r in eager.caption(images, beam_size=3)]
    assert [r.tokens for r in compiled.caption(images, beam_size=3, batch_size=16)] == want
    assert [compiled.caption(image, beam_size=3)[0].tokens for image in images[:16]] == want[:16]
    greedy = [r.tokens for r in eager.caption(images, beam_size=1)]
    assert [r.tokens for r in compiled.caption(images, beam_size=1, batch_size=16)] == greedy
    x = torch.stack([eager.transform(image) for image in images[:4]]).cuda()
    with torch.inference_mode():
        a = eager.model.annotate(x)
        for beam in (1, 3):
            # not sync-free on two images only: each number of rows the shrinking batch meets compiles a graph
            for options, n in (({"check_every": 30}, 4), ({"sync_free": False}, 2)):
                reference = eager.model.generate(annotations=a[:n], beam_size=beam)
                got = compiled.model.generate(annotations=a[:n], beam_size=beam, **options)
                assert torch.equal(got.tokens, reference.tokens), (beam, options)
        first = compiled.model.annotate(x[:1])
        kept = first.clone()
        compiled.model.annotate(x[1:2])
        generation = compiled.model.generate(annotations=kept, beam_size=1)  # greedy: scores summed in its graphs
        scores = generation.scores.clone()
        compiled.model.generate(annotations=compiled.model.annotate(x[1:2]), beam_size=1)
    assert torch.equal(first, kept) and torch.equal(generation.scores, scores)
