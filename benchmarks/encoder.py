"""Input pipeline throughput: decode JPEG + transforms + DataLoader + encoder, against the raw encoder forward.

    python benchmarks/encoder.py

Both use the default efficientnet_lite0 encoder at 224x224, batch 32, under torch.inference_mode. The pipeline reads
256 JPEG files (drawn shapes images, written once to a temporary folder) through DataLoader workers, which share the
same cores as the encoder.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from common import machine, result, table, timed
from torch.utils.data import DataLoader, Dataset

from captioner.data.images import load_image
from captioner.data.shapes import ShapesDataset
from captioner.models.encoder import Encoder

N, BATCH = 256, 32


class JpegFolder(Dataset):
    def __init__(self, paths: list[Path], transform):
        self.paths, self.transform = paths, transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.transform(load_image(self.paths[index]))


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
    best = max(figures[w] for w in (0, 1, 2))
    print(f"batch {BATCH}, 224x224, efficientnet_lite0, channels_last; {machine()}\n")
    print(table(rows))
    print(
        result(
            raw_images_per_s=f"{figures['raw']:.1f}",
            pipeline_images_per_s=f"{best:.1f}",
            pipeline_over_raw=f"{best / figures['raw']:.2f}",
        )
    )


if __name__ == "__main__":
    main()
