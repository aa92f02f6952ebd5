"""MKL's packed GEMM for the decoder's matmuls, measured and not adopted: what it gives and what it costs.

    python benchmarks/mkl_packed.py

torch sends a float32 `F.linear` on a CPU to MKL's GEMM, which repacks the weight into its own blocked layout at
every call. MKL can also pack a weight once (`cblas_sgemm_pack`) and multiply by the packed copy afterwards; torch
exposes that as the private operators `torch.ops.mkl._mkl_reorder_linear_weight` and `torch.ops.mkl._mkl_linear`,
which it uses for linear layers in graphs that `torch.compile` has frozen. Here every weight of the decoder is
packed on first use and kept while it is unchanged (keyed by its storage and version counter), and a product of at
least MIN_ROWS rows goes through the packed copy; fewer rows keep the library's path, since MKL's unpacked product
is faster there.

First table: the LSTM input projection (the largest matmul of a step), median µs per call, unpacked against packed,
for the row counts of beam 3 at batch 1, 16 and 64 (3, 48, 192 rows) and a few others; and the size of the packed
copy against the weight's.

Second table: decode.py's setting (random decoder, `<end>` suppressed, 16 steps), greedy and beam 3 at batch 1, 16
and 64, the library's step against the same step with packed weights; three rounds in which the two take turns, the
same number of calls for each, fastest call. With the memory the packed copies take.

Third: the bundled shapes model on 64 test images, beam 3: how many captions are identical.

The library's own paths stay as they are on this CPU (oneDNN or not: captioner/models/onednn.py); the packed path
replaces them only for products of MIN_ROWS rows or more.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from common import SIZES, machine, result, same_bundled_captions, table, timed
from decode import call_seconds, random_decoder

from captioner.models import onednn

ROUNDS = 3
MIN_ROWS = 8
ROWS = (3, 8, 16, 48, 192)
AVAILABLE = hasattr(torch.ops.mkl, "_mkl_linear") and torch.backends.mkl.is_available()


class PackedWeights:
    """The packed copy of each weight, made on first use and remade when the weight changes."""

    def __init__(self):
        self.copies: dict[int, tuple[tuple[int, int], torch.Tensor]] = {}

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        key = (weight.data_ptr(), weight._version)
        entry = self.copies.get(id(weight))
        if entry is None or entry[0] != key:
            entry = self.copies[id(weight)] = (key, torch.ops.mkl._mkl_reorder_linear_weight(weight, 64))
        return entry[1]

    def sizes_mib(self) -> list[float]:
        return [packed.numel() * packed.element_size() / 2**20 for _, packed in self.copies.values()]

    def mib(self) -> float:
        return sum(self.sizes_mib())


def packed_linear(weights: PackedWeights, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """F.linear through the packed copy of `weight`, for any number of leading dimensions."""
    rows = x.reshape(-1, x.size(-1))
    out = torch.ops.mkl._mkl_linear(rows, weights.get(weight), weight, bias, rows.size(0))
    return out.view(*x.shape[:-1], weight.size(0))


@contextlib.contextmanager
def packed(weights: PackedWeights) -> Iterator[None]:
    """Within the block, the decoder's Linear and LSTMCell use packed weights for MIN_ROWS rows or more."""
    linear_forward, cell_forward = onednn.Linear.forward, onednn.LSTMCell.forward

    def use(x: torch.Tensor) -> bool:
        return not torch.is_grad_enabled() and x.dtype == torch.float32 and x.numel() // x.size(-1) >= MIN_ROWS

    def linear(self, x):
        if use(x) and self.out_features > 1:  # a matrix-vector product gains nothing from packing
            return packed_linear(weights, x, self.weight, self.bias)
        return linear_forward(self, x)

    def cell(self, x, state=None):
        if state is None or not use(x):
            return cell_forward(self, x, state)
        h, c = state
        gates = packed_linear(weights, x, self.weight_ih, self.bias_ih)
        return onednn.lstm_state(gates.add_(packed_linear(weights, h, self.weight_hh, self.bias_hh)), c)

    onednn.Linear.forward, onednn.LSTMCell.forward = linear, cell
    try:
        yield
    finally:
        onednn.Linear.forward, onednn.LSTMCell.forward = linear_forward, cell_forward


