"""One shapes training epoch with the feature cache, against recomputing the frozen encoder every step.

    python benchmarks/epoch.py

Both runs use the configs/shapes.yaml model on a 1,000-image shapes training split, one random caption per image
per epoch (so the encoder runs once per image either way), batch 64, no validation. The one-off cost of building the
cache is reported separately.
"""

from __future__ import annotations

import tempfile
import time
import warnings

import lightning as L
from common import machine, result, table

from captioner.data.datamodules import ShapesDataModule
from captioner.lit_module import CaptioningModule

TRAIN = 1000


def run_epoch(data_dir: str, feature_cache: bool) -> tuple[float, float]:
    """(seconds for setup, including any cache build; seconds for the epoch)."""
    L.seed_everything(0, verbose=False)
    data = ShapesDataModule(
        data_dir=data_dir,
        train_size=TRAIN,
        val_size=8,
        test_size=8,
        batch_size=64,
        num_workers=2,
        feature_cache=feature_cache,
        train_captions="random",
    )
    model = CaptioningModule(
        data.vocab_tokens, embed_dim=128, decoder_dim=256, attention_dim=256, dropout=0.3, position_embedding=True
    )
    start = time.perf_counter()
    data.set_encoder(model.model.encoder)
    data.setup("fit")
    setup = time.perf_counter() - start
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    return setup, time.perf_counter() - start


def main() -> None:
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as folder:
        build, _ = run_epoch(folder, feature_cache=True)  # first run builds the cache
        _, cached = run_epoch(folder, feature_cache=True)
        _, recompute = run_epoch(folder, feature_cache=False)
    rows = [
        {"run": "build the cache (once)", "seconds": f"{build:.1f}"},
        {"run": "epoch reading the cache", "seconds": f"{cached:.1f}"},
        {"run": "epoch recomputing the encoder", "seconds": f"{recompute:.1f}"},
    ]
    print(f"{TRAIN} shapes images, 1 caption each, batch 64; {machine()}\n")
    print(table(rows))
    print(
        result(
            cache_build_s=f"{build:.1f}",
            epoch_cached_s=f"{cached:.1f}",
            epoch_recompute_s=f"{recompute:.1f}",
            speedup=f"{recompute / cached:.1f}",
        )
    )


if __name__ == "__main__":
    main()
