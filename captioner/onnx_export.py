"""`captioner export --format onnx`: a trained model as four ONNX graphs, their shared weights and one JSON file,
which `captioner.onnx` runs on ONNX Runtime without PyTorch.

The folder holds:
- `encoder.onnx`: images (B,3,S,S), uint8, already resized to the model's input size -> annotations (B,P,E); the
  preprocessing's normalisation is inside the graph, and the backbone's BatchNorms are folded into its convolutions;
- `start.onnx`: annotations (B,P,E) -> the LSTM's initial state h, c (B,D) and the attention's keys (B,P,A), computed
  once per batch (`AttentionDecoder.init_state`, `prepare`);
- `greedy.onnx` and `beam.onnx`: `WORDS` (4) words of the greedy and the beam search, every image (and hypothesis) at
  once, their state in and out (`GreedyWordsGraph`, `BeamWordsGraph`): the torch searches' own word functions
  (`captioner.models.decoding._greedy_words`, `captioner.models.beam_search._beam_words`, which a compiled decoder
  compiles), so that the top-k, the length penalty, the reorder by parent and the choice of each image's winner are
  written once, there;
  `captioner.onnx.search` only loops over them;
- `weights.bin`: the weights that more than one graph holds (the decoder's, in greedy and beam), written once
  and read by each as ONNX external data (`captioner.onnx_weights`);
- `captioner.json`: the vocabulary, the special tokens, the input size and resampling filter, the grid, and the
  search's defaults (the length penalty, the longest caption).

Made by torch's exporter through `torch.export` (`torch.onnx.export(..., dynamo=True)`), opset `OPSET`. The batch (B),
the beam's size (K) and the grid's cells (P) are dynamic axes, P where the model allows it (a model with a position
embedding, such as the bundled one, has one per cell of its grid). With `int8`, weights are quantized by ONNX
Runtime's dynamic quantization (`onnxruntime.quantization.quantize_dynamic`): "step", the decoder's in both word
graphs (its matrix products: the LSTM, the attention, the output layer), or "all", the encoder's convolutions too.
On this project's CPUs, the encoder's int8 convolutions are several times slower than its float ones and change most
captions (docs/benchmarks.md, "ONNX Runtime and int8"): "step" is the one to ship.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from captioner.captioning import MAX_LEN
from captioner.checkpoints import build_model, model_file, resolve
from captioner.data.vocab import _patterns
from captioner.errors import CaptionerError, ConfigError, check_choice, install_hint
from captioner.files import write_text_atomically
from captioner.models.beam_search import _beam_words, finished_extension
from captioner.models.decoding import LENGTH_PENALTY, _greedy_words
from captioner.models.show_attend_tell import ShowAttendTell
from captioner.onnx.layout import CONFIG, FORMAT, GRAPHS, INPUTS, OUTPUTS, STATE
from captioner.onnx_weights import share, store_float16

OPSET = 18
# The words a search's graph runs a call: the host reads whether every caption has ended once a call, and up to
# WORDS - 1 words run after the last one has. Chosen by measurement on 2 CPU cores, beam 3 (docs/benchmarks.md): 4
# words a call searched the UCM model's 64 images in 244 ms, against 272 ms for 2 and for 8 (a compiled decoder's
# CHECK_EVERY, made for GPUs, where each read makes the device wait) and 462 ms for 16.
WORDS = 4


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


class GreedyWordsGraph(nn.Module):
    """`words` words of the greedy search, every caption at once (`captioner.models.decoding._greedy_words`, the
    function a compiled decoder compiles): the search's state (each caption's last word (B,), h, c (B,D), score,
    length and finished flag (B,)), the annotations and keys -> the state after the words, and the words (B,words),
    their attention (B,words,P), and each caption's score and length after each word (B,words)."""

    def __init__(self, model: ShowAttendTell, words: int):
        super().__init__()
        self.decoder, self.words, self.pad, self.end = model.decoder, words, model.pad_index, model.end_index
        self.register_buffer("never", torch.tensor([model.pad_index, model.start_index]), persistent=False)

    def forward(self, tokens, h, c, scores, lengths, finished, annotations, keys):
        fixed = annotations, keys, self.never
        state = tokens, h, c, scores, lengths, finished
        state, *out = _greedy_words(self.decoder, state, fixed, self.words, self.pad, self.end, totals=True)
        return *state, *out


