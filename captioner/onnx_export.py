"""`captioner export --format onnx`: a trained model as three ONNX graphs and one JSON file, which `captioner.onnx`
runs on ONNX Runtime without PyTorch.

The folder holds:
- `encoder.onnx`: images (B,3,S,S), uint8, already resized to the model's input size -> annotations (B,P,E); the
  preprocessing's normalisation is inside the graph, and the backbone's BatchNorms are folded into its convolutions;
- `start.onnx`: annotations (B,P,E) -> the LSTM's initial state h, c (B,D) and the attention's keys (B,P,A), computed
  once per batch (`AttentionDecoder.init_state`, `prepare`);
- `step.onnx`: the previous words (B,G), the state h, c (B,G,D), the annotations and keys -> the next words'
  log-probabilities (B,G,V) (float32, log-softmax taken), the new state and each row's attention (B,G,P): one word
  of G hypotheses per image (`AttentionDecoder.step`);
- `captioner.json`: the vocabulary, the special tokens, the input size and resampling filter, the grid, and the
  search's defaults (the length penalty, the longest caption).

Made by torch's exporter through `torch.export` (`torch.onnx.export(..., dynamo=True)`), opset `OPSET`. The batch (B),
the hypotheses per image (G) and the grid's cells (P) are dynamic axes, P where the model allows it (a model with a
position embedding, such as the bundled one, has one per cell of its grid). With `int8`, weights are quantized by
ONNX Runtime's dynamic quantization (`onnxruntime.quantization.quantize_dynamic`): "step", the decoder step's (its
matrix products: the LSTM, the attention, the output layer), or "all", the encoder's convolutions too. On this
project's CPUs, the encoder's int8 convolutions are several times slower than its float ones and change most
captions (docs/benchmarks.md, "ONNX Runtime and int8"): "step" is the one to ship.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from captioner.checkpoints import build_model, model_file, resolve
from captioner.data.vocab import _patterns
from captioner.errors import CaptionerError, ConfigError, check_choice, install_hint
from captioner.files import write_text_atomically
from captioner.models.decoding import LENGTH_PENALTY
from captioner.models.show_attend_tell import ShowAttendTell

OPSET = 18
FORMAT = 1  # captioner.json's layout; captioner.onnx reads this one
MAX_LEN = 30  # the search's default longest caption, as `Captioner.caption`'s
GRAPHS = ("encoder", "start", "step")
STEP_INPUTS = ("tokens", "h", "c", "annotations", "keys")
OUTPUTS = {"encoder": ["annotations"], "start": ["h", "c", "keys"], "step": ["log_probs", "h_next", "c_next", "alpha"]}


class EncoderGraph(nn.Module):
    """uint8 images (B,3,S,S) -> annotations (B,P,E)."""

    def __init__(self, model: ShowAttendTell):
        super().__init__()
        self.encoder = model.encoder

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.encoder(images)


class StartGraph(nn.Module):
    """annotations (B,P,E) -> h, c (B,D), keys (B,P,A)."""

    def __init__(self, model: ShowAttendTell):
        super().__init__()
        self.decoder = model.decoder

    def forward(self, annotations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, c = self.decoder.init_state(annotations)
        return h, c, self.decoder.prepare(annotations)


class StepGraph(nn.Module):
    """One word of G hypotheses per image: tokens (B,G), h, c (B,G,D), annotations (B,P,E), keys (B,P,A) ->
    log-probabilities (B,G,V), h, c (B,G,D), alpha (B,G,P)."""

    def __init__(self, model: ShowAttendTell):
        super().__init__()
        self.decoder = model.decoder

    def forward(self, tokens, h, c, annotations, keys):
        B, G = tokens.shape
        logits, (h, c), alpha = self.decoder.step(
            tokens.reshape(-1), (h.flatten(0, 1), c.flatten(0, 1)), annotations, keys
        )
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        return log_probs.view(B, G, -1), h.view(B, G, -1), c.view(B, G, -1), alpha.float().view(B, G, -1)


INT8 = {"step": ("step",), "all": ("encoder", "step")}  # --int8's choices: the graphs quantized


def export_onnx(checkpoint: str | Path, output: str | Path, name: str | None = None, int8: str | None = None) -> Path:
    """Write `checkpoint`'s model (a fit checkpoint, an exported file or a bundled model's name) to the folder `output`
    (the module's docstring); with `int8` ("step" or "all", `INT8`), those graphs quantized. Returns the folder."""
    if int8 is not None:
        check_choice("int8", int8, INT8)
    missing = [name for name in ("onnx", "onnxscript", "onnxruntime") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"an ONNX export needs {', '.join(missing)}: {install_hint('onnx')}")
    name = name or str(checkpoint)
    file = model_file(resolve(checkpoint), name)
    model = build_model(file, name).eval()
    model.encoder.fold_batchnorm()
    if hasattr(model.decoder.attention, "chunked"):  # the additive scorer: one graph for any batch
        model.decoder.attention.chunked = False
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    # captioner.json, written last, marks the folder complete: a kill mid-export leaves no folder that loads with
    # some graphs of another model
    (output / "captioner.json").unlink(missing_ok=True)
    S = model.encoder.preprocessing.size
    B, G, P = torch.export.Dim("images", min=1), torch.export.Dim("hypotheses", min=1), torch.export.Dim("cells", min=1)
    cells = None if model.decoder.position is not None else P  # a position embedding fixes the grid
    grid = model.encoder.num_pixels
    images = torch.zeros(2, 3, S, S, dtype=torch.uint8)
    with torch.no_grad():
        annotations = model.encoder(images)
        h, c, keys = StartGraph(model)(annotations)
    tokens = torch.full((2, 3), model.start_index, dtype=torch.long)
    h3, c3 = h[:, None].repeat(1, 3, 1), c[:, None].repeat(1, 3, 1)  # two tensors: one passed twice is one input
    graphs = {
        "encoder": (EncoderGraph(model), (images,), {"images": {0: B}}, ["images"], OUTPUTS["encoder"]),
        "start": (
            StartGraph(model),
            (annotations,),
            {"annotations": {0: B, 1: cells}},
            ["annotations"],
            OUTPUTS["start"],
        ),
        "step": (
            StepGraph(model),
            (tokens, h3, c3, annotations, keys),
            {
                "tokens": {0: B, 1: G},
                "h": {0: B, 1: G},
                "c": {0: B, 1: G},
                "annotations": {0: B, 1: cells},
                "keys": {0: B, 1: cells},
            },
            list(STEP_INPUTS),
            OUTPUTS["step"],
        ),
    }
    for graph, (module, args, dynamic, inputs, outputs) in graphs.items():
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                module.eval(),
                args,
                dynamo=True,
                dynamic_shapes={k: {i: d for i, d in v.items() if d is not None} for k, v in dynamic.items()},
                input_names=inputs,
                output_names=outputs,
                opset_version=OPSET,
                optimize=False,  # onnxscript's constant folding fails on the LSTM cell's split (dynamic shapes)
                verbose=False,
            )
        if program is None:
            raise CaptionerError(f"{name}: torch's ONNX exporter gave nothing for its {graph} graph")
        program.save(str(output / f"{graph}.onnx"))
    unspaced = _patterns()[1]
    vocab = file.vocab
    config = {
        "format": FORMAT,
        "vocab": vocab,
        "unspaced": [i for i, word in enumerate(vocab) if unspaced.match(word)],  # joined without spaces
        "pad_index": model.pad_index,
        "start_index": model.start_index,
        "end_index": model.end_index,
        "image_size": S,
        "interpolation": model.encoder.preprocessing.interpolation,
        "grid": list(model.encoder.grid_hw),
        "cells": grid,
        "encoder_dim": model.encoder.out_dim,
        "length_penalty": LENGTH_PENALTY,
        "max_len": MAX_LEN,
        "opset": OPSET,
        "torch": torch.__version__,
        "int8": int8,  # the quantized graphs' choice, or null
    }
    check(model, output, name)
    if int8 is not None:
        quantize(output, INT8[int8])
    write_text_atomically(output / "captioner.json", json.dumps(config, indent=1, ensure_ascii=False))
    return output


