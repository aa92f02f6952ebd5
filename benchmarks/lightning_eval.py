"""Lightning's `validate` loop under bf16-mixed: what `captioner.precision.cast_weights_once` gives it.

    python benchmarks/lightning_eval.py

Lightning's evaluation loops run under inference mode, in an autocast whose cast cache is off, so autocast would
cast every weight again at every op of every decoding step. The module's validation step (the loss on the first
reference and a greedy search, captioner.lit_module) runs inside `cast_weights_once`, which casts each weight once per
batch. This times `trainer.validate` on 512 shapes validation images from the feature cache (batch 64, the
configs/shapes.yaml model with random weights, so every caption runs to max_caption_len, 20 words) three ways: float32,
bf16-mixed, and bf16-mixed with `cast_weights_once` replaced by a no-op (the code before it). The ways take turns
over three rounds; each figure is the fastest round.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
import warnings

import lightning as L
from common import machine, result, table

from captioner import lit_module
from captioner.data.datamodules import ShapesDataModule
from captioner.lit_module import CaptioningModule

VAL, BATCH, ROUNDS, MAX_LEN = 512, 64, 3, 20
WAYS = (("32-true", True), ("bf16-mixed", True), ("bf16-mixed", False))


def validate_seconds(model, data, precision: str) -> float:
    trainer = L.Trainer(
        accelerator="cpu",
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.validate(model, datamodule=data, verbose=False)
    return time.perf_counter() - start


def main() -> None:
    warnings.filterwarnings("ignore")
    L.seed_everything(0, verbose=False)
    with tempfile.TemporaryDirectory() as root:
        data = ShapesDataModule(
            data_dir=root, train_size=8, val_size=VAL, test_size=8, batch_size=BATCH, num_workers=0, feature_cache=True
        )
        model = CaptioningModule(
            data.vocab_tokens,
            embed_dim=128,
            decoder_dim=256,
            attention_dim=256,
            position_embedding=True,
            max_caption_len=MAX_LEN,
        )
        data.set_encoder(model.model.encoder)
        data.setup("validate")  # builds the feature cache, untimed
        seconds = dict.fromkeys(WAYS, float("inf"))
        original = lit_module.cast_weights_once
        for _ in range(ROUNDS):
            for precision, cast_once in WAYS:
                lit_module.cast_weights_once = original if cast_once else (lambda device: contextlib.nullcontext())
                try:
                    seconds[precision, cast_once] = min(
                        seconds[precision, cast_once], validate_seconds(model, data, precision)
                    )
                finally:
                    lit_module.cast_weights_once = original
    rows = [
        {
            "precision": precision,
            "cast_weights_once": "yes" if cast_once else "no (before it)",
            "validate s": f"{seconds[precision, cast_once]:.2f}",
            "images/s": f"{VAL / seconds[precision, cast_once]:.0f}",
        }
        for precision, cast_once in WAYS
    ]
    print(f"trainer.validate, {VAL} shapes images from the feature cache, batch {BATCH}; {machine()}\n")
    print(table(rows))
    fp32, bf16, uncached = (seconds[way] for way in WAYS)
    print(
        result(
            bf16_speedup=f"{fp32 / bf16:.2f}",
            bf16_speedup_before=f"{fp32 / uncached:.2f}",
            cast_weights_once_speedup=f"{uncached / bf16:.2f}",
        )
    )


if __name__ == "__main__":
    main()
