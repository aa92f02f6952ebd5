"""The Lightning side of the `captioner` command: LightningCLI, the prediction writer, checkpoint loading.

Kept apart from `captioner.cli` so that `captioner caption` and `captioner export` start without importing
Lightning (about a second on a 2-core machine).
"""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import (
    BasePredictionWriter,
    Callback,
    Checkpoint,
    ModelCheckpoint,
    TQDMProgressBar,
)
from lightning.pytorch.callbacks.progress import ProgressBar as AnyProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from PIL import Image

from captioner.checkpoints import WITHOUT_SOURCE, Fingerprint, read, unpickling_error
from captioner.errors import CaptionerError, ConfigError
from captioner.files import replace_atomically, write_text_atomically
from captioner.lit_module import CHECKPOINT, CaptioningModule, gather

QUIETED = (  # Lightning's warnings that do not apply to captioner's runs
    r".*module\(s\) in eval mode at the start of training.*",  # a frozen encoder's BatchNorms (Encoder.train)
    r".*is smaller than the logging interval Trainer\(log_every_n_steps.*",  # train/loss_epoch is logged anyway
    r".*isinstance\(treespec, LeafSpec\).*",  # raised inside Lightning by newer torch; nothing a user can act on
)


class _NoTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


# Where Lightning logs its rank-zero messages (the fabric and pytorch packages each point the same helpers at theirs)
RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Leave out of a command's output the "💡 Tip" lines with which Lightning advertises its cloud products, and its
    warnings that do not apply here (`QUIETED`); every other message stays. Both filters are removed afterwards."""
    loggers, tips = [logging.getLogger(name) for name in RANK_ZERO_LOGGERS], _NoTips()
    for logger in loggers:
        logger.addFilter(tips)
    try:
        with warnings.catch_warnings():
            for pattern in QUIETED:
                warnings.filterwarnings("ignore", message=pattern)
            yield
    finally:
        for logger in loggers:
            logger.removeFilter(tips)


@rank_zero_only
def say(message: str) -> None:
    """One line on stderr, from the first process only."""
    print(message, file=sys.stderr, flush=True)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, writing beside the checkpoint and renaming it into place (captioner.files), and
    its reader, reading weights only.

    Lightning's own writer goes through a temporary file in the system's temp folder, which is moved by copying when
    that folder is on another file system (a tmpfs /tmp, say): a kill during the copy leaves a torn checkpoint. Its
    reader (`--ckpt_path` of fit, validate, test and predict) unpickles what a file holds when asked to; this one
    never does (`torch.load(weights_only=True)`), and a file whose pickle would run code is refused in one line.
    """

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict:
        try:
            if map_location is None:
                return super().load_checkpoint(path, weights_only=True)
            return super().load_checkpoint(path, map_location, weights_only=True)
        except pickle.UnpicklingError as err:
            raise unpickling_error(str(path), err) from None

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if "://" in str(path):  # a remote file system: fsspec's transaction, as Lightning does
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_atomically(path, lambda file: torch.save(checkpoint, file))


class LastCheckpoint(Checkpoint):
    """Writes last.ckpt at the end of every training epoch, whatever the monitored metric did, and optionally every N
    training steps too. `captioner fit ... --ckpt_path last` resumes from it.

    Lightning's `ModelCheckpoint(save_last=True)` writes last.ckpt only when it writes a top-k checkpoint, so a
    resumed run would go back to the best epoch and train every epoch since then again.

    Args:
        dirpath: the folder (in the CLI, linked from `checkpoint.dirpath`).
        every_n_train_steps: also write it every N training steps (0: at epoch ends only). A run resumed from a
            checkpoint written within an epoch continues at its global step, but Lightning cannot restore the
            position in the epoch's shuffled order (it warns): the rest of that epoch is drawn afresh.
    """

    def __init__(self, dirpath: str | None = None, every_n_train_steps: int = 0):
        if every_n_train_steps < 0:
            raise ConfigError(f"every_n_train_steps must be >= 0, got {every_n_train_steps}")
        self.dirpath, self.every_n_train_steps = dirpath, every_n_train_steps

    def _save(self, trainer: Trainer) -> None:
        if trainer.fast_dev_run or trainer.sanity_checking:
            return
        folder = Path(self.dirpath) if self.dirpath else Path(trainer.default_root_dir) / "checkpoints"
        trainer.save_checkpoint(
            folder / f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}{ModelCheckpoint.FILE_EXTENSION}", weights_only=False
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.every_n_train_steps and trainer.global_step % self.every_n_train_steps == 0:
            self._save(trainer)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        # After CaptioningModule's own on_train_epoch_end (Lightning calls checkpoint callbacks last), after
        # validation, early stopping and the plateau schedule's step: the state the next epoch starts from.
        self._save(trainer)


