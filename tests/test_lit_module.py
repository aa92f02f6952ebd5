"""CaptioningModule's steps without a Trainer: a non-finite loss stops training, and a batch with no readable image
is a zero loss that still reaches every trainable weight (so DDP's gradient all-reduce runs in every process). With
one: the plateau schedule steps once per validation of a fit."""

import pytest
import torch

from captioner import lit_module
from captioner.data.dataset import collate
from captioner.errors import CaptionerError
from captioner.lit_module import CaptioningModule
from captioner.metrics import Decoded

VOCAB = ["<pad>", "<start>", "<end>", "<unk>", "a", "red", "circle"]


def module(**options) -> CaptioningModule:
    sizes = {"embed_dim": 8, "decoder_dim": 8, "attention_dim": 8, "pretrained": False, "image_size": 64}
    return CaptioningModule(VOCAB, **(sizes | options))


def batch(module: CaptioningModule, value: float = 1.0) -> dict:
    P, E = module.model.encoder.num_pixels, module.model.encoder.out_dim
    captions = torch.tensor([[1, 4, 5, 6, 2], [1, 6, 2, 0, 0]])
    annotations, lengths = torch.full((2, P, E), value), torch.tensor([5, 3])
    return {"annotations": annotations, "captions": captions, "lengths": lengths, "index": torch.arange(2)}


@pytest.mark.parametrize("fixed_shape", [False, True])  # the shrinking batch and the compiled step's form
def test_a_non_finite_training_loss_stops_at_the_next_optimizer_step_with_one_line(fixed_shape):
    model = module()
    model.model.fixed_shape = fixed_shape
    model.training_step(batch(model), 0)
    model.on_before_optimizer_step(None)  # finite: no error
    model.training_step(batch(model, float("inf")), 0)  # not read in the step: that would make the host wait
    model.on_before_optimizer_step(None)  # copied to the host behind the step, not read yet
    model.training_step(batch(model), 0)
    with pytest.raises(CaptionerError) as error:
        model.on_before_optimizer_step(None)  # the next optimizer step reads it
    message = str(error.value)
    assert message.startswith("train/loss is nan at epoch 0, step 0: the model overflowed (") and "\n" not in message
    assert "--model.decoder_lr" in message and "--trainer.precision" in message


@pytest.mark.parametrize("hook", ["on_save_checkpoint", "on_validation_epoch_start", "on_train_end"])
def test_a_non_finite_training_loss_is_said_before_a_checkpoint_validation_or_the_end(hook):
    """The last step's loss is read before anything trusts the weights it wrote: a checkpoint, validation, the end."""
    model = module()
    model.training_step(batch(model, float("inf")), 0)
    model.on_before_optimizer_step(None)
    arguments = ({},) if hook == "on_save_checkpoint" else ()
    with pytest.raises(CaptionerError, match=r"^train/loss is nan at epoch 0, step 0: the model overflowed"):
        getattr(model, hook)(*arguments)


def test_a_non_finite_validation_loss_stops_at_the_epoch_s_end():
    model = module()
    model.validation_step({**batch(model, float("inf")), **decodable(2)}, 0)  # every process decodes to the end
    with pytest.raises(CaptionerError, match=r"^val/loss is nan at epoch 0, step 0: the model overflowed"):
        model._decode_epoch_end("val")
    model.validation_step({**batch(model), **decodable(2)}, 0)
    model._decode_epoch_end("val")  # the next validation starts afresh


def decodable(size: int) -> dict:
    """What validation needs of a batch besides its inputs and captions."""
    return {"references": [[["a"]]] * size, "objects": [None] * size, "canvas": [None] * size}


def test_a_batch_with_no_readable_image_is_skipped_by_one_process():
    model = module()
    empty = collate([None, None])
    assert empty == {}  # not None: Lightning would skip it before training_step, in this process alone
    assert model.training_step(empty, 0) is None  # no backward, no optimizer step
    assert model.validation_step(empty, 0) is None and model.predict_step(empty, 0) == []


