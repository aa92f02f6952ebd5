"""What the feature cache saves: one training epoch of configs/shapes.yaml's model on 256 shapes images (1,280
captions, 20 steps of 64), with the frozen encoder's annotations read from the cache, and with the encoder run at
every step (`--data.init_args.feature_cache=false`).

    python benchmarks/epoch.py

Both through Lightning's Trainer, as `captioner fit` trains, with no validation. The cache is built before the timed
epoch (it is built once, by the first run on a dataset); building it is timed on its own. Each epoch is timed twice,
taking turns; the table gives the faster.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

import lightning as L
import yaml
from common import Table, machine, out_folder

from captioner.data.datamodules import ShapesDataModule
from captioner.lit_module import CaptioningModule

MODEL = yaml.safe_load((Path(__file__).parent.parent / "configs" / "shapes.yaml").read_text())["model"]


def fit_epoch(data_dir: str, feature_cache: bool) -> float:
    L.seed_everything(0, verbose=False)
    data = ShapesDataModule(data_dir, 256, 16, 16, batch_size=64, num_workers=2, feature_cache=feature_cache)
    model = CaptioningModule(data.vocab_tokens, **MODEL)
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
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="a folder for the table's rows (epoch.jsonl as measured, epoch.md)")
    options = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)  # the Trainer's own messages
    print(f"# epoch.py on {machine()}")
    rows = Table("epoch", "one epoch of configs/shapes.yaml's model, 256 images, seconds", out_folder(options.out))
    with tempfile.TemporaryDirectory() as data_dir:
        build = fit_epoch(data_dir, feature_cache=True)  # builds the cache, then trains
        rows.add({"epoch": "first epoch: building the cache, then training", "seconds": f"{build:.1f}"})
        times = {"annotations from the cache": [], "encoder at every step": []}
        for _ in range(2):  # taking turns; the faster of each
            for name in times:
                times[name].append(fit_epoch(data_dir, feature_cache=name.startswith("annotations")))
    uncached = min(times["encoder at every step"])
    for name, seconds in times.items():
        rows.add({"epoch": name, "seconds": f"{min(seconds):.1f}", "speed-up": f"{uncached / min(seconds):.1f}x"})
    rows.finish()


if __name__ == "__main__":
    main()