class ProgressBar(TQDMProgressBar):
    """Lightning's progress bar, which `captioner fit` shows by default, with `loss`: the mean training loss of the
    previous optimizer step (over its accumulated batches and every process), as the finite-loss check copied it to the
    host (`FiniteLosses`). A step's own values are not read for it: that would make the host wait for the device at
    every step. The logged curves (`train/loss` every log_every_n_steps, `train/loss_epoch`) are in the loggers.

    `--trainer.enable_progress_bar=false` turns it off; a progress bar among `--trainer.callbacks` replaces it.
    """

    def get_metrics(self, trainer: Trainer, pl_module) -> dict:
        items = super().get_metrics(trainer, pl_module)
        finite_losses = getattr(pl_module, "finite_losses", None)
        if trainer.training and finite_losses is not None and finite_losses.last_loss is not None:
            items["loss"] = finite_losses.last_loss
        return items


class AttentionImages(Callback):
    """At the end of each validation, logs the per-word attention overlays of the first `count` validation images to
    TensorBoard (one image per validation image: the picture, then one tile per generated word, as `captioner caption
    --overlays` draws them), so they can be watched while a model trains. Without a TensorBoardLogger it does nothing.

    Args:
        count: how many validation images, always the same ones.
    """

    def __init__(self, count: int = 4):
        self.count = count

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: CaptioningModule) -> None:
        boards = [logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]
        if not boards or trainer.sanity_checking or not trainer.is_global_zero or trainer.datamodule is None:
            return
        split = trainer.datamodule.split("val")
        pictures = [split.load_image(i) for i in range(min(self.count, len(split)))]
        for i, (_, sheet) in enumerate(captions_with_overlays(pl_module, pictures)):
            pixels = torch.from_numpy(np.array(sheet)).permute(2, 0, 1)  # (3,H,W) uint8, a writable copy
            for board in boards:
                board.experiment.add_image(f"attention/val_{i}", pixels, trainer.global_step)


def captions_with_overlays(
    module: CaptioningModule, pictures: list[Image.Image]
) -> list[tuple[list[str], Image.Image]]:
    """Each picture's greedy caption by `module` (its words) and its attention overlays (`attention_grid`): what
    `captioner demo --overlays` writes and `AttentionImages` logs."""
    from captioner.visualize import attention_grid

    if not pictures:  # `captioner demo --samples 0`
        return []
    encoder = module.model.encoder
    transform = encoder.preprocessing.transforms()
    images = torch.stack([transform(picture) for picture in pictures]).to(module.device)  # (N,3,H,W)
    generation = module.model.generate(images=images, max_len=module.hparams.max_caption_len)
    results = []
    for picture, tokens, alphas in zip(pictures, generation.tokens.tolist(), generation.alphas.cpu(), strict=True):
        words = module.vocab.decode_tokens(tokens)
        results.append((words, attention_grid(picture, words, alphas[: len(words)], encoder.grid_hw)))
    return results


class PredictionWriter(BasePredictionWriter):
    """Writes `captioner predict` results as JSON lines, one per image in index order: index, caption, score (and
    image_id when known). Under DDP every rank's captions are gathered and rank 0 writes each image once (the
    DistributedSampler repeats a few images to even out the ranks).

    Args:
        output: the JSON-lines file to write.
    """

    def __init__(self, output: str = "predictions.jsonl"):
        super().__init__(write_interval="epoch")
        self.output = Path(output)

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices) -> None:
        records = {r["index"]: r for r in gather([r for batch in predictions for r in batch])}
        if not trainer.is_global_zero:
            return
        source = trainer.datamodule.split("test") if trainer.datamodule is not None else None
        lines = []
        for index in sorted(records):
            record = records[index]
            if source is not None and hasattr(source, "image_id"):
                record = {"image_id": source.image_id(index), **record}
            lines.append(json.dumps(record) + "\n")
        self.output.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(self.output, "".join(lines))
        print(f"wrote {self.output}")


