"""Indexing a COCO-format annotation file with 120,000 captions and building its vocabulary.

    python benchmarks/coco_index.py

Writes a synthetic captions_train2014.json (24,000 images x 5 captions, words drawn from a 12,000-word list) and
24,000 empty image files into a temporary folder, then times CocoDataModule(format="coco"): pycocotools indexing,
the bad-annotation check (every image file is looked up) and the vocabulary build. Peak memory is this process's
maximum resident set size in a fresh process, which includes its imports (torch, Lightning); the RSS after
those imports is reported too.
"""

from __future__ import annotations

import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import result, table

from captioner.data.datamodules import CocoDataModule

IMAGES, PER_IMAGE, WORDS = 24_000, 5, 12_000


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(root: Path) -> None:
    """Run in a fresh process, so that its peak memory is the indexing's (plus its imports), not the file writing's."""
    before = peak_mib()
    start = time.perf_counter()
    data = CocoDataModule(data_dir=str(root), format="coco", min_word_count=5, max_vocab_size=10_000)
    train = data.split("train")
    indexed = time.perf_counter() - start
    vocab = data.vocab
    total = time.perf_counter() - start
    print(
        json.dumps(
            {
                "images": len(train),
                "indexed": indexed,
                "total": total,
                "before": before,
                "peak": peak_mib(),
                "vocab": len(vocab),
            }
        )
    )


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
        child = subprocess.run([sys.executable, __file__, "--measure", str(root)], capture_output=True, text=True)
        if child.returncode:
            raise SystemExit(child.stderr)
        m = json.loads(child.stdout.strip().splitlines()[-1])
    captions = m["images"] * PER_IMAGE
    rows = [
        {"step": "index + check every image file", "value": f"{m['indexed']:.1f} s"},
        {"step": "index + check files + vocabulary", "value": f"{m['total']:.1f} s"},
        {"step": "peak RSS of the process", "value": f"{m['peak']:.0f} MiB"},
        {"step": "RSS after imports (torch, Lightning), before the work", "value": f"{m['before']:.0f} MiB"},
    ]
    print(f"{m['images']} images, {captions} captions, vocabulary {m['vocab']}\n")
    print(table(rows))
    print(
        result(
            captions=captions,
            seconds=f"{m['total']:.1f}",
            peak_rss_mib=f"{m['peak']:.0f}",
            rss_after_imports_mib=f"{m['before']:.0f}",
            vocab=m["vocab"],
        )
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--measure":
        measure(Path(sys.argv[2]))
    else:
        main()
