"""What every captioner offers, written once for its two backends: `captioner.Captioner` (torch) and
`captioner.onnx.Captioner` (ONNX Runtime). Reading, batching and results live here; a backend says only how a batch
of images becomes word ids, scores and attention (`Backend.generate_batch`). No torch: deploy/ installs this file as
`captioner_onnx.captioning`.

    results = captioner.caption(["a.jpg", pil_image], beam_size=3)
    results[0].text, results[0].tokens, results[0].alphas, results[0].score, results[0].grid_hw
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from .data.images import ImageError, read_batches  # relative: the same file in deploy/'s captioner_onnx

MAX_LEN = 30  # the longest caption a search writes, by default


@dataclass
class CaptionResult:
    """One image's caption. `alphas` has one (P,) attention row per word of `tokens` (<end> excluded), float32: a
    torch tensor from `captioner.Captioner`, a numpy array from `captioner.onnx.Captioner`; `grid_hw` is the grid its
    P cells form."""

    source: str
    text: str
    tokens: list[str]
    alphas: Any  # (len(tokens), P)
    score: float
    grid_hw: tuple[int, int]
    image: Image.Image


@dataclass
class Caption:
    """A backend's caption of one image (`Backend.generate_batch`): its words (<end> excluded), its text, its score
    (the sum of its words' log-probabilities) and each word's attention (len(words), P)."""

    words: list[str]
    text: str
    score: float
    alphas: Any


class Backend(ABC):
    """A captioner: images in, captions out, in batches, in order, holding one batch in memory. `card` is what a
    published model says of itself (its data, licence, training command and scores, and a `note` on what it has seen:
    `captioner.checkpoints.ModelFile.card`); empty for other models."""

    card: dict[str, Any] = {}  # noqa: RUF012  (each captioner sets its own; this one is never changed)

    @property
    @abstractmethod
    def image_size(self) -> int:
        """The side of the square the model's input is resized to."""

    @property
    @abstractmethod
    def grid_hw(self) -> tuple[int, int]:
        """The attention grid's height and width: each result's alphas have grid_hw[0] * grid_hw[1] cells."""

    @abstractmethod
    def generate_batch(
        self, images: list[Image.Image], beam_size: int, max_len: int | None, length_penalty: float | None
    ) -> list[Caption]:
        """RGB images -> their captions, in order; None takes the model's default."""

    def iter_captions(
        self,
        images: Iterable[str | Path | Image.Image],
        beam_size: int = 3,
        batch_size: int = 16,
        max_len: int | None = None,
        length_penalty: float | None = None,
    ) -> Iterator[CaptionResult | ImageError]:
        """Caption images (paths or PIL images) in batches, in order, holding only one batch in memory. A file that
        cannot be read yields its ImageError in its place, and the other images are still captioned. `max_len` and
        `length_penalty` default to the model's (30 words; score / length**1)."""
        for batch in read_batches(images, batch_size):
            if isinstance(batch, ImageError):
                yield batch
                continue
            captions = self.generate_batch([image for _, image in batch], beam_size, max_len, length_penalty)
            for (source, image), caption in zip(batch, captions, strict=True):
                alphas = caption.alphas[: len(caption.words)]
                yield CaptionResult(source, caption.text, caption.words, alphas, caption.score, self.grid_hw, image)

    def caption(
        self,
        images: Sequence[str | Path | Image.Image] | str | Path | Image.Image,
        beam_size: int = 3,
        batch_size: int = 16,
        max_len: int | None = None,
        length_penalty: float | None = None,
    ) -> list[CaptionResult]:
        """Caption images (paths or PIL images); raises ImageError naming the first file that cannot be read."""
        if isinstance(images, (str, Path, Image.Image)):
            images = [images]
        results = []
        for result in self.iter_captions(images, beam_size, batch_size, max_len, length_penalty):
            if isinstance(result, ImageError):
                raise result
            results.append(result)
        return results