def matmul_rows(sizes: str) -> dict:
    _, E, D, _, M, _ = SIZES[sizes]
    weight, bias = torch.randn(4 * D, M + E), torch.randn(4 * D)
    weights = PackedWeights()
    row = {"sizes": sizes}
    with torch.inference_mode():
        for n in ROWS:
            x = torch.randn(n, M + E)
            repeats = 200 if n < 192 else 50
            plain = timed(lambda x=x: F.linear(x, weight, bias), repeats=repeats, warmup=20)
            fast = timed(lambda x=x: packed_linear(weights, x, weight, bias), repeats=repeats, warmup=20)
            row[f"{n} rows: unpacked / packed us"] = f"{1e6 * plain:.0f} / {1e6 * fast:.0f}"
            row[f"{n}"] = plain / fast
    row["packed copy / weight"] = f"{weights.mib() / (weight.numel() * 4 / 2**20):.1f}x"
    return row


def decoding(sizes: str) -> list[dict]:
    P, E = SIZES[sizes][:2]
    decoder = random_decoder(sizes)
    inputs = {batch: torch.randn(batch, P, E) for batch in (1, 16, 64)}
    weights = PackedWeights()
    times = {}
    for _ in range(ROUNDS):
        for name in ("library", "packed"):
            with packed(weights) if name == "packed" else contextlib.nullcontext():
                for beam in (1, 3):
                    for batch, encoded in inputs.items():
                        times.setdefault((name, beam, batch), []).extend(call_seconds(decoder, encoded, beam))
    weight_mib = sum(p.numel() * p.element_size() for p in decoder.parameters()) / 2**20
    rows = []
    for beam in (1, 3):
        for batch in inputs:
            library, fast = (batch / min(times[name, beam, batch]) for name in ("library", "packed"))
            rows.append(
                {
                    "sizes": sizes,
                    "search": "greedy" if beam == 1 else f"beam {beam}",
                    "batch": batch,
                    "library": f"{library:.1f}",
                    "packed": f"{fast:.1f}",
                    "speed-up": fast / library,
                    "decoder MiB": f"{weight_mib:.0f}",
                    "packed copies MiB": f"{weights.mib():.0f}",
                    "copies": len(weights.copies),
                    "smallest copy MiB": f"{min(weights.sizes_mib()):.1f}",
                }
            )
    return rows


def main() -> None:
    print(f"{machine()}; the decoder uses oneDNN by default here: {onednn.enabled}\n")
    if not AVAILABLE:
        raise SystemExit("this torch build has no MKL packed GEMM: nothing to compare")
    matmuls = [matmul_rows(sizes) for sizes in ("shapes", "paper")]
    print("LSTM input projection, median us per call (unpacked / packed):\n")
    print(table([{k: v for k, v in row.items() if not k.isdigit()} for row in matmuls]))
    searches = [row for sizes in ("shapes", "paper") for row in decoding(sizes)]
    print(f"\nRandom decoder, 16 steps, images/s (fastest call); packed for {MIN_ROWS} rows or more:\n")
    print(table([{k: f"{v:.2f}x" if isinstance(v, float) else v for k, v in row.items()} for row in searches]))
    same = same_bundled_captions(lambda _: contextlib.nullcontext(), lambda _: packed(PackedWeights()))
    print(f"\nBundled shapes model, 64 test images, beam 3: {same} captions identical with and without packing")
    speedup = {(row["sizes"], row["search"], row["batch"]): row["speed-up"] for row in searches}
    print(
        result(
            shapes_48rows_speedup=f"{matmuls[0]['48']:.2f}",
            shapes_192rows_speedup=f"{matmuls[0]['192']:.2f}",
            paper_48rows_speedup=f"{matmuls[1]['48']:.2f}",
            paper_192rows_speedup=f"{matmuls[1]['192']:.2f}",
            shapes_beam3_b16_speedup=f"{speedup['shapes', 'beam 3', 16]:.2f}",
            shapes_beam3_b64_speedup=f"{speedup['shapes', 'beam 3', 64]:.2f}",
            paper_beam3_b16_speedup=f"{speedup['paper', 'beam 3', 16]:.2f}",
            paper_beam3_b64_speedup=f"{speedup['paper', 'beam 3', 64]:.2f}",
            shapes_packed_mib=searches[0]["packed copies MiB"],
            shapes_decoder_mib=searches[0]["decoder MiB"],
            paper_packed_mib=searches[-1]["packed copies MiB"],
            paper_decoder_mib=searches[-1]["decoder MiB"],
            shapes_smallest_copy_mib=searches[0]["smallest copy MiB"],
            same_captions=same,
        )
    )


if __name__ == "__main__":
    main()
