"""CaptioningModule: the Lightning wrapper around ShowAttendTell (loss, metrics, optimizers)."""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path
from typing import Literal, get_args

import lightning as L
import torch
import yaml
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch.optim.lr_scheduler import CosineAnnealingLR, ReduceLROnPlateau

from captioner.checkpoints import (
    RENAMED,
    Fingerprint,
    load_initial_weights,
    read,
    renamed,
    unpickling_error,
    with_encoder,
    without_encoder,
)
from captioner.data.vocab import Vocabulary
from captioner.distributed import FiniteLosses, RandomStates, distributed, gather, zero_loss
from captioner.errors import ConfigError, check_choice
from captioner.metrics import Decoded, decode_batch, split_scores
from captioner.models.decoding import Generation
from captioner.models.show_attend_tell import ShowAttendTell, compile_options
from captioner.objectives import Baseline, Objective, SelfCritical, TeacherForcing, check_options

CHECKPOINT = "the checkpoint"  # how a checkpoint loaded without a Trainer is named in errors (its path is not known)
# Options with a fixed set of values are typed with it: LightningCLI refuses others and lists these in --help; the
# checks in __init__ are for the Python API, which no type enforces.
LRSchedule = Literal["plateau", "cosine", "none"]
LRMonitor = Literal["val/bleu4", "val/cider"]  # what the plateau schedule can watch: computed at each validation's end
LR_SCHEDULES, LR_MONITORS = get_args(LRSchedule), get_args(LRMonitor)
COMPILE_CHOICES = ("auto", "true", "false")  # the command line gives true and false as booleans
TEACHER_FORCING = TeacherForcing()  # the paper's loss: training's by default, and validation's and test's always


def check_precision(precision: str) -> None:
    """Lightning's precisions that cast the weights themselves (16-true, bf16-true, 64-true) are refused in one line:
    the encoder's inputs and the feature cache stay float32, and Adam's updates of half-precision weights lose most of
    their bits. Mixed precision (16-mixed, bf16-mixed) runs the same kernels under autocast on float32 weights."""
    if precision.endswith("-true") and precision != "32-true":
        raise ConfigError(
            f"precision {precision} casts the weights themselves, which captioner does not train in: its inputs and "
            "feature cache are float32; use bf16-mixed or 16-mixed (autocast on float32 weights)"
        )


# A checkpoint's weights: the model's, and, under Lightning's weight averaging (WeightAveraging, EMAWeightAveraging),
# which puts the averaged weights under "state_dict", the weights being trained
WEIGHTS = ("state_dict", "current_model_state")


