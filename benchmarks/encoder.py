"""Encoder speed (images/s): EfficientNet-Lite0 and ResNet-50 at 224x224, batches of 32, under inference mode, as
trained and with their BatchNorms folded into the convolutions (`Encoder.fold_batchnorm`, which `Captioner` calls).

    python benchmarks/encoder.py

Random weights (the speed does not depend on them). Each figure is the median of 5 timed batches after 2 untimed;
the two forms take turns, three rounds each, and the table gives the median round.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import Table, machine, out_folder, timed

from captioner.models.encoder import Encoder

BATCH = 32


def rates(backbone: str, images: torch.Tensor) -> dict:
    """Images/s of the encoder as trained and with its BatchNorms folded, taking turns over three rounds (medians)."""
    plain = Encoder(backbone, pretrained=False).eval()
    folded = Encoder(backbone, pretrained=False).eval()
    folded.load_state_dict(plain.state_dict())
    folded.fold_batchnorm()
    measured = {"as trained": [], "folded": []}
    with torch.inference_mode():
        for _ in range(3):
            for name, encoder in (("as trained", plain), ("folded", folded)):
                measured[name].append(BATCH / timed(lambda e=encoder: e(images), calls=5, warmup=2))
    before, after = (statistics.median(measured[name]) for name in measured)
    return {"as trained": f"{before:.1f}", "BatchNorm folded": f"{after:.1f}", "gain": f"{after / before:.2f}x"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="a folder for the table's rows (encoder.jsonl as measured, encoder.md)")
    options = parser.parse_args()
    print(f"# encoder.py on {machine()}")
    rows = Table("encoder", f"images/s, batches of {BATCH} at 224x224", out_folder(options.out))
    images = torch.randn(BATCH, 3, 224, 224)
    for backbone in ("efficientnet_lite0", "resnet50"):
        rows.measure({"backbone": backbone}, lambda backbone=backbone: rates(backbone, images))
    rows.finish()


if __name__ == "__main__":
    main()