class BeamWordsGraph(nn.Module):
    """`words` words of the beam search, every image's K hypotheses at once (`captioner.models.beam_search._beam_words`,
    the function a compiled decoder compiles: the top-k, the length penalty, the reorder by parent): the search's
    state (each hypothesis's last word (A,K), h, c (A,K,D), score, length and finished flag (A,K)), the annotations
    and keys (one row per image) and the length penalty -> the state after the words, per word each hypothesis's
    parent among its image's K (words,A,K), its word (words,A,K) and the attention that chose it (words,A,K,P), and
    per word each image's winner if the search ended there (`_winners`: its hypothesis, score and length, (words,A)
    each). K is the state's second axis: one graph for any beam size."""

    def __init__(self, model: ShowAttendTell, words: int):
        super().__init__()
        self.decoder, self.words, self.end = model.decoder, words, model.end_index
        self.register_buffer("never", torch.tensor([model.pad_index, model.start_index]), persistent=False)
        finished = finished_extension(1, model.decoder.vocab_size, model.pad_index, torch.device("cpu"))
        self.register_buffer("finished_log_probs", finished, persistent=False)

    def forward(self, tokens, h, c, scores, lengths, finished, annotations, keys, length_penalty):
        # every shape spelled out from A, K, D and P: a -1 would need the tensor's size, which torch 2.7's exporter
        # cannot write (aten.sym_numel)
        A, K = scores.shape
        D, P, N = h.size(2), annotations.size(1), self.words
        state = (tokens.reshape(A * K), h.reshape(A * K, D), c.reshape(A * K, D), scores, lengths.reshape(A * K),
                 finished.reshape(A * K))  # fmt: skip
        fixed = annotations, keys, self.finished_log_probs, self.never
        state, parents, words, alphas, *winners = _beam_words(
            self.decoder, state, fixed, N, K, length_penalty, self.end, winners=True
        )
        tokens, h, c, scores, lengths, finished = state
        first = torch.arange(A, device=scores.device) * K  # each image's first row
        return (
            tokens.view(A, K),
            h.view(A, K, D),
            c.view(A, K, D),
            scores,
            lengths.view(A, K),
            finished.view(A, K),
            parents.view(N, A, K) - first.view(1, A, 1),  # image a's hypothesis k is row a*K + k
            words.view(N, A, K),
            alphas.view(N, A, K, P),
            *winners,
        )


def greedy_state(model: ShowAttendTell, h: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The greedy search's state before its first word, for images whose initial LSTM state is h, c (B,D)."""
    B = h.size(0)
    tokens = torch.full((B,), model.start_index, dtype=torch.long)
    return tokens, h, c, torch.zeros(B), torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.bool)


def beam_state(model: ShowAttendTell, h: torch.Tensor, c: torch.Tensor, K: int) -> tuple[torch.Tensor, ...]:
    """The beam search's state before its first word (`captioner.onnx.search.beam_search`'s): each image's one
    hypothesis, <start>, first of K whose other K - 1 score -inf."""
    B = h.size(0)
    scores = torch.full((B, K), float("-inf"))
    scores[:, 0] = 0.0
    tokens = torch.full((B, K), model.start_index, dtype=torch.long)
    h, c = h[:, None].repeat(1, K, 1), c[:, None].repeat(1, K, 1)  # two tensors: one passed twice is one input
    return tokens, h, c, scores, torch.zeros(B, K, dtype=torch.long), torch.zeros(B, K, dtype=torch.bool)


def require_onnx() -> None:
    """An ONNX export needs the [onnx] extra: a one-line error naming what is missing, before any work."""
    missing = [name for name in ("onnx", "onnxscript", "onnxruntime") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"an ONNX export needs {', '.join(missing)}: {install_hint('onnx')}")


INT8 = {"step": ("greedy", "beam"), "all": ("encoder", "greedy", "beam")}  # --int8's choices: the graphs quantized