@pytest.mark.parametrize("mode", ["soft", "hard"])
def test_under_ddp_a_batch_with_no_readable_image_is_a_zero_loss_over_every_trainable_weight(mode, monkeypatch):
    """What each process needs to stay in step with the others (the 2-process run: tests/test_ddp.py)."""
    model = module(attention_mode=mode, fine_tune_blocks=1)
    monkeypatch.setattr(lit_module, "distributed", lambda: True)
    monkeypatch.setattr(model.model, "update_baseline", lambda log_likelihood: calls.append(log_likelihood))
    calls = []
    loss = model.training_step({}, 0)
    assert loss.item() == 0.0
    loss.backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert any(p in set(model.model.encoder.parameters()) for p in trainable)  # the fine-tuned stage too
    assert all(p.grad is not None and not p.grad.any() for p in trainable)
    assert calls == ([None] if mode == "hard" else [])  # hard attention's baseline all-reduce, with nothing sampled


def test_the_split_s_attention_correctness_comes_with_its_uniform_baseline_and_its_ceiling():
    model = module()
    words = ["a", "red", "circle", "on", "the", "left"]
    references = [words]
    model._decoded = [
        Decoded(0, words, references, [0.5], [0.1], [0.8]),
        Decoded(1, words, references, [0.7, 0.9], [0.2, 0.3], [0.8, 0.9]),
        Decoded(0, words, references, [0.5], [0.1], [0.8]),  # repeated by DDP's sampler: counted once
    ]
    metrics = model._decode_epoch_end("test")
    assert metrics["test/bleu4"] == pytest.approx(1.0)
    assert metrics["test/attn_correctness"] == pytest.approx(0.7)  # per word, over the split
    assert metrics["test/attn_uniform_baseline"] == pytest.approx(0.2)
    assert metrics["test/attn_ceiling"] == pytest.approx(2.5 / 3)


def test_the_plateau_schedule_steps_once_per_validation_of_a_fit_on_its_metric(tmp_path):
    """Stepped at validation's end, where its metric has just been computed (before the epoch's checkpoints): once
    per epoch of a fit, not at the sanity check, not by a later `validate`, and on `lr_monitor`'s value."""
    import csv

    from torch.optim.lr_scheduler import ReduceLROnPlateau

    from captioner.cli import run_lightning_cli
    from tests.conftest import tiny_fit_args

    cli = run_lightning_cli(["fit", *tiny_fit_args(tmp_path, "--trainer.max_epochs=3", "--model.lr_patience=0")])
    scheduler = cli.trainer.lr_scheduler_configs[0].scheduler
    assert isinstance(scheduler, ReduceLROnPlateau)
    assert scheduler.last_epoch == 3  # three validations of the fit; the sanity check's is not one
    rows = csv.DictReader((tmp_path / "logs" / "debug" / "version_0" / "metrics.csv").read_text().splitlines())
    scores = [float(row["val/bleu4"]) for row in rows if row.get("val/bleu4")]
    assert len(scores) == 3 and any(scheduler.best == pytest.approx(score) for score in scores)
    cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    assert scheduler.last_epoch == 3


def test_the_compiled_step_and_the_finite_loss_check_read_nothing_of_the_device():
    """The fixed-shape (compiled) step in Lightning's loop: training_step and the backward pass queue their work
    without reading a value to the host, and so does the finite-loss check at each optimizer step: it reads the host
    copy of the previous step's loss (`FiniteLosses`), which on CUDA is pinned memory the step's copy went to without
    waiting. (A whole fit under the same check: tests/test_fit_host_syncs.py.)"""
    from tests.host_syncs import READS, HostSyncs

    model = module()
    model.model.fixed_shape = True

    def on_the_host():
        return [model.finite_losses.host]

    for _ in range(2):  # two optimizer steps, of two batches of gradients accumulated each
        for accumulated in range(2):
            with HostSyncs(on_the_host) as syncs:
                model.training_step(batch(model), accumulated).backward()
            assert syncs.seen == []
        with HostSyncs(on_the_host) as syncs:
            model.on_before_optimizer_step(None)
        assert syncs.seen == []
    with HostSyncs() as syncs:  # what the check does read: the host copy, once, at the next step
        model.on_before_optimizer_step(None)
    assert [what for what, _ in syncs.seen] == list(READS.values())
