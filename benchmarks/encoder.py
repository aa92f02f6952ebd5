"""Input pipeline throughput: decode JPEG + transforms + DataLoader + encoder, against the raw encoder forward.

    python benchmarks/encoder.py

Both use the default efficientnet_lite0 encoder at 224x224, batch 32, under torch.inference_mode. The pipeline reads
256 JPEG files (drawn shapes images, written once to a temporary folder) through DataLoader workers, which share the
same cores as the encoder.

A second table times the raw forward of two backbones as the library runs them for inference, with each BatchNorm
folded into the convolution before it (captioner.models.encoder.batchnorm_folded), and unfolded
(`Encoder.fold_batchnorm = False`), taking turns over three rounds, fastest call: efficientnet_lite0 (batch 32) and
resnet50 (random weights, batch 16), with the memory the folded copy takes. Then the bundled shapes model captions
256 test images (beam 3) both ways: how many captions are identical.

A table printed between those two shows what persistent workers (the library's DataLoaders keep theirs:
`persistent_workers=True` whenever `num_workers > 0`) save: three epochs of the same JPEG loader alone (no encoder),
2 workers, with and without persistent workers, under each process start method: "fork" (Linux's default) and
"spawn" (macOS's and Windows' only one, where each new worker starts a Python interpreter and imports torch and
captioner again).
Without persistent workers every epoch starts its workers anew; with them only the first does.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from unittest.mock import patch

import torch
from common import machine, result, same_bundled_captions, table, timed
from torch.utils.data import DataLoader, Dataset

from captioner.data.images import load_image
from captioner.data.shapes import ShapesDataset
from captioner.models.encoder import Encoder

N, BATCH = 256, 32
ROUNDS = 3


class JpegFolder(Dataset):
    def __init__(self, paths: list[Path], transform):
        self.paths, self.transform = paths, transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.transform(load_image(self.paths[index]))


EPOCHS = 3


def worker_rows(dataset: Dataset) -> tuple[list[dict], dict]:
    """Per start method and persistent setting: the first epoch, the later ones, and how long a later epoch waits for
    its first batch, over EPOCHS epochs of the loader alone (2 workers)."""
    rows, figures = [], {}
    for method in ("fork", "spawn"):
        for persistent in (True, False):
            loader = DataLoader(
                dataset,
                batch_size=BATCH,
                num_workers=2,
                persistent_workers=persistent,
                multiprocessing_context=method,
            )
            epochs, first_batches = [], []
            for _ in range(EPOCHS):
                start = time.perf_counter()
                for i, _images in enumerate(loader):
                    if i == 0:
                        first_batches.append(time.perf_counter() - start)
                epochs.append(time.perf_counter() - start)
            del loader  # ends persistent workers before the next setting starts its own
            later = statistics.mean(epochs[1:])
            figures[(method, persistent)] = later
            rows.append(
                {
                    "start method": method,
                    "persistent workers": "yes (the library)" if persistent else "no",
                    "first epoch s": f"{epochs[0]:.2f}",
                    "later epochs s (mean)": f"{later:.2f}",
                    "first batch of a later epoch s (mean)": f"{statistics.mean(first_batches[1:]):.2f}",
                }
            )
    return rows, figures


def folding_rows() -> tuple[list[dict], dict[str, float]]:
    """Raw forward images/s of each backbone, BatchNorm folded and unfolded."""
    rows, speedups = [], {}
    for backbone, batch in (("efficientnet_lite0", BATCH), ("resnet50", 16)):
        encoder = Encoder(backbone, pretrained=backbone == "efficientnet_lite0").eval()
        x = torch.randn(batch, 3, 224, 224)
        seconds = {True: float("inf"), False: float("inf")}
        with torch.inference_mode():
            for _ in range(ROUNDS):
                for fold in (True, False):
                    encoder.fold_batchnorm = fold
                    seconds[fold] = min(seconds[fold], timed(lambda encoder=encoder, x=x: encoder(x), 2, best=True))
            encoder.fold_batchnorm = True
            folded = encoder(x)
            encoder.fold_batchnorm = False
            unfolded = encoder(x)
            error = float((folded - unfolded).abs().max() / unfolded.abs().max())
        copy = encoder.__dict__["_folded"][1]  # the folded copy the encoder keeps (captioner.models.encoder)
        copy_mib = sum(t.numel() * t.element_size() for t in (*copy.parameters(), *copy.buffers())) / 2**20
        speedups[backbone] = seconds[False] / seconds[True]
        rows.append(
            {
                "backbone": backbone,
                "batch": batch,
                "folded images/s": f"{batch / seconds[True]:.1f}",
                "unfolded images/s": f"{batch / seconds[False]:.1f}",
                "speed-up": f"{speedups[backbone]:.2f}x",
                "largest difference (relative)": f"{error:.1e}",
                "folded copy MiB": f"{copy_mib:.1f}",
            }
        )
    return rows, speedups


def main() -> None:
    encoder = Encoder("efficientnet_lite0").eval()
    rows, figures = [], {}
    raw = torch.randn(BATCH, 3, 224, 224)
    with torch.inference_mode():
        seconds = timed(lambda: encoder(raw), repeats=5)
    figures["raw"] = BATCH / seconds
    rows.append({"what": "raw encoder forward (random tensors)", "workers": "-", "images/s": f"{figures['raw']:.1f}"})
    with tempfile.TemporaryDirectory() as folder:
        shapes = ShapesDataset("test", N, seed=1)
        paths = []
        for i in range(N):
            paths.append(Path(folder) / f"{i:04d}.jpg")
            shapes.load_image(i).save(paths[-1], quality=90)
        dataset = JpegFolder(paths, encoder.preprocessing.transforms())
        for workers in (0, 1, 2):
            loader = DataLoader(dataset, batch_size=BATCH, num_workers=workers, persistent_workers=workers > 0)

            def epoch(loader=loader):
                with torch.inference_mode():
                    for images in loader:
                        encoder(images)

            seconds = timed(epoch, repeats=2)
            figures[workers] = N / seconds
            rows.append(
                {
                    "what": "JPEG -> transforms -> DataLoader -> encoder",
                    "workers": workers,
                    "images/s": f"{figures[workers]:.1f}",
                }
            )
        workers, kept = worker_rows(dataset)
    best = max(figures[w] for w in (0, 1, 2))
    print(f"batch {BATCH}, 224x224, efficientnet_lite0, channels_last; {machine()}\n")
    print(table(rows))
    print(f"\n{EPOCHS} epochs of the loader alone (no encoder), 2 workers, with and without persistent workers:\n")
    print(table(workers))
    folding, speedups = folding_rows()
    print("\nThe raw forward with each BatchNorm folded into its convolution (the library's default) and unfolded:\n")
    print(table(folding))

    def folding(flag: bool):
        return lambda captioner: patch.object(captioner.model.encoder, "fold_batchnorm", flag)

    same = same_bundled_captions(folding(False), folding(True), n=256, batch_size=64)
    print(f"\nBundled shapes model, 256 test images, beam 3: {same} captions identical folded and unfolded")
    print(
        result(
            raw_images_per_s=f"{figures['raw']:.1f}",
            pipeline_images_per_s=f"{best:.1f}",
            pipeline_over_raw=f"{best / figures['raw']:.2f}",
            lite0_fold_speedup=f"{speedups['efficientnet_lite0']:.2f}",
            resnet50_fold_speedup=f"{speedups['resnet50']:.2f}",
            fold_same_captions=same,
            fork_persistent_epoch_speedup=f"{kept[('fork', False)] / kept[('fork', True)]:.2f}",
            spawn_persistent_epoch_speedup=f"{kept[('spawn', False)] / kept[('spawn', True)]:.2f}",
        )
    )


if __name__ == "__main__":
    main()
