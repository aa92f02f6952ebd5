"""The Python API: load a trained model and caption images.

    from captioner import Captioner
    c = Captioner.load("ucm")                    # a bundled model ("ucm", "shapes"), or a path to a checkpoint
    results = c.caption(["a.jpg", pil_image], beam_size=3)
    results[0].text, results[0].tokens, results[0].alphas, results[0].score

Loading never unpickles code: checkpoints are read with torch.load(weights_only=True).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from PIL import Image

from captioner.captioning import MAX_LEN, Backend, Caption, CaptionResult
from captioner.checkpoints import BUNDLED, build_model, export, locate, model_file
from captioner.data.vocab import Vocabulary, detokenize
from captioner.errors import ConfigError
from captioner.models.decoding import LENGTH_PENALTY
from captioner.models.show_attend_tell import ShowAttendTell

if TYPE_CHECKING:
    from captioner import onnx

__all__ = ["BUNDLED", "CaptionResult", "Captioner", "export"]


class Captioner(Backend):
    """A ShowAttendTell model with its vocabulary, ready to caption images (`caption`, `iter_captions`: the
    `captioner.captioning.Backend` surface, shared with `captioner.onnx.Captioner`).

    The model is for inference only: its encoder's BatchNorms are folded into its convolutions
    (`Encoder.fold_batchnorm`). `device` defaults to CUDA when present. `compile_decoder` compiles the search's whole
    work per word (the decoder's step, the choice of words, the beams' reordering) with torch.compile at fixed shapes
    (`AttentionDecoder.compile_search`), captured as CUDA graphs on CUDA: the searches then run sync-free. Each number
    of images per batch and beam size compiles once, at its first captions (seconds on a CPU, where it needs a C++
    compiler); captions are then faster (docs/benchmarks.md). `compile_encoder` compiles the encoder's forward the
    same way (`Encoder.compile_forward`): a graph per number of images a call has.
    """

    def __init__(
        self,
        model: ShowAttendTell,
        vocab: Vocabulary,
        device: torch.device | str | None = None,
        compile_decoder: bool = False,
        compile_encoder: bool = False,
        card: dict | None = None,
    ):
        self.card = card or {}
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = model.eval().to(self.device)
        self.model.encoder.fold_batchnorm()
        # CUDA graphs on CUDA: each word's, and the backbone's, many small kernels replayed in one launch
        options = {"mode": "reduce-overhead"} if self.device.type == "cuda" else {}
        if compile_decoder:
            self.model.decoder.compile_search(**options)
        if compile_encoder:
            self.model.encoder.compile_forward(**options)
        self.vocab = vocab
        self.transform = model.encoder.preprocessing.transforms()

    @property
    def image_size(self) -> int:
        """The side of the square the model's input is resized to."""
        return self.model.encoder.preprocessing.size

    @property
    def grid_hw(self) -> tuple[int, int]:
        """The attention grid's height and width: each result's alphas have grid_hw[0] * grid_hw[1] cells."""
        return self.model.encoder.grid_hw

    @classmethod
    def load(
        cls,
        checkpoint: str | Path = "shapes",
        device: torch.device | str | None = None,
        compile_decoder: bool = False,
        compile_encoder: bool = False,
    ) -> Captioner | onnx.Captioner:
        """Load a bundled model by name ("shapes", "ucm"), a file written by `captioner export`, or a `captioner fit`
        checkpoint (.ckpt); or a folder of `captioner export --format onnx`, whose `captioner.onnx.Captioner` (ONNX
        Runtime's, with the same `caption`, `iter_captions`, `image_size` and `grid_hw`) is returned. What the name
        means is decided by `captioner.checkpoints.locate`, for every command and this API alike."""
        located = locate(checkpoint)
        if located.onnx:
            if device is not None or compile_decoder or compile_encoder:
                raise ConfigError(
                    f"{checkpoint}: an ONNX export runs on ONNX Runtime, without torch's device and compile options: "
                    "captioner.onnx.Captioner(folder, providers=[...]) chooses its providers"
                )
            from captioner.onnx import Captioner as OnnxCaptioner

            return OnnxCaptioner(located.path)
        path = located.path
        file = model_file(path)
        model = build_model(file, str(path))
        return cls(model, Vocabulary(file.vocab), device, compile_decoder, compile_encoder, file.card)

    def generate_batch(
        self, images: list[Image.Image], beam_size: int, max_len: int | None, length_penalty: float | None
    ) -> list[Caption]:
        x = torch.stack([self.transform(image) for image in images]).to(self.device)  # (B,3,H,W)
        max_len = MAX_LEN if max_len is None else max_len
        length_penalty = LENGTH_PENALTY if length_penalty is None else length_penalty
        with torch.inference_mode():
            out = self.model.generate(images=x, beam_size=beam_size, max_len=max_len, length_penalty=length_penalty)
        captions = []
        for tokens, score, alphas in zip(out.tokens, out.scores, out.alphas, strict=True):
            words = self.vocab.decode_tokens(tokens.tolist())
            captions.append(Caption(words, detokenize(words), float(score), alphas[: len(words)].cpu()))
        return captions