MATMUL_PRECISIONS = ("auto", "highest", "high", "medium")


def set_matmul_precision(choice: str) -> None:
    """`--float32_matmul_precision`: torch.set_float32_matmul_precision, for this run only (the CLI's choice, never
    set by importing captioner). "auto" is "high" where CUDA is present, TF32 matmuls on Ampere and later GPUs (what
    Lightning's warning asks for), and leaves float32 as it is on a machine without CUDA."""
    if choice == "auto":
        if not torch.cuda.is_available():
            return
        choice = "high"
    torch.set_float32_matmul_precision(choice)


class CaptionerCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument(
            "--float32_matmul_precision",
            default="auto",
            choices=MATMUL_PRECISIONS,
            help="float32 matrix products on a GPU: auto (high on CUDA: TF32), highest (full float32), high, medium",
        )
        parser.add_lightning_class_args(PredictionWriter, "predictions")
        # The vocabulary is decided by the data (its training split), once, and handed to the model.
        parser.link_arguments("data.vocab_tokens", "model.vocab", apply_on="instantiate")
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")  # best.ckpt, by the monitored metric
        parser.add_lightning_class_args(LastCheckpoint, "last_checkpoint")
        parser.link_arguments("checkpoint.dirpath", "last_checkpoint.dirpath")
        parser.set_defaults(
            {
                "checkpoint.monitor": "val/bleu4",
                "checkpoint.mode": "max",
                "checkpoint.filename": "best",
                "checkpoint.enable_version_counter": False,
            }
        )

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        set_matmul_precision(config.get("float32_matmul_precision", "auto"))

    def before_fit(self) -> None:
        """`--ckpt_path last` with no last.ckpt yet, as at a preemptible job's first start: one line says so and the
        run starts from scratch. (Lightning would warn with a hint about `save_last` that does not apply here.)"""
        config = self.config_init[self.subcommand]
        if config.get("ckpt_path") != "last":
            return
        dirpaths = [getattr(callback, "dirpath", None) for callback in self.trainer.checkpoint_callbacks]
        folders = sorted({str(Path(dirpath).resolve()) for dirpath in dirpaths if dirpath})
        if folders and not any((Path(folder) / "last.ckpt").is_file() for folder in folders):
            say(f"no last.ckpt in {', '.join(folders)}: starting from scratch")
            config["ckpt_path"] = None

    def instantiate_trainer(self, **kwargs) -> Trainer:
        config = self._get(self.config_init, "trainer", default={})
        callbacks = config.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        wanted = config.get("enable_progress_bar") is not False
        if wanted and not any(isinstance(callback, AnyProgressBar) for callback in callbacks):
            kwargs.setdefault("callbacks", [*callbacks, ProgressBar()])  # in place of Lightning's default bar
        trainer = super().instantiate_trainer(**kwargs)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default: write atomically instead
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        return trainer


def load_module(checkpoint: str) -> CaptioningModule:
    """Load a CaptioningModule checkpoint, turning a missing or foreign file into a one-line error."""
    state = read(checkpoint, mmap=True)  # a missing or foreign file is named in one line; Lightning reads it next
    if "hyper_parameters" not in state or "state_dict" not in state:
        raise CaptionerError(f"{checkpoint}: not a captioner checkpoint (not written by `captioner fit`)")
    try:
        # A checkpoint that holds its encoder's weights needs no pretrained ones, only to overwrite them; one that left
        # them out has them rebuilt from their source.
        options = {} if Fingerprint.read(state) is not None else WITHOUT_SOURCE
        return CaptioningModule.load_from_checkpoint(checkpoint, map_location="cpu", **options)
    except CaptionerError as err:  # from the module's on_load_checkpoint, which cannot know the file's name
        raise CaptionerError(str(err).replace(CHECKPOINT, checkpoint, 1)) from None
    except (KeyError, RuntimeError, TypeError, ValueError) as err:
        detail = (str(err).strip().splitlines() or [""])[0][:100]
        raise CaptionerError(f"{checkpoint}: not a captioner checkpoint ({type(err).__name__}: {detail})") from None