def export_onnx(
    checkpoint: str | Path,
    output: str | Path,
    name: str | None = None,
    int8: str | None = None,
    float16: bool = False,
    before_config: Callable[[Path], None] | None = None,
) -> Path:
    """Write `checkpoint`'s model (a fit checkpoint, an exported file or a bundled model's name) to the folder `output`
    (the module's docstring); with `int8` ("step" or "all", `INT8`), those graphs quantized; with `float16`, the
    weights of the others stored as float16 (`captioner.onnx_weights.store_float16`). Each weight is written once
    (`captioner.onnx_weights.share`). `before_config(folder)` writes what else the folder holds (an export for the
    web: its site.json) before captioner.json, which marks the folder complete. Returns the folder."""
    if int8 is not None:
        check_choice("int8", int8, INT8)
    require_onnx()
    if int8 is not None:
        check_quantizer()
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
    (output / CONFIG).unlink(missing_ok=True)
    S = model.encoder.preprocessing.size
    B, K, P = torch.export.Dim("images", min=1), torch.export.Dim("beam", min=1), torch.export.Dim("cells", min=1)
    cells = None if model.decoder.position is not None else P  # a position embedding fixes the grid
    grid = model.encoder.num_pixels
    images = torch.zeros(2, 3, S, S, dtype=torch.uint8)
    with torch.no_grad():
        annotations = model.encoder(images)
        h, c, keys = StartGraph(model)(annotations)
    fixed = {"annotations": {0: B, 1: cells}, "keys": {0: B, 1: cells}}
    graphs = {
        "encoder": (EncoderGraph(model), (images,), {"images": {0: B}}),
        "start": (StartGraph(model), (annotations,), {"annotations": {0: B, 1: cells}}),
        "greedy": (
            GreedyWordsGraph(model, WORDS),
            (*greedy_state(model, h, c), annotations, keys),
            {**{name: {0: B} for name in STATE}, **fixed},
        ),
        "beam": (
            BeamWordsGraph(model, WORDS),
            (*beam_state(model, h, c, 3), annotations, keys, torch.tensor(LENGTH_PENALTY)),
            {**{name: {0: B, 1: K} for name in STATE}, **fixed, "length_penalty": {}},
        ),
    }
    for graph, (module, args, dynamic) in graphs.items():
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                module.eval(),
                args,
                dynamo=True,
                dynamic_shapes={k: {i: d for i, d in v.items() if d is not None} for k, v in dynamic.items()},
                input_names=INPUTS[graph],
                output_names=OUTPUTS[graph],
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
        "words": WORDS,  # the words a search's graph runs a call
        "opset": OPSET,
        "torch": torch.__version__,
        "int8": int8,  # the quantized graphs' choice, or null
        "float16": float16,  # whether the other graphs' weights are stored as float16
        "card": file.card,  # what a published model says of itself (`captioner.checkpoints.ModelFile.card`)
    }
    check(model, output, name)
    if int8 is not None:
        quantize(output, INT8[int8])
    if float16:
        for graph in GRAPHS:
            if graph not in INT8.get(int8, ()):
                store_float16(output / f"{graph}.onnx")
    share(output, GRAPHS)
    if before_config is not None:
        before_config(output)
    write_text_atomically(output / CONFIG, json.dumps(config, indent=1, ensure_ascii=False))
    return output


# What `check` allows between a graph on ONNX Runtime and the model's function (float32 both; measured on the bundled
# model: scores within 1.2e-5 after a call's 4 words, the other outputs within 1e-5 of their largest value).
SCORE_ATOL = 2.5e-4  # a score (a sum of log-probabilities) after a call's words; one logit moved by 1e-3 moves 4e-4
RELATIVE_ATOL = 1e-4  # every other float output (annotations, state, keys, attention), times its largest value
NEAR_TIES = 0.1  # the share of images whose words may differ: a near-tie that float rounding resolved otherwise


