"""`captioner.onnx.Captioner`: caption images with a model that `captioner export --format onnx` wrote, on ONNX Runtime,
with numpy and Pillow: no torch.

    from captioner.onnx import Captioner
    captioner = Captioner("shapes_onnx/")
    results = captioner.caption(["a.jpg", pil_image], beam_size=3)
    results[0].text, results[0].score, results[0].alphas, results[0].grid_hw
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
from PIL import Image

# Relative imports: the same files are `captioner.onnx` in the full package and `captioner_onnx.onnx` in deploy/
from ..data.images import ImageError, read_batches
from ..errors import CaptionerError
from .resize import resize
from .search import Generation, SearchError, beam_search, greedy_search

FORMAT = 1  # the captioner.json layout read here (captioner.onnx_export.FORMAT)
GRAPHS = ("encoder", "start", "step")


@dataclass
class CaptionResult:
    """One image's caption, as `captioner.Captioner`'s: `alphas` has one (P,) attention row per word of `tokens`
    (<end> excluded), here a float32 numpy array; `grid_hw` is the grid those P cells form."""

    source: str
    text: str
    tokens: list[str]
    alphas: np.ndarray  # (len(tokens), P)
    score: float
    grid_hw: tuple[int, int]
    image: Image.Image


def providers() -> list[str]:
    """CUDA's execution provider when this ONNX Runtime has it (onnxruntime-gpu), then the CPU's."""
    available = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]


def session(path: str | Path, providers: Sequence[str] | None = None) -> ort.InferenceSession:
    """An ONNX Runtime session on `path`, its warnings silenced: the graph optimiser's notes on nodes it leaves as
    they are ("can't constant fold CastLike") are not the user's to act on; errors still raise."""
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors and fatal ones only
    return ort.InferenceSession(str(path), options, providers=list(providers) if providers else None)


def is_export(folder: str | Path) -> bool:
    """Whether `folder` is what `captioner export --format onnx` writes (it holds captioner.json)."""
    return (Path(folder) / "captioner.json").is_file()


