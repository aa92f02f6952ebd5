"""What the feature cache saves: one training epoch of configs/shapes.yaml's model on 256 shapes images (1,280
captions, 20 steps of 64), with the frozen encoder's annotations read from the cache, and with the encoder run at
every step (`--data.init_args.feature_cache=false`).

    python benchmarks/epoch.py

Both through Lightning's Trainer, as `captioner fit` trains, with no validation. The cache is built before the timed
epoch (it is built once, by the first run on a dataset); building it is timed on its own. Each epoch is timed twice,
taking turns; the table gives the faster.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from pathlib import Path

import lightning as L
import yaml
from common.harness import Script, one_line, take_turns, timings

from captioner.data.datamodules import ShapesDataModule
from captioner.lit_module import CaptioningModule

MODEL = yaml.safe_load((Path(__file__).parent.parent / "configs" / "shapes.yaml").read_text())["model"]


def epoch(data_dir: str, feature_cache: bool) -> Callable[[], None]:
    """One epoch's fit, made ready (the data, the model, the Trainer), so that timing its call times the epoch."""
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
    return lambda: trainer.fit(model, datamodule=data)


def main() -> None:
    script = Script(__file__, __doc__)
    script.start()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)  # the Trainer's own messages
    rows = script.table("epoch", "one epoch of configs/shapes.yaml's model, 256 images, seconds")
    with tempfile.TemporaryDirectory() as data_dir:
        build = timings(epoch(data_dir, feature_cache=True), calls=1, warmup=0)[0]  # builds the cache, then trains
        rows.add({"epoch": "first epoch: building the cache, then training", "seconds": f"{build:.1f}"})
        ready = {"annotations from the cache": True, "encoder at every step": False}
        ready = {name: iter([epoch(data_dir, cache), epoch(data_dir, cache)]) for name, cache in ready.items()}
        times = take_turns({name: lambda fits=fits: next(fits)() for name, fits in ready.items()}, calls=2, warmup=0)
    uncached = times["encoder at every step"]
    for name, seconds in times.items():
        if isinstance(seconds, BaseException) or isinstance(uncached, BaseException):
            rows.add({"epoch": name, "error": one_line(seconds if isinstance(seconds, BaseException) else uncached)})
            continue
        rows.add({"epoch": name, "seconds": f"{min(seconds):.1f}", "speed-up": f"{min(uncached) / min(seconds):.1f}x"})
    script.finish()


if __name__ == "__main__":
    main()
