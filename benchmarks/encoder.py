"""Encoder speed (images/s): EfficientNet-Lite0 and ResNet-50 at 224x224, batches of 32, under inference mode, as
trained and with their BatchNorms folded into the convolutions (`Encoder.fold_batchnorm`, which `Captioner` calls).

    python benchmarks/encoder.py

Random weights (the speed does not depend on them). The two forms take turns batch by batch, 15 timed batches each
after 2 untimed; each figure is the median.
"""

from __future__ import annotations

import statistics

import torch
from common.harness import Script, take_turns

from captioner.models.encoder import Encoder

BATCH = 32


def rates(backbone: str, images: torch.Tensor) -> dict:
    """Images/s of the encoder as trained and with its BatchNorms folded, taking turns batch by batch (medians)."""
    plain = Encoder(backbone, pretrained=False).eval()
    folded = Encoder(backbone, pretrained=False).eval()
    folded.load_state_dict(plain.state_dict())
    folded.fold_batchnorm()
    with torch.inference_mode():
        measured = take_turns({"as trained": lambda: plain(images), "folded": lambda: folded(images)}, 15, warmup=2)
    if errors := [error for error in measured.values() if isinstance(error, BaseException)]:
        raise errors[0]
    before, after = (BATCH / statistics.median(seconds) for seconds in measured.values())
    return {"as trained": f"{before:.1f}", "BatchNorm folded": f"{after:.1f}", "gain": f"{after / before:.2f}x"}


def main() -> None:
    script = Script(__file__, __doc__)
    script.start()
    rows = script.table("encoder", f"images/s, batches of {BATCH} at 224x224")
    images = torch.randn(BATCH, 3, 224, 224)
    for backbone in ("efficientnet_lite0", "resnet50"):
        rows.measure({"backbone": backbone}, lambda backbone=backbone: rates(backbone, images))
    script.finish()


if __name__ == "__main__":
    main()
