"""The Lightning side of the `captioner` command: LightningCLI, the prediction writer, checkpoint loading.

Kept apart from `captioner.cli` so that `captioner caption` and `captioner export` start without importing
Lightning (about a second on a 2-core machine).
"""

from __future__ import annotations

import json
import pickle
import warnings
import zipfile
from pathlib import Path

from lightning.pytorch.callbacks import BasePredictionWriter, ModelCheckpoint
from lightning.pytorch.cli import LightningCLI

from captioner.errors import CaptionerError
from captioner.lit_module import CaptioningModule

# A frozen encoder keeps its BatchNorm layers in eval mode on purpose (see Encoder.train).
warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode at the start of training.*")
# Raised inside Lightning by newer torch versions; nothing a user of captioner can act on.
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")


class PredictionWriter(BasePredictionWriter):
    """Writes `captioner predict` results as JSON lines: index, caption, score (and image_id when known).

    Args:
        output: the JSON-lines file to write.
    """

    def __init__(self, output: str = "predictions.jsonl"):
        super().__init__(write_interval="epoch")
        self.output = Path(output)

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices) -> None:
        source = trainer.datamodule.split("test") if trainer.datamodule is not None else None
        self.output.parent.mkdir(parents=True, exist_ok=True)
        with self.output.open("w") as f:
            for record in (r for batch in predictions for r in batch):
                if source is not None and hasattr(source, "image_id"):
                    record = {"image_id": source.image_id(record["index"]), **record}
                f.write(json.dumps(record) + "\n")
        print(f"wrote {self.output}")


class CaptionerCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(PredictionWriter, "predictions")
        # The vocabulary is decided by the data (its training split), once, and handed to the model.
        parser.link_arguments("data.vocab_tokens", "model.vocab", apply_on="instantiate")
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults(
            {
                "checkpoint.monitor": "val/bleu4",
                "checkpoint.mode": "max",
                "checkpoint.save_last": True,
                "checkpoint.filename": "best",
                "checkpoint.enable_version_counter": False,
            }
        )


def load_module(checkpoint: str) -> CaptioningModule:
    """Load a CaptioningModule checkpoint, turning a missing or foreign file into a one-line error."""
    if not Path(checkpoint).is_file():
        raise CaptionerError(f"{checkpoint}: checkpoint not found")
    try:
        # Every weight is in the checkpoint: don't fetch pretrained backbone weights only to overwrite them.
        return CaptioningModule.load_from_checkpoint(checkpoint, map_location="cpu", pretrained=False)
    except (EOFError, pickle.UnpicklingError, zipfile.BadZipFile):
        raise CaptionerError(f"{checkpoint}: not a captioner checkpoint (not a PyTorch checkpoint file)") from None
    except (KeyError, RuntimeError, TypeError, ValueError) as err:
        detail = (str(err).strip().splitlines() or [""])[0][:100]
        raise CaptionerError(f"{checkpoint}: not a captioner checkpoint ({type(err).__name__}: {detail})") from None
