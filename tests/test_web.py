"""`captioner export --format web`: the static page's host loop (captioner/static/web/search.js) against the Python
one, call by call, under Node; and the exported folder served by a static server and driven in Chromium, its words
against `captioner.onnx.Captioner`'s on the same pixels."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess

import numpy as np
import pytest
import torch

from captioner.onnx import search
from tests.conftest import REPO
from tests.helpers import END, PAD, START, TableDecoder, random_decoder
from tests.models.test_decoding import TRAP, WEAK
from tests.test_onnx import NEVER_ENDS, TorchWords

NODE = shutil.which("node")
TYPES = {np.dtype(np.float32): "float32", np.dtype(np.int64): "int64", np.dtype(np.bool_): "bool"}


def encode(array: np.ndarray) -> dict:
    data = base64.b64encode(array.tobytes(order="C")).decode()
    return {"type": TYPES[array.dtype], "dims": list(array.shape), "data": data}


class RecordedWords(TorchWords):
    """`TorchWords` that writes down each call's inputs (the state and what is bound) and outputs."""

    def __init__(self, *args, **kwargs):
        self.calls = []
        super().__init__(*args, **kwargs)

    def __call__(self, state):
        out = super().__call__(state)
        inputs = {**{name: x.numpy() for name, x in state.items()}, **self.fixed}
        self.calls.append({"inputs": {name: encode(x) for name, x in inputs.items()},
                           "outputs": {name: encode(x.numpy()) for name, x in out.items()}})  # fmt: skip
        return out


def python_search(decoder, annotations: torch.Tensor, beam_size: int, words: int, **options) -> tuple[dict, object]:
    """The Python host loop's search, and what the JavaScript one needs to replay it."""
    with torch.inference_mode():
        h, c = decoder.init_state(annotations)
        keys = decoder.prepare(annotations)
    arrays = [x.numpy() for x in (annotations, keys, h, c)]
    graph = "greedy" if beam_size == 1 else "beam"
    runner = RecordedWords(decoder, graph, {"annotations": arrays[0], "keys": arrays[1]}, words)
    common = {"start": START, "pad": PAD, "n": words}
    if beam_size == 1:
        out = search.greedy_search(runner, *arrays, **common, max_len=options.get("max_len", 30))
    else:
        out = search.beam_search(runner, *arrays, **common, beam_size=beam_size, vocab_size=decoder.vocab_size,
                                 **options)  # fmt: skip
    js = {"maxLen": options.get("max_len", 30), "lengthPenalty": options.get("length_penalty", 1.0)}
    replay = {
        **dict(zip(("annotations", "keys", "h", "c"), map(encode, arrays), strict=True)),
        "beam_size": beam_size,
        "options": {**common, **js, "vocabSize": decoder.vocab_size},
        "calls": runner.calls,
    }
    return replay, out


def searches() -> list[tuple[dict, object]]:
    """Searches of several beam widths, length penalties and words a call: a random decoder whose captions end at
    different words, tables built to trap greedy search, to favour short captions by the raw sum, to never end, and
    100 random tables of next-word probabilities."""
    cases = []
    for words in (1, 3, 4, 8):
        # the random decoder with <end> made likelier, so that captions end at different words and images leave the
        # batch between calls
        for beam_size, end, max_len, penalty in ((1, 1.0, 12, 1.0), (2, 1.3, 12, 1.0), (3, 1.4, 12, 0.7),
                                                 (4, 1.4, 12, 1.0), (5, 1.3, 6, 0.0)):  # fmt: skip
            decoder = random_decoder()
            with torch.no_grad():
                decoder.L_o.bias[END] += end
            torch.manual_seed(4)
            cases.append((decoder, torch.randn(7, 9, 16), beam_size, words,
                          {"max_len": max_len, "length_penalty": penalty}))  # fmt: skip
        tables = ((TRAP, 2, {}), (WEAK, 3, {"max_len": 10, "length_penalty": 0.0}), (NEVER_ENDS, 3, {"max_len": 5}),
                  (NEVER_ENDS, 1, {"max_len": 5}))  # fmt: skip
        for table, beam_size, options in tables:
            cases.append((TableDecoder(table), torch.zeros(3, 4, 2), beam_size, words, options))
    generator = np.random.default_rng(0)
    names = list(range(3, 8))
    for _ in range(100):
        rows = generator.dirichlet([0.5] * len(names), size=len(names)).tolist()
        table = {prev: dict(zip(names, row, strict=True)) for prev, row in zip([START, *names[1:]], rows, strict=True)}
        options = {"max_len": int(generator.integers(2, 9)), "length_penalty": float(generator.choice([0, 0.7, 1]))}
        cases.append((TableDecoder(table, vocab_size=8), torch.zeros(2, 4, 2), int(generator.integers(1, 5)),
                      int(generator.integers(1, 9)), options))  # fmt: skip
    return [python_search(decoder, annotations, beam, words, **options)
            for decoder, annotations, beam, words, options in cases]  # fmt: skip


@pytest.mark.skipif(NODE is None, reason="no node on this machine (Debian: apt-get install nodejs)")
def test_the_javascript_host_loop_is_the_python_one_call_by_call():
    """The page's host loop, run under Node on the calls the Python host loop made (each call's outputs replayed), gives
    each call the inputs the Python loop gave it (the state, the annotations and keys of the images still searching,
    to the bit), makes as many calls, and reads back the same captions, scores and attention."""
    cases = searches()
    done = subprocess.run([NODE, str(REPO / "tests" / "web" / "replay.mjs")], input=json.dumps([r for r, _ in cases]),
                          capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    results = json.loads(done.stdout)
    assert len(results) == len(cases)
    shrinking = [
        replay for replay, _ in cases if len({call["inputs"]["tokens"]["dims"][0] for call in replay["calls"]}) > 1
    ]
    assert len(shrinking) >= 10, len(shrinking)  # images left the batch between calls, in greedy and beam searches
    assert {replay["beam_size"] == 1 for replay in shrinking} == {True, False}
    for i, (result, (_, want)) in enumerate(zip(results, cases, strict=True)):
        assert "error" not in result, (i, result)
        assert result["ids"] == want.ids, i
        assert result["scores"] == [float(np.float32(s)) for s in want.scores], i
        for got, alphas in zip(result["alphas"], want.alphas, strict=True):
            assert np.array_equal(np.array(got, np.float32).reshape(alphas.shape), alphas), i
