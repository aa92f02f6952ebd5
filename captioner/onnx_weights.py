"""How an export's graphs hold their weights: each weight once in the folder, and, as an option, stored as float16.

- Shared weights (`share`): the start, greedy and beam graphs are functions of the same decoder, and torch's exporter
  writes its weights into each. A weight that more than one graph holds (the same bytes) is written once, to
  `weights.bin` beside them, and each graph refers to it as ONNX external data (its location, offset and length), as
  ONNX Runtime in Python and in the browser (`externalData`) load it. A weight that one graph alone holds stays in it.
- float16 storage (`store_float16`): each float32 weight of a graph is stored as float16 and cast back to float32 by
  a `Cast` node at the graph's start, so that the graph computes in float32, as the model does, from weights rounded
  to float16. Half the bytes to download; what it does to the words is measured (docs/benchmarks.md). A model saved
  with `captioner export --float16` (the bundled `ucm`) has float16 weights already: its decoder loses nothing here.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path

import numpy as np

from captioner.files import replace_atomically
from captioner.onnx.layout import WEIGHTS

ALIGN = 64  # bytes: each weight starts at a multiple of it in weights.bin
SMALLEST = 1024  # bytes: a smaller weight (a bias of a few values, a scalar) stays in its graph either way


def _digest(tensor) -> str | None:
    """The content of a weight (its type, shape and bytes) as a hash, or None for one not worth sharing."""
    if not tensor.raw_data or len(tensor.raw_data) < SMALLEST:
        return None
    key = hashlib.sha256(f"{tensor.data_type}:{list(tensor.dims)}:".encode())
    key.update(tensor.raw_data)
    return key.hexdigest()


def share(folder: Path, graphs: tuple[str, ...]) -> int:
    """Rewrite `folder`'s graphs (`<graph>.onnx`) so that a weight two or more of them hold is read from `WEIGHTS`,
    written once. Returns the bytes saved. The graphs are rewritten each through a temporary file and renamed: a kill
    leaves each graph whole (the export's captioner.json, written after, is what marks the folder complete)."""
    import onnx  # the [onnx] extra's, imported when an export runs (`export_onnx` says when it is missing)
    from onnx import TensorProto, external_data_helper

    models = {graph: onnx.load(str(folder / f"{graph}.onnx")) for graph in graphs}
    holders = Counter(
        digest for model in models.values() for digest in {_digest(t) for t in model.graph.initializer} if digest
    )
    shared = {digest for digest, count in holders.items() if count > 1}
    offsets: dict[str, tuple[int, int]] = {}
    saved = 0

    def write(out) -> None:
        nonlocal saved
        for model in models.values():
            for tensor in model.graph.initializer:
                digest = _digest(tensor)
                if digest not in shared:
                    continue
                if digest not in offsets:
                    out.write(b"\0" * (-out.tell() % ALIGN))
                    offsets[digest] = (out.tell(), len(tensor.raw_data))
                    out.write(tensor.raw_data)
                else:
                    saved += len(tensor.raw_data)
                offset, length = offsets[digest]
                external_data_helper.set_external_data(tensor, WEIGHTS, offset, length)
                tensor.data_location = TensorProto.EXTERNAL
                tensor.ClearField("raw_data")

    if shared:
        replace_atomically(folder / WEIGHTS, write)
    else:
        (folder / WEIGHTS).unlink(missing_ok=True)
    for graph, model in models.items():
        replace_atomically(folder / f"{graph}.onnx", lambda out, model=model: out.write(model.SerializeToString()))
    return saved


def store_float16(path: Path) -> None:
    """Store the graph at `path`'s float32 weights (of `SMALLEST` bytes or more) as float16, each cast back to
    float32 by a `Cast` node under its old name, so that the nodes that read it are unchanged."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(path))
    graph, casts = model.graph, []
    for index, tensor in enumerate(graph.initializer):
        if tensor.data_type != TensorProto.FLOAT or len(tensor.raw_data) < SMALLEST:
            continue
        half = numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float16), f"{tensor.name}.float16")
        casts.append(helper.make_node("Cast", [half.name], [tensor.name], to=TensorProto.FLOAT))
        graph.initializer[index].CopyFrom(half)
    nodes = [*casts, *graph.node]  # before every node that reads them: the graph stays in topological order
    del graph.node[:]
    graph.node.extend(nodes)
    replace_atomically(path, lambda out: out.write(model.SerializeToString()))
