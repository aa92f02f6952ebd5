"""Lightning's `validate` loop under bf16-mixed: what `captioner.precision.cast_weights_once` gives it.

    python benchmarks/lightning_eval.py

Lightning's evaluation loops run under inference mode, in an autocast whose cast cache is off, so autocast would
cast every weight again at every op of every decoding step. The module's validation step (the loss on the first
reference and a greedy search, captioner.lit_module) runs inside `cast_weights_once`, which casts each weight once per
batch. This times `trainer.validate` on 512 shapes validation images from the feature cache (batch 64, the
configs/shapes.yaml model with random weights, so every caption runs to max_caption_len, 20 words) three ways: float32,
bf16-mixed, and bf16-mixed with `cast_weights_once` replaced by a no-op (the code before it). The ways take turns
over three rounds; each figure is from the fastest round.

Each `validate` is also split into its parts, timed inside the same run: the teacher-forced loss (the model's
forward), the greedy search (`generate`), the epoch-end metrics (BLEU-4 and CIDEr-D over the 512 captions), and the
rest (Lightning's loop, the batches, turning tokens into words, attention correctness). Only the first two depend on
the precision.

On a CPU without native bfloat16 the two bf16-mixed ways are left out unless BENCH_BF16=1 (common.bf16_timed_on_cpu),
and the table gives float32's `validate` and its parts alone.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
import warnings
from collections.abc import Iterator

import lightning as L
from common import bf16_skipped, bf16_timed_on_cpu, machine, result, table

from captioner import lit_module
from captioner.data.datamodules import ShapesDataModule
from captioner.lit_module import CaptioningModule

VAL, BATCH, ROUNDS, MAX_LEN = 512, 64, 3, 20
WAYS = (("32-true", True), ("bf16-mixed", True), ("bf16-mixed", False))


PARTS = ("loss", "search", "metrics")


@contextlib.contextmanager
def parts_timed(model: CaptioningModule) -> Iterator[dict[str, float]]:
    """Within the block, the seconds spent in each of PARTS, summed over the calls (instance attributes shadow the
    methods, and are removed at the end)."""
    seconds = dict.fromkeys(PARTS, 0.0)
    owners = {
        "loss": (model.model, "forward"),
        "search": (model.model, "generate"),
        "metrics": (model, "_decode_epoch_end"),
    }

    def timer(part, method):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                seconds[part] += time.perf_counter() - start

        return run

    for part, (owner, name) in owners.items():
        setattr(owner, name, timer(part, getattr(owner, name)))
    try:
        yield seconds
    finally:
        for owner, name in owners.values():
            delattr(owner, name)


def validate_seconds(model, data, precision: str) -> dict[str, float]:
    """Seconds of one `trainer.validate`, in total and by part."""
    trainer = L.Trainer(
        accelerator="cpu",
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with parts_timed(model) as seconds:
        start = time.perf_counter()
        trainer.validate(model, datamodule=data, verbose=False)
        total = time.perf_counter() - start
    return {"total": total, **seconds, "rest": total - sum(seconds.values())}


def model_seconds(seconds: dict[str, float]) -> float:
    return seconds["loss"] + seconds["search"]


def main() -> None:
    bf16_timed = bf16_timed_on_cpu()
    ways = WAYS if bf16_timed else WAYS[:1]
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
        fastest = {way: {"total": float("inf")} for way in ways}  # the fastest round of each way, with its parts
        original = lit_module.cast_weights_once
        for _ in range(ROUNDS):
            for precision, cast_once in ways:
                lit_module.cast_weights_once = original if cast_once else (lambda device: contextlib.nullcontext())
                try:
                    seconds = validate_seconds(model, data, precision)
                finally:
                    lit_module.cast_weights_once = original
                if seconds["total"] < fastest[precision, cast_once]["total"]:
                    fastest[precision, cast_once] = seconds
    rows = [
        {
            "precision": precision,
            "cast_weights_once": "yes" if cast_once else "no (before it)",
            "validate s": f"{fastest[precision, cast_once]['total']:.2f}",
            "images/s": f"{VAL / fastest[precision, cast_once]['total']:.0f}",
            **{f"{part} s": f"{fastest[precision, cast_once][part]:.2f}" for part in (*PARTS, "rest")},
        }
        for precision, cast_once in ways
    ]
    print(f"trainer.validate, {VAL} shapes images from the feature cache, batch {BATCH}; {machine()}\n")
    print(table(rows))
    fp32 = fastest[WAYS[0]]
    values = {}
    if bf16_timed:
        bf16, uncached = fastest[WAYS[1]], fastest[WAYS[2]]
        values = {
            "bf16_speedup": f"{fp32['total'] / bf16['total']:.2f}",
            "bf16_speedup_before": f"{fp32['total'] / uncached['total']:.2f}",
            "cast_weights_once_speedup": f"{uncached['total'] / bf16['total']:.2f}",
            "bf16_model_speedup": f"{model_seconds(fp32) / model_seconds(bf16):.2f}",
            "bf16_search_speedup": f"{fp32['search'] / bf16['search']:.2f}",
            "bf16_loss_speedup": f"{fp32['loss'] / bf16['loss']:.2f}",
        }
    else:
        print(f"\n{bf16_skipped()}")
    values["float32_metrics_share"] = f"{fp32['metrics'] / fp32['total']:.0%}"
    values["float32_model_share"] = f"{model_seconds(fp32) / fp32['total']:.0%}"
    print(result(**values))


if __name__ == "__main__":
    main()