class CaptioningModule(L.LightningModule):
    """Trains and evaluates a ShowAttendTell model.

    Args:
        vocab: the vocabulary's words in id order (linked from the datamodule; stored in every checkpoint).
        fine_tune_blocks: unfreeze the encoder's last N stages (0: frozen, as in the paper).
        encoder_lr: learning rate of the unfrozen encoder stages.
        decoder_lr: learning rate of the decoder.
        weight_decay: Adam weight decay.
        lr_schedule: "plateau" (reduce on a stalled `lr_monitor`), "cosine" (over max_epochs) or "none".
        lr_monitor: metric the plateau schedule watches: "val/bleu4" or "val/cider". It is stepped at the end of each
            validation.
        lr_factor: plateau decay factor.
        lr_patience: plateau patience, in validation epochs.
        max_caption_len: longest generated caption, in words.
        beam_size: beam width of `predict` (validation and test decode greedily, one decode per image).
        objective: "xe", cross-entropy on the reference captions (the paper's), or "scst", self-critical sequence
            training: REINFORCE with the CIDEr-D of captions the model samples as their reward
            (`captioner.objectives`).
            Validation decodes greedily and scores with the corpus metrics either way.
        init_from: a checkpoint (or exported model) whose weights start this run, with a fresh optimizer and schedule:
            how an SCST run starts from a cross-entropy one. Not `--ckpt_path`, which resumes a run (a resumed run
            reads init_from too, then its own checkpoint over it).
        scst_samples: K, the captions drawn per image by SCST.
        scst_baseline: "others", the mean reward of the image's other K-1 captions (Luo 2020), or "greedy", the reward
            of its greedy caption (Rennie et al. 2017).
        compile: the training step's form. "auto" (on when training on CUDA), true or false. On: every caption of a
            batch runs the batch's steps (padding masked), nothing in training_step or the backward pass syncs with
            the host (the finite-loss check reads each optimizer step's loss a step late: `FiniteLosses`), and the loss
            (forward and backward) is compiled, with CUDA graphs on CUDA unless gradients are accumulated
            (`compile_options`). Off: the shrinking batch, fastest on a CPU. Both compute the same loss and gradients
            for the same random draws, but draw dropout's masks (and hard attention's locations) differently: their
            runs agree to rounding only with dropout 0 and soft attention (docs/benchmarks.md, "Speed on a GPU").
        compile_backend: torch.compile's backend for the compiled step (None: its default, Inductor, which needs a C++
            compiler on a CPU). "aot_eager" traces forward and backward without generating code: a quick check that
            a model compiles.
        **model_options: the model's hyper-parameters, see `ShowAttendTell` and `AttentionDecoder`.
    """

    def __init__(
        self,
        vocab: list[str],
        fine_tune_blocks: int = 0,
        encoder_lr: float = 1e-4,
        decoder_lr: float = 4e-4,
        weight_decay: float = 0.0,
        lr_schedule: LRSchedule = "plateau",
        lr_monitor: LRMonitor = "val/bleu4",
        lr_factor: float = 0.5,
        lr_patience: int = 2,
        max_caption_len: int = 30,
        beam_size: int = 3,
        objective: Objective = "xe",
        init_from: str | None = None,
        scst_samples: int = 5,
        scst_baseline: Baseline = "others",
        compile: bool | Literal["auto"] = "auto",
        compile_backend: str | None = None,
        **model_options,
    ):
        super().__init__()
        if encoder_lr <= 0 or decoder_lr <= 0:
            raise ConfigError(f"learning rates must be positive, got encoder_lr={encoder_lr}, decoder_lr={decoder_lr}")
        check_choice("lr_schedule", lr_schedule, LR_SCHEDULES)
        check_choice("lr_monitor", lr_monitor, LR_MONITORS)
        if str(compile).lower() not in COMPILE_CHOICES:
            raise ConfigError(f"compile must be auto, true or false, got {compile!r}")
        model_options = renamed(model_options)  # a checkpoint written before (load_from_checkpoint): current names
        self.save_hyperparameters()
        self.vocab = Vocabulary(vocab)
        self.model = ShowAttendTell(
            len(self.vocab),
            pad_index=Vocabulary.pad_index,
            start_index=Vocabulary.start_index,
            end_index=Vocabulary.end_index,
            **model_options,
        )
        check_options(objective, scst_samples, scst_baseline, self.model.attention_mode)
        self.model.encoder.fine_tune(fine_tune_blocks)
        self._decoded: list[Decoded] = []  # this validation's or test's captions so far
        self.objective: TeacherForcing | SelfCritical = TEACHER_FORCING  # SCST's is made when a fit starts
        self.finite_losses = FiniteLosses(self.where)  # a method, not a lambda: the module stays picklable

    @classmethod
    def load_from_checkpoint(
        cls, checkpoint_path, map_location=None, hparams_file=None, strict=None, **kwargs
    ) -> CaptioningModule:
        """Lightning's, reading weights only (`torch.load(weights_only=True)`: a file whose pickle would run code is
        refused in one line), from a local path, a file object or any fsspec URL. A local file written before options
        were renamed (`captioner.checkpoints.RENAMED`) has its hyper-parameters read under the current names first:
        Lightning checks them against this class's options before it makes the module. Only they are read for that
        (the weights are mapped, not read), and handed to Lightning as its `hparams_file`."""
        if kwargs.pop("weights_only", True) is not True:
            raise ConfigError("captioner reads checkpoints with weights_only=True: loading never runs pickled code")
        local = isinstance(checkpoint_path, (str, os.PathLike)) and "://" not in str(checkpoint_path)
        if local and hparams_file is None:
            hparams = read(checkpoint_path, mmap=True).get("hyper_parameters")
            if isinstance(hparams, dict) and RENAMED.keys() & hparams.keys():
                with tempfile.TemporaryDirectory() as folder:
                    hparams_file = Path(folder) / "hparams.yaml"
                    hparams_file.write_text(yaml.safe_dump(renamed(hparams)))
                    return cls._load(checkpoint_path, map_location, hparams_file, strict, **kwargs)
        return cls._load(checkpoint_path, map_location, hparams_file, strict, **kwargs)

    @classmethod
    def _load(cls, checkpoint_path, map_location, hparams_file, strict, **kwargs) -> CaptioningModule:
        try:
            return super().load_from_checkpoint(
                checkpoint_path, map_location, hparams_file, strict, weights_only=True, **kwargs
            )
        except pickle.UnpicklingError as err:
            raise unpickling_error(str(checkpoint_path), err) from None

    def configure_callbacks(self) -> list[Callback]:
        """What every Trainer of this module gets, whether the CLI made it or a script did: the random generators'
        states in each checkpoint, for an exact resume (`RandomStates`)."""
        return [RandomStates()]

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Leave out the encoder's weights when they are its pretrained source's, which loading rebuilds bit for bit
        (`captioner.checkpoints`): they would ride in every checkpoint unchanged. That holds for the weights being
        trained too, which Lightning's weight averaging (`EMAWeightAveraging`) keeps beside the averaged ones. First,
        the last step's loss is checked: a checkpoint never holds the weights of a step whose loss was not finite."""
        self.finite_losses.flush()
        for key in WEIGHTS:
            if key in checkpoint:
                weights, fingerprint = without_encoder(checkpoint[key], self.model.encoder, prefix="model.")
                if fingerprint is not None:
                    checkpoint[key] = weights
                    fingerprint.write(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        fingerprint, hparams = Fingerprint.read(checkpoint), checkpoint.get("hyper_parameters")
        trainer = self._attached_trainer()
        name = str(trainer.ckpt_path) if trainer is not None and trainer.ckpt_path else CHECKPOINT
        for key in WEIGHTS:
            if key in checkpoint:
                weights = checkpoint[key]
                checkpoint[key] = with_encoder(weights, self.model.encoder, fingerprint, name, "model.", hparams)

    def setup(self, stage: str) -> None:
        check_precision(self.trainer.precision)  # before Lightning casts the weights
        # Before Lightning restores a checkpoint: a resumed run then gets its own weights, not init_from's. (The
        # datamodule's loaders, and so its feature cache, are made later: from these weights.)
        if stage == "fit" and self.hparams.init_from:
            load_initial_weights(self.model, self.hparams.init_from, self.vocab.to_list())

    def compiles_step(self) -> bool:
        """Whether training uses the compiled fixed-shape step (`compile`): auto means on CUDA."""
        choice = str(self.hparams.get("compile", "auto")).lower()
        return choice == "true" or (choice == "auto" and self.device.type == "cuda")

    def on_fit_start(self) -> None:
        if self.compiles_step() and not self.model.fixed_shape:
            accumulate = self.trainer.accumulate_grad_batches
            options, note = compile_options(self.device.type, accumulate, self.hparams.get("compile_backend"))
            if note:
                rank_zero_info(note)
            self.model.compile_training_step(**options)
        if self.hparams.objective == "scst":  # document frequencies and references of the whole training split, once
            datamodule = self.trainer.datamodule
            if datamodule is None or "train" not in getattr(datamodule, "datasets", {}):
                raise ConfigError("objective scst needs captioner's datamodule: its training split's references")
            hp, references = self.hparams, datamodule.datasets["train"].references
            options = (hp.scst_samples, hp.scst_baseline, hp.max_caption_len, getattr(datamodule, "cache", None))
            self.objective = SelfCritical(references, self.vocab, *options)

    def _shared_step(self, batch: dict, stage: str, objective=None) -> torch.Tensor:
        """The loss of `objective` (validation and test: teacher forcing), logged under `stage` with its parts."""
        loss, parts = (objective or TEACHER_FORCING)(self.model, batch)
        B = batch["index"].numel() * batch.get("captions_per_image", 1)  # captions: a "grouped" batch has k an image
        self.finite_losses.add(stage, loss)
        # A training step's values go to the loggers every log_every_n_steps, not to the progress bar: Lightning reads
        # the progress bar's values to the host at every step, which would make the host wait for the device at every
        # step. The bar shows the loss that FiniteLosses copies to the host anyway (`ProgressBar`).
        training = stage == "train"
        self.log(f"{stage}/loss", loss, prog_bar=not training, batch_size=B)
        if training:  # the epoch's mean too: with fewer batches than log_every_n_steps, the only curve there is
            self.log("train/loss_epoch", loss, on_step=False, on_epoch=True, batch_size=B, sync_dist=True)
        for name, value in parts.items():
            self.log(f"{stage}/{name}", value, batch_size=B)
        return loss

    def where(self) -> str:
        return f"epoch {self.current_epoch}, step {self.global_step}"

    def _attached_trainer(self) -> L.Trainer | None:
        """The Trainer running this module; None for a module used without one (loaded for captioning, or a test's)."""
        try:
            return self.trainer
        except RuntimeError:  # "not attached to a `Trainer`"
            return None

    def _strategy(self):
        """Lightning's strategy, through which processes share values (`FiniteLosses`); None without a Trainer."""
        trainer = self._attached_trainer()
        return trainer.strategy if trainer is not None else None

    def on_before_optimizer_step(self, optimizer) -> None:
        # Every process stops on a NaN loss, or none; read a step late, so that the host never waits for the device
        self.finite_losses.check_step(self._strategy(), self.device)

    def on_validation_epoch_start(self) -> None:
        self.finite_losses.flush()  # the last training step's loss, before validation uses its weights

    def on_train_end(self) -> None:
        self.finite_losses.flush()  # the last step's

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor | None:
        if batch:
            return self._shared_step(batch, "train", self.objective)
        # Every image of the batch was unreadable (each was reported). In one process, None: Lightning skips the
        # backward pass and the optimizer step. Under DDP, where the other processes train on their batches, this one
        # takes part in the same collectives with nothing to add (`distributed.zero_loss`).
        if not distributed():
            return None
        if self.model.attention_mode == "hard":  # its baseline's update is one too
            self.model.update_baseline(None)
        return zero_loss(self)

    def _generate(self, batch: dict, beam_size: int = 1) -> Generation:
        """The batch's captions (greedy by default), at most `max_caption_len` words."""
        inputs = {"images": batch.get("images"), "annotations": batch.get("annotations")}
        return self.model.generate(**inputs, beam_size=beam_size, max_len=self.hparams.max_caption_len)

    def _decode_step(self, batch: dict, stage: str) -> None:
        """Loss on the first reference, then one greedy decode per image, scored at the epoch's end against all its
        references."""
        if not batch:  # no readable image in the batch (each was reported)
            return
        self._shared_step(batch, stage)
        self._decoded += decode_batch(batch, self._generate(batch), self.vocab, self.model.encoder.grid_hw)

    def _decode_epoch_end(self, stage: str) -> dict[str, float]:
        """Corpus metrics over the whole split: under DDP every rank's captions are gathered first, and the images
        that the DistributedSampler repeated to even out the ranks count once. Every rank gets the same values."""
        self.finite_losses.check_epoch(self._strategy(), self.device)  # every process stops on a NaN loss, or none
        decoded, self._decoded = gather(self._decoded), []
        metrics = {f"{stage}/{name}": value for name, value in split_scores(decoded).items()}
        for name, value in metrics.items():  # equal on every rank: "max" keeps it exact and Lightning's DDP check quiet
            self.log(name, value, prog_bar=name.endswith("bleu4"), sync_dist=True, reduce_fx="max")
        return metrics

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._decode_step(batch, "val")

    def on_validation_epoch_end(self) -> None:
        metrics = self._decode_epoch_end("val")
        # The plateau schedule steps here, where its metric has just been computed, rather than where Lightning would:
        # after the epoch's checkpoints are written. A resumed run would otherwise miss one of its steps.
        if self.trainer.state.fn == "fit" and not self.trainer.sanity_checking:
            scheduler = self.lr_schedulers()  # configure_optimizers makes one at most
            if isinstance(scheduler, ReduceLROnPlateau):
                scheduler.step(metrics[self.hparams.lr_monitor])

    def lr_scheduler_step(self, scheduler, metric) -> None:
        if not isinstance(scheduler, ReduceLROnPlateau):  # that one: at validation's end
            super().lr_scheduler_step(scheduler, metric)

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self._decode_step(batch, "test")

    def on_test_epoch_end(self) -> None:
        self._decode_epoch_end("test")

    def predict_step(self, batch: dict, batch_idx: int) -> list[dict]:
        if not batch:  # no readable image in the batch (each was reported)
            return []
        generation = self._generate(batch, self.hparams.beam_size)
        return [
            {"index": int(i), "caption": self.vocab.decode(tokens), "score": float(score) if score.isfinite() else None}
            for i, tokens, score in zip(batch["index"], generation.tokens.tolist(), generation.scores, strict=True)
        ]

    def configure_optimizers(self):
        hp = self.hparams
        groups = [{"params": list(self.model.decoder.parameters()), "lr": hp.decoder_lr}]
        encoder_params = [p for p in self.model.encoder.parameters() if p.requires_grad]
        if encoder_params:
            groups.append({"params": encoder_params, "lr": hp.encoder_lr})
        optimizer = torch.optim.Adam(groups, weight_decay=hp.weight_decay)
        if hp.lr_schedule == "cosine":
            cosine = CosineAnnealingLR(optimizer, T_max=max(1, self.trainer.max_epochs or 1))
            return {"optimizer": optimizer, "lr_scheduler": cosine}
        if hp.lr_schedule == "none":
            return optimizer
        # Stepped by on_validation_epoch_end; Lightning saves and restores its state. strict=False: a run without
        # validation (limit_val_batches=0) warns that the metric is missing, not crash.
        plateau = ReduceLROnPlateau(optimizer, "max", hp.lr_factor, hp.lr_patience)
        scheduler = {"scheduler": plateau, "monitor": hp.lr_monitor, "strict": False}
        return {"optimizer": optimizer, "lr_scheduler": scheduler}
