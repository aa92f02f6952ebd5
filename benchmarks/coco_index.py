"""Indexing a COCO-format annotation file with 120,000 captions and building its vocabulary.

    python benchmarks/coco_index.py

Writes a synthetic captions_train2014.json (24,000 images x 5 captions, words drawn from a 12,000-word list) and
24,000 empty image files into a temporary folder, then times CocoDataModule(format="coco"): pycocotools indexing,
the bad-annotation check (every image file is looked up) and the vocabulary build. Peak memory is this process's
maximum resident set size, which includes the imports (torch, Lightning) measured before the work starts.
"""

from __future__ import annotations

import json
import random
import resource
import tempfile
import time
from pathlib import Path

from common import result, table

from captioner.data.datamodules import CocoDataModule

IMAGES, PER_IMAGE, WORDS = 24_000, 5, 12_000


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    rng = random.Random(0)
    words = [f"w{i}" for i in range(WORDS)]
    with tempfile.TemporaryDirectory() as root:
        root = Path(root)
        (root / "annotations").mkdir()
        (root / "train2014").mkdir()
        images, annotations = [], []
        for i in range(IMAGES):
            name = f"COCO_train2014_{i:012d}.jpg"
            (root / "train2014" / name).touch()
            images.append({"id": i, "file_name": name, "width": 640, "height": 480})
            for _ in range(PER_IMAGE):
                caption = " ".join(rng.choices(words, k=rng.randint(8, 16)))
                annotations.append({"id": len(annotations), "image_id": i, "caption": caption})
        (root / "annotations" / "captions_train2014.json").write_text(
            json.dumps({"images": images, "annotations": annotations, "info": {}, "licenses": []})
        )
        del images, annotations
        before = peak_mib()
        start = time.perf_counter()
        data = CocoDataModule(data_dir=str(root), format="coco", min_word_count=5, max_vocab_size=10_000)
        train = data.split("train")
        indexed = time.perf_counter() - start
        vocab = data.vocab
        total = time.perf_counter() - start
        peak = peak_mib()
    rows = [
        {"step": "index + check files", "seconds": f"{indexed:.1f}"},
        {"step": "index + check files + vocabulary", "seconds": f"{total:.1f}"},
        {"step": "peak RSS MiB (before work: imports)", "seconds": f"{peak:.0f} ({before:.0f})"},
    ]
    print(f"{len(train)} images, {len(train) * PER_IMAGE} captions, vocabulary {len(vocab)}\n")
    print(table(rows))
    print(
        result(
            captions=len(train) * PER_IMAGE,
            seconds=f"{total:.1f}",
            peak_rss_mib=f"{peak:.0f}",
            rss_before_mib=f"{before:.0f}",
            vocab=len(vocab),
        )
    )


if __name__ == "__main__":
    main()