class Captioner:
    """An exported model's three graphs on ONNX Runtime, and its search (`captioner.onnx.search`).

    Images are read as `captioner.Captioner` reads them (any mode, EXIF orientation) and resized as torchvision
    resizes them (`captioner.onnx.resize`): the annotations are the torch model's, to float rounding.
    `providers` defaults to CUDA's when present, then the CPU's (`providers()`)."""

    def __init__(self, folder: str | Path, providers: Sequence[str] | None = None):
        self.folder = Path(folder)
        try:
            self.config = json.loads((self.folder / "captioner.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            reason = "no captioner.json (write one with `captioner export --format onnx`)"
            if not isinstance(err, FileNotFoundError):
                reason = f"cannot read its captioner.json ({err})"
            raise CaptionerError(f"{self.folder}: {reason}") from None
        if self.config.get("format") != FORMAT:
            raise CaptionerError(
                f"{self.folder}: captioner.json is format {self.config.get('format')!r}; this captioner.onnx reads "
                f"format {FORMAT} (export the model again with this version)"
            )
        chosen = list(providers) if providers is not None else globals()["providers"]()
        self.sessions = {}
        for graph in GRAPHS:
            path = self.folder / f"{graph}.onnx"
            if not path.is_file():
                raise CaptionerError(f"{path}: missing (the export is incomplete: export the model again)")
            try:
                self.sessions[graph] = session(path, chosen)
            except Exception as err:  # onnxruntime raises its own exception types, not one base class
                raise CaptionerError(f"{path}: ONNX Runtime cannot load it ({str(err).splitlines()[0]})") from None
        self.vocab: list[str] = self.config["vocab"]
        self.unspaced = set(self.config["unspaced"])
        self.grid_hw = tuple(self.config["grid"])

    @property
    def image_size(self) -> int:
        """The side of the square the model's input is resized to."""
        return self.config["image_size"]

    @property
    def providers(self) -> list[str]:
        return self.sessions["step"].get_providers()

    def preprocess(self, image: Image.Image) -> np.ndarray:
        """An RGB image -> the encoder's input (3,S,S) uint8: squashed to the model's square size as torchvision
        resizes it."""
        pixels = resize(np.asarray(image, dtype=np.uint8), self.config["image_size"], self.config["interpolation"])
        return np.ascontiguousarray(pixels.transpose(2, 0, 1))

    def annotate(self, images: np.ndarray) -> np.ndarray:
        """uint8 images (B,3,S,S) -> annotations (B,P,E)."""
        return self.sessions["encoder"].run(None, {"images": images})[0]

    def _step(self, tokens, h, c, annotations, keys):
        inputs = {"tokens": tokens, "h": h, "c": c, "annotations": annotations, "keys": keys}
        return self.sessions["step"].run(None, inputs)

    def generate(
        self,
        annotations: np.ndarray,
        beam_size: int = 3,
        max_len: int | None = None,
        length_penalty: float | None = None,
    ) -> Generation:
        """Annotations (B,P,E) -> each image's word ids, score and per-word attention (`captioner.onnx.search`):
        greedy when beam_size is 1, else beam search."""
        h, c, keys = self.sessions["start"].run(None, {"annotations": annotations})
        config = self.config
        special = {"start": config["start_index"], "end": config["end_index"], "pad": config["pad_index"]}
        max_len = self.config["max_len"] if max_len is None else max_len
        try:
            if beam_size == 1:
                return greedy_search(self._step, annotations, keys, h, c, max_len=max_len, **special)
            penalty = self.config["length_penalty"] if length_penalty is None else length_penalty
            return beam_search(
                self._step,
                annotations,
                keys,
                h,
                c,
                beam_size=beam_size,
                max_len=max_len,
                length_penalty=penalty,
                **special,
            )
        except SearchError as err:
            raise CaptionerError(str(err)) from None

    def iter_captions(
        self,
        images: Iterable[str | Path | Image.Image],
        beam_size: int = 3,
        batch_size: int = 16,
        max_len: int | None = None,
        length_penalty: float | None = None,
    ) -> Iterator[CaptionResult | ImageError]:
        """Caption images in batches, in order, holding one batch in memory; a file that cannot be read yields its
        ImageError in its place, and the others are still captioned (`captioner.Captioner.iter_captions`)."""
        for batch in read_batches(images, batch_size):
            if isinstance(batch, ImageError):
                yield batch
            else:
                yield from self._run(batch, beam_size, max_len, length_penalty)

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

    def words(self, ids: Iterable[int]) -> list[str]:
        """Word ids -> words, stopping at <end> and skipping <pad> and <start> (`Vocabulary.decode_tokens`)."""
        words = []
        for i in ids:
            if i == self.config["end_index"]:
                break
            if i not in (self.config["pad_index"], self.config["start_index"]):
                words.append(self.vocab[i])
        return words

    def text(self, ids: Sequence[int]) -> str:
        """Word ids -> text: words joined by spaces, except between two characters of an unspaced script
        (`captioner.data.vocab.detokenize`)."""
        kept = [i for i in ids if i not in (self.config["pad_index"], self.config["start_index"])]
        kept = kept[: kept.index(self.config["end_index"])] if self.config["end_index"] in kept else kept
        text = ""
        for previous, i in zip([None, *kept], kept, strict=False):
            joined = previous is not None and previous in self.unspaced and i in self.unspaced
            text += self.vocab[i] if previous is None or joined else " " + self.vocab[i]
        return text

    def _run(self, batch, beam_size, max_len, length_penalty) -> Iterator[CaptionResult]:
        images = np.stack([self.preprocess(image) for _, image in batch])
        out = self.generate(self.annotate(images), beam_size, max_len, length_penalty)
        for (source, image), ids, score, alphas in zip(batch, out.ids, out.scores, out.alphas, strict=True):
            words = self.words(ids)
            yield CaptionResult(source, self.text(ids), words, alphas[: len(words)], score, self.grid_hw, image)
