"""Random models and synthetic data of the real shapes: the decoder at the bundled model's sizes and the paper's,
annotations and captions of those sizes, JPEG files at COCO's sizes, and a Karpathy split of COCO's exact shape."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from captioner.models.decoder import AttentionDecoder

# name -> (P, E, D, A, M, V): grid positions, encoder channels, LSTM, attention, embedding and vocabulary sizes
SIZES = {
    "shapes": (49, 1280, 256, 256, 128, 32),  # the shapes decoder on EfficientNet-Lite0's 7x7 grid (feature_stride 32)
    "paper": (196, 2048, 512, 512, 512, 10000),  # a ResNet's 14x14 grid, the paper's decoder and vocabulary sizes
}
TINY = (9, 1280, 12, 10, 8, 30)  # --smoke: EfficientNet-Lite0's channels on a 3x3 grid, a few units a layer
SPECIAL = {"pad_index": 0, "start_index": 1, "end_index": 2}


def random_decoder(size: str | tuple, seed: int = 0) -> AttentionDecoder:
    """A decoder with random weights at `size` (a name in SIZES, or such a tuple), in eval mode, that never writes
    <end>: every search runs to its max_len, so that the figures compare batching, not how soon captions end."""
    P, E, D, A, M, V = SIZES[size] if isinstance(size, str) else size
    torch.manual_seed(seed)
    decoder = AttentionDecoder(
        vocab_size=V, encoder_dim=E, num_pixels=P, embed_dim=M, decoder_dim=D, attention_dim=A, dropout=0.0
    ).eval()
    with torch.no_grad():
        decoder.L_o.bias[SPECIAL["end_index"]] = -1e4
    return decoder


def annotations(size: str | tuple, batch: int, seed: int = 1) -> torch.Tensor:
    P, E, *_ = SIZES[size] if isinstance(size, str) else size
    return torch.randn(batch, P, E, generator=torch.Generator().manual_seed(seed)).relu()  # (B,P,E), as after a ReLU


def caption_batches(V: int, B: int, T: int = 16, count: int = 4, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """`count` batches of B captions (B,T) of 8 to T tokens (<start> and <end> included; one of T in each batch),
    padded, and their lengths (B,)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        lengths = torch.randint(8, T + 1, (B,), generator=generator)
        lengths[0] = T
        captions = torch.randint(3, V, (B, T), generator=generator)
        captions[:, 0] = SPECIAL["start_index"]
        captions[torch.arange(B), lengths - 1] = SPECIAL["end_index"]
        captions[torch.arange(T) >= lengths.unsqueeze(1)] = SPECIAL["pad_index"]
        out.append((captions, lengths))
    return out


IMAGE_SIZES = [(640, 480), (480, 640), (640, 427), (500, 375), (427, 640)]  # COCO's commonest image sizes
TYPES = 10_000  # word types: COCO's vocabulary at min_word_count 5 is about this size
COCO = {"train": 82_783, "restval": 30_504, "val": 5_000, "test": 5_000}  # Karpathy's split of COCO 2014


def write_images(folder: Path, names: list[str], distinct: int = 8, seed: int = 0) -> list[Path]:
    """JPEG files at COCO's sizes: `distinct` different ones (source_<i>.jpg, smooth noise), and `names` linked to
    them in turn, so that every image is read and decoded as a real one would be. Returns the distinct files."""
    folder.mkdir(parents=True, exist_ok=True)
    generator = np.random.default_rng(seed)
    sources = []
    for i in range(distinct):
        width, height = IMAGE_SIZES[i % len(IMAGE_SIZES)]
        coarse = generator.integers(0, 256, (height // 16 + 1, width // 16 + 1, 3), dtype=np.uint8)
        smooth = Image.fromarray(coarse).resize((width, height), Image.BICUBIC)
        noise = generator.normal(0, 12, (height, width, 3))
        pixels = np.clip(np.asarray(smooth, dtype=np.float32) + noise, 0, 255).astype(np.uint8)
        source = folder / f"source_{i}.jpg"
        Image.fromarray(pixels).save(source, quality=90)
        sources.append(source)
    for i, name in enumerate(names):
        os.symlink(sources[i % distinct].name, folder / name)
    return sources


def write_split(root: Path, counts: dict[str, int], seed: int = 0) -> int:
    """A synthetic Karpathy split of COCO's shape: `root/dataset_coco.json` (five captions an image of 7 + Poisson(3.5)
    words, COCO's mean; words from a Zipf distribution over TYPES types, each used at least five times in the
    training captions where there is room, so that min_word_count 5 gives COCO's vocabulary) and the images under
    root/train2014 and root/val2014 (`write_images`). `counts`: images per split (train, restval, val, test).
    Returns the number of images."""
    generator = np.random.default_rng(seed)
    total = sum(counts.values())
    lengths = 7 + generator.poisson(3.5, (total, 5))
    ranks = 1.0 / np.arange(1, TYPES + 1)
    words = generator.choice(TYPES, size=int(lengths.sum()), p=ranks / ranks.sum())
    train_words = int(lengths[: counts["train"] + counts["restval"]].sum())
    covered = min(train_words, 5 * TYPES)
    words[generator.permutation(train_words)[:covered]] = np.arange(covered) % TYPES
    vocabulary = [f"w{i}" for i in range(TYPES)]
    images, position, index = [], 0, 0
    folders = {"train": "train2014", "restval": "val2014", "val": "val2014", "test": "val2014"}
    names: dict[str, list[str]] = {"train2014": [], "val2014": []}
    for split, count in counts.items():
        for _ in range(count):
            sentences = []
            for length in lengths[index]:
                tokens = [vocabulary[w] for w in words[position : position + length]]
                position += length
                sentences.append({"tokens": tokens, "raw": " ".join(tokens)})
            name = f"COCO_{folders[split]}_{index:012d}.jpg"
            names[folders[split]].append(name)
            images.append(
                {"filepath": folders[split], "filename": name, "split": split, "cocoid": index, "sentences": sentences}
            )
            index += 1
    for folder, files in names.items():
        write_images(root / folder, files)
    (root / "dataset_coco.json").write_text(json.dumps({"images": images, "dataset": "coco"}))
    return total