def check(model: ShowAttendTell, folder: Path, name: str) -> None:
    """Run the graphs on ONNX Runtime at other sizes than the export's examples (3 and 37 images; beams of 1 and 4;
    another number of cells where it is dynamic), two calls of words each (the second from the state the first left,
    where captions have ended), and compare them with the model's own functions: an export that fixed a dynamic axis
    to its example's size, or computes another function, is an error here rather than wrong captions later.

    Words, parents and winners must be the model's, except in up to a tenth of the images, where a near-tie may have
    gone the other way (those images' other outputs are then not compared). Scores are compared at a fixed tolerance
    (`SCORE_ATOL`): a tolerance scaled by their magnitude would let errors of hundredths pass."""
    from captioner.onnx.runtime import session as open_session

    sessions = {graph: open_session(folder / f"{graph}.onnx", ["CPUExecutionProvider"]) for graph in GRAPHS}
    generator = torch.Generator().manual_seed(0)
    S = model.encoder.preprocessing.size
    grid = model.encoder.num_pixels
    sizes = [(3, grid), (37, grid)]  # (images, cells)
    if model.decoder.position is None:  # the grid's cells are a dynamic axis too: a grid of another size
        sizes.append((5, grid // 2 + 1))
    runs = []  # (graph, what, module or None, inputs, ONNX Runtime's outputs)
    for B, P in sizes:
        images = torch.randint(0, 256, (B, 3, S, S), dtype=torch.uint8, generator=generator)
        with torch.no_grad():
            if grid == P:
                runs.append(("encoder", f"{B} images", EncoderGraph(model), (images,)))
                annotations = model.encoder(images)
            else:
                annotations = torch.rand(B, P, model.encoder.out_dim, generator=generator)
            runs.append(("start", f"{B} images, {P} cells", StartGraph(model), (annotations,)))
            h, c, keys = StartGraph(model)(annotations)
            c = c + 0.5 * torch.randn(c.shape, generator=generator)  # states unlike the first word's too
            runs.append(("greedy", f"{B} images, {P} cells", GreedyWordsGraph(model, WORDS),
                         (*greedy_state(model, h, c), annotations, keys)))  # fmt: skip
            for K, penalty in ((1, 0.0), (4, LENGTH_PENALTY)):
                runs.append(("beam", f"{B} images, {P} cells, beam {K}", BeamWordsGraph(model, WORDS),
                             (*beam_state(model, h, c, K), annotations, keys, torch.tensor(penalty))))  # fmt: skip
    for graph, what, module, inputs in runs:
        for call in (1, 2):
            with torch.no_grad():
                want = module(*inputs)
                want = list(want) if isinstance(want, tuple) else [want]
            feed = {n: x.numpy() for n, x in zip(INPUTS[graph], inputs, strict=True)}
            got = [torch.from_numpy(x) for x in sessions[graph].run(None, feed)]
            _compare(graph, f"{what}, call {call}" if graph in ("greedy", "beam") else what, want, got, name)
            if graph not in ("greedy", "beam"):
                break
            inputs = (*want[: len(STATE)], *inputs[len(STATE) :])  # the next call starts where the model's ended


def _compare(graph: str, what: str, want: list[torch.Tensor], got: list[torch.Tensor], name: str) -> None:
    """`check`'s comparison of one call's outputs (`OUTPUTS[graph]`)."""
    outputs = OUTPUTS[graph]
    for output, w, g in zip(outputs, want, got, strict=True):
        if tuple(g.shape) != tuple(w.shape):
            raise CaptionerError(
                f"{name}: the exported {graph} graph's {output} are {tuple(g.shape)}, not {tuple(w.shape)} ({what})"
            )
    # the images whose choices differ: axis 0 of the state and the greedy search's words, axis 1 (after the words')
    # of the beam's per-word outputs
    image_axis = {output: 1 if graph == "beam" and i >= len(STATE) else 0 for i, output in enumerate(outputs)}
    B = want[0].size(0)
    differ = torch.zeros(B, dtype=torch.bool)
    for output, w, g in zip(outputs, want, got, strict=True):
        if not w.is_floating_point():
            differ |= (w != g).movedim(image_axis[output], 0).reshape(B, -1).any(dim=1)
    if int(differ.sum()) > NEAR_TIES * B:
        raise CaptionerError(
            f"{name}: the exported {graph} graph chooses other words than the model in {int(differ.sum())} of {B} "
            f"images ({what})"
        )
    for output, w, g in zip(outputs, want, got, strict=True):
        if not w.is_floating_point():
            continue
        same = ~differ.view(-1, *[1] * (w.dim() - 1)).movedim(0, image_axis[output])
        error = torch.where(same & (w != g), (g - w).abs(), 0.0)  # equal infinities are no error
        if "score" in output:
            allowed = SCORE_ATOL  # each call starts from the model's state
        else:
            allowed = RELATIVE_ATOL * (1 + float(w.masked_fill(~torch.isfinite(w), 0).abs().max()))
        if not float(error.max()) <= allowed:  # NaN fails too
            raise CaptionerError(
                f"{name}: the exported {graph} graph's {output} are not the model's ({what}: off by "
                f"{float(error.max()):.2g}, more than {allowed:.2g})"
            )


QUANTIZER = (1, 32)  # the oldest ONNX Runtime whose quantizer takes the word graphs (1.20-1.31 fail on the beam's)


def check_quantizer() -> None:
    """`--int8` needs ONNX Runtime's quantizer from `QUANTIZER` on: older ones cannot infer the types of the beam
    graph's weights ("Unable to find data type for weight_name ..."). Running a quantized export needs no more than
    the float one."""
    import onnxruntime

    version = tuple(int(part) for part in onnxruntime.__version__.split(".")[:2])
    if version < QUANTIZER:
        raise ConfigError(
            f"--int8 needs onnxruntime >= {'.'.join(map(str, QUANTIZER))}, whose quantizer takes the search's word "
            f"graphs (this one is {onnxruntime.__version__}): pip install -U onnxruntime"
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
