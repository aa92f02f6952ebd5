"""`captioner.onnx.Captioner`: caption images with a model that `captioner export --format onnx` wrote, on ONNX Runtime,
with numpy and Pillow: no torch.

    from captioner.onnx import Captioner
    captioner = Captioner("shapes_onnx/")
    results = captioner.caption(["a.jpg", pil_image], beam_size=3)
    results[0].text, results[0].score, results[0].alphas, results[0].grid_hw
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort
from PIL import Image

# Relative imports: the same files are `captioner.onnx` in the full package and `captioner_onnx.onnx` in deploy/
from ..captioning import Backend, Caption, CaptionResult
from ..errors import CaptionerError
from .layout import CONFIG, FORMAT, GRAPHS
from .resize import resize
from .search import SearchError, SearchOutput, Words, beam_search, greedy_search

__all__ = ["CaptionResult", "Captioner", "is_export", "providers", "session"]

RESIZES = ("pillow", "exact")  # Pillow's resampling, or torchvision's pixels to the bit (`captioner.onnx.resize`)
RESAMPLING = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC}


def providers() -> list[str]:
    """CUDA's execution provider when this ONNX Runtime has it (onnxruntime-gpu), then the CPU's."""
    available = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]


def session_options(threads: int | None = None, spinning: bool = False) -> ort.SessionOptions:
    """ONNX Runtime's options for a captioner's sessions: `threads` intra-op threads (None: ONNX Runtime's choice, one
    per physical core), and whether idle threads spin. Spinning is off by default: after each call ONNX Runtime's
    threads otherwise busy-wait for the next, and on a small CPU they take it from whatever else the process runs
    (a torch model, a web server's threads); a captioner's calls come in bursts, not in a tight loop
    (docs/benchmarks.md, "ONNX Runtime"). Warnings are silenced: the graph optimiser's notes on nodes it leaves as
    they are ("can't constant fold CastLike") are not the user's to act on; errors still raise."""
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors and fatal ones only
    if threads is not None:
        options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "1" if spinning else "0")
    return options


def session(
    path: str | Path, providers: Sequence[str] | None = None, options: ort.SessionOptions | None = None
) -> ort.InferenceSession:
    """An ONNX Runtime session on `path` with `options` (`session_options()` by default)."""
    options = options or session_options()
    return ort.InferenceSession(str(path), options, providers=list(providers) if providers else None)


def is_export(folder: str | Path) -> bool:
    """Whether `folder` is what `captioner export --format onnx` writes (it holds captioner.json)."""
    return (Path(folder) / CONFIG).is_file()


class Captioner(Backend):
    """An exported model's graphs on ONNX Runtime: the encoder, the start of a search, and the greedy and beam
    searches' words (`captioner.onnx.search`'s host loop runs them). `caption` and `iter_captions` are
    `captioner.Captioner`'s (`captioner.captioning.Backend`).

    Images are read as `captioner.Captioner` reads them (any mode, EXIF orientation), and squashed to the model's
    square input (`RESIZES`): by Pillow by default, whose resampling is torchvision's to within 2 levels (fewer than
    one value in 100 differs; docs/benchmarks.md measures what it does to captions) at a fifth of the numpy resize's
    time; or, with `resize="exact"`, by `captioner.onnx.resize`, torchvision's own pixels, to the bit. `providers`
    defaults to CUDA's when present, then the CPU's (`providers()`); `threads` and `spinning` set ONNX Runtime's
    threads (`session_options`), or `options` sets every option."""

    def __init__(
        self,
        folder: str | Path,
        providers: Sequence[str] | None = None,
        threads: int | None = None,
        spinning: bool = False,
        options: ort.SessionOptions | None = None,
        resize: str = "pillow",
    ):
        if resize not in RESIZES:
            raise CaptionerError(f"resize={resize!r}: one of {', '.join(RESIZES)}")
        self.folder, self.resize = Path(folder), resize
        try:
            self.config = json.loads((self.folder / CONFIG).read_text(encoding="utf-8"))
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
        options = options or session_options(threads, spinning)
        self.sessions = {}
        for graph in GRAPHS:
            path = self.folder / f"{graph}.onnx"
            if not path.is_file():
                raise CaptionerError(f"{path}: missing (the export is incomplete: export the model again)")
            try:
                self.sessions[graph] = session(path, chosen, options)
            except Exception as err:  # onnxruntime raises its own exception types, not one base class
                raise CaptionerError(f"{path}: ONNX Runtime cannot load it ({str(err).splitlines()[0]})") from None
        # where the word graphs' state lives between calls: on the GPU with CUDA's provider
        self.device = "cuda" if self.sessions["beam"].get_providers()[0] == "CUDAExecutionProvider" else "cpu"
        self.vocab: list[str] = self.config["vocab"]
        self.card: dict = self.config.get("card", {})
        self.unspaced = set(self.config["unspaced"])

    @property
    def image_size(self) -> int:
        return self.config["image_size"]

    @property
    def grid_hw(self) -> tuple[int, int]:
        return tuple(self.config["grid"])

    @property
    def providers(self) -> list[str]:
        return self.sessions["beam"].get_providers()

    def preprocess(self, image: Image.Image) -> np.ndarray:
        """An RGB image -> the encoder's input (3,S,S) uint8: squashed to the model's square size (`RESIZES`)."""
        size, mode = self.config["image_size"], self.config["interpolation"]
        if self.resize == "exact":
            pixels = resize(np.asarray(image, dtype=np.uint8), size, mode)
        else:
            pixels = np.asarray(image.resize((size, size), RESAMPLING[mode]), dtype=np.uint8)
        return np.ascontiguousarray(pixels.transpose(2, 0, 1))

    def annotate(self, images: np.ndarray) -> np.ndarray:
        """uint8 images (B,3,S,S) -> annotations (B,P,E)."""
        return self.sessions["encoder"].run(None, {"images": images})[0]

    def generate(
        self,
        annotations: np.ndarray,
        beam_size: int = 3,
        max_len: int | None = None,
        length_penalty: float | None = None,
    ) -> SearchOutput:
        """Annotations (B,P,E) -> each image's word ids, score and per-word attention (`captioner.onnx.search`):
        greedy when beam_size is 1, else beam search."""
        config = self.config
        h, c, keys = self.sessions["start"].run(None, {"annotations": annotations})
        max_len = config["max_len"] if max_len is None else max_len
        graph = "greedy" if beam_size == 1 else "beam"
        words = Words(self.sessions[graph], self.device, {"annotations": annotations, "keys": keys})
        common = {"start": config["start_index"], "pad": config["pad_index"], "n": config["words"], "max_len": max_len}
        try:
            if beam_size == 1:
                return greedy_search(words, annotations, keys, h, c, **common)
            penalty = config["length_penalty"] if length_penalty is None else length_penalty
            return beam_search(
                words, annotations, keys, h, c, **common, vocab_size=len(self.vocab), beam_size=beam_size,
                length_penalty=penalty,
            )  # fmt: skip
        except SearchError as err:
            raise CaptionerError(str(err)) from None

    def generate_batch(
        self, images: list[Image.Image], beam_size: int, max_len: int | None, length_penalty: float | None
    ) -> list[Caption]:
        out = self.generate(self.annotate(np.stack([self.preprocess(image) for image in images])), beam_size,
                            max_len, length_penalty)  # fmt: skip
        captions = []
        for ids, score, alphas in zip(out.ids, out.scores, out.alphas, strict=True):
            words = self.words(ids)
            captions.append(Caption(words, self.text(ids), score, alphas[: len(words)]))
        return captions

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