# What `check` allows between a graph on ONNX Runtime and the model's function (float32 both; measured on the bundled
# model: log-probabilities within 8e-6, the other outputs within 2e-6 of their largest value).
LOG_PROB_ATOL = 1e-4  # a word's log-probability, where it decides captions: above LOG_PROB_FLOOR in either
LOG_PROB_FLOOR = -20.0  # a word less likely than e^-20 (2e-9) is chosen by no search
RELATIVE_ATOL = 1e-4  # every other output (annotations, state, keys, attention), times its largest value


def check(model: ShowAttendTell, folder: Path, name: str) -> None:
    """Run the three graphs on ONNX Runtime at other sizes than the export's examples (3 and 37 images; 1 and 4
    hypotheses; another number of cells where it is dynamic) and compare them with the model's own functions: an
    export that fixed a dynamic axis to its example's size, or computes another function, is an error here rather
    than wrong captions later. The words' log-probabilities are compared at a fixed tolerance wherever they can
    decide a caption (`LOG_PROB_ATOL`); a tolerance scaled by their largest magnitude would be set by the least likely
    word, and let errors of hundredths pass."""
    from captioner.onnx.runtime import session as open_session

    sessions = {graph: open_session(folder / f"{graph}.onnx", ["CPUExecutionProvider"]) for graph in GRAPHS}
    generator = torch.Generator().manual_seed(0)
    S = model.encoder.preprocessing.size
    want, got = {}, {}
    grid = model.encoder.num_pixels
    sizes = [(3, grid), (37, grid)]  # (images, cells)
    if model.decoder.position is None:  # the grid's cells are a dynamic axis too: a grid of another size
        sizes.append((5, grid // 2 + 1))
    for B, P in sizes:
        images = torch.randint(0, 256, (B, 3, S, S), dtype=torch.uint8, generator=generator)
        with torch.no_grad():
            if grid == P:
                annotations = model.encoder(images)
                want["encoder", f"{B} images"] = [annotations]
                got["encoder", f"{B} images"] = sessions["encoder"].run(None, {"images": images.numpy()})
            else:
                annotations = torch.rand(B, P, model.encoder.out_dim, generator=generator)
            want["start", f"{B} images, {P} cells"] = [*StartGraph(model)(annotations)]
            got["start", f"{B} images, {P} cells"] = sessions["start"].run(None, {"annotations": annotations.numpy()})
            h, c, keys = want["start", f"{B} images, {P} cells"]
            for G in (1, 4):
                tokens = torch.randint(0, model.decoder.vocab_size, (B, G), generator=generator)
                inputs = (tokens, h[:, None].repeat(1, G, 1), c[:, None].repeat(1, G, 1) * 0.5, annotations, keys)
                want["step", f"{B} images, {P} cells, {G} hypotheses"] = [*StepGraph(model)(*inputs)]
                feed = {n: x.numpy() for n, x in zip(STEP_INPUTS, inputs, strict=True)}
                got["step", f"{B} images, {P} cells, {G} hypotheses"] = sessions["step"].run(None, feed)
    for (graph, sizes), outputs in want.items():
        for output, w, g in zip(OUTPUTS[graph], outputs, got[graph, sizes], strict=True):
            if tuple(g.shape) != tuple(w.shape):
                shapes = f"{tuple(g.shape)}, not {tuple(w.shape)}"
                raise CaptionerError(f"{name}: the exported {graph} graph's {output} are {shapes} ({sizes})")
            error = (torch.from_numpy(g) - w).abs()
            if output == "log_probs":
                error = error.masked_fill(torch.maximum(w, torch.from_numpy(g)) <= LOG_PROB_FLOOR, 0.0)
                allowed = LOG_PROB_ATOL
            else:
                allowed = RELATIVE_ATOL * (1 + float(w.abs().max()))
            if not float(error.max()) <= allowed:  # NaN fails too
                raise CaptionerError(
                    f"{name}: the exported {graph} graph's {output} are not the model's ({sizes}: off by "
                    f"{float(error.max()):.2g}, more than {allowed:.2g})"
                )


def quantize(folder: Path, graphs: tuple[str, ...]) -> None:
    """The weights of `graphs` as int8, in place: ONNX Runtime's dynamic quantization (weights stored as int8, one
    scale per output channel; activations quantized at run time)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    for graph in graphs:
        path = folder / f"{graph}.onnx"
        quantized = folder / f"{graph}.int8.onnx"
        # The exporter's shape annotations of intermediate values, some of which name the example's sizes: the
        # quantizer's shape inference before ONNX Runtime 1.32 refuses them where they disagree with its own
        model = onnx.load(str(path))
        model.graph.ClearField("value_info")
        with _without_preprocessing_advice():
            quantize_dynamic(model, str(quantized), weight_type=QuantType.QInt8, per_channel=True)
        quantized.replace(path)


@contextmanager
def _without_preprocessing_advice():
    """quantize_dynamic logs, on the root logger, advice to run its shape-inference pre-processing first; it changed
    nothing in these graphs' captions, so it is not shown."""

    def drop(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Please consider to run pre-processing")

    root = logging.getLogger()
    root.addFilter(drop)
    try:
        yield
    finally:
        root.removeFilter(drop)
