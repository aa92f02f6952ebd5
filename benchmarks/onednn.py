"""oneDNN against MKL for the decoder's matmuls when decoding on this CPU (captioner/models/onednn.py).

    python benchmarks/onednn.py

First table: the largest matmul of a decoding step, the LSTM input projection, for 1 to 5 rows (beam K at batch 1
runs K rows) and 192 rows (beam 3 at batch 64): `F.linear` (torch's MKL GEMM) against the oneDNN operator that
`captioner.models.onednn.Linear` calls. Median µs per call.

Second table: beam 3 in decode.py's setting (random decoder, `<end>` suppressed, 16 steps) at batch 1 and 64, with
`captioner.models.onednn.enabled` on and off; three rounds in which the two settings take turns, the same number of
calls for each, fastest call.

Third: the bundled shapes model on 64 test images, beam 3, both settings: how many captions are identical.

Fourth: training through oneDNN, which the library does not do (not adopted; docs/benchmarks.md). torch's oneDNN
operator has no backward, so the script wraps it in an autograd Function of its own: the forward, the gradient of the
input and that of the weight are each one call of the operator, for every weight of at least 2^20 elements (in a
trial of single products, the smaller ones were faster through MKL; at the shapes sizes only the LSTM's input weight
is that large). train_step.py's float32 training step with and without it, taking turns over three rounds, and how
far the gradients of one step differ.

The header and `default_on` in the RESULT line say whether the decoder uses oneDNN by default on this CPU (on AMD
CPUs only; see captioner/models/onednn.py).
"""

from __future__ import annotations

import contextlib
import statistics
from unittest.mock import patch

import torch
import torch.nn.functional as F
from common import SIZES, machine, result, same_bundled_captions, samples, table, timed
from decode import MAX_LEN, call_seconds, random_decoder
from train_step import BATCHES, make_batch, trainer

from captioner.lit_module import caption_loss
from captioner.models import onednn
from captioner.models.decoder import AttentionDecoder
from captioner.runtime import cpu_vendor

ROUNDS = 3
ROWS = (1, 2, 3, 4, 5, 192)
TRAIN_CALLS = 4  # timed training steps per setting and round
TRAIN_MIN_WEIGHT = 2**20  # weights at least this large go through oneDNN in training
_library_linear, _library_lstm_cell = onednn.linear, onednn.LSTMCell.forward  # before onednn_training patches them


def matmul_rows(sizes: str) -> dict:
    _, E, D, _, M, _ = SIZES[sizes]
    weight, bias = torch.randn(4 * D, M + E), torch.randn(4 * D)
    row = {"sizes": sizes}
    with onednn.use(True), torch.inference_mode():
        for n in ROWS:
            x = torch.randn(n, M + E)
            repeats = 200 if n < 192 else 50
            mkl = timed(lambda x=x: F.linear(x, weight, bias), repeats=repeats, warmup=20)
            dnn = timed(lambda x=x: onednn.linear(x, weight, bias), repeats=repeats, warmup=20)
            row[f"{n} rows: MKL / oneDNN us"] = f"{1e6 * mkl:.0f} / {1e6 * dnn:.0f}"
            row[f"{n}"] = mkl / dnn
    return row


def decoding(sizes: str) -> dict:
    P, E = SIZES[sizes][:2]
    decoder = random_decoder(sizes)
    inputs = {batch: torch.randn(batch, P, E) for batch in (1, 64)}
    times = {(flag, batch): [] for flag in (False, True) for batch in inputs}
    for _ in range(ROUNDS):
        for flag in (False, True):
            with onednn.use(flag):
                for batch, encoded in inputs.items():
                    times[flag, batch] += call_seconds(decoder, encoded, beam=3)
    speed = {key: key[1] / min(seconds) for key, seconds in times.items()}
    return {
        "sizes": sizes,
        "batch 1, MKL": f"{speed[False, 1]:.1f}",
        "batch 1, oneDNN": f"{speed[True, 1]:.1f}",
        "batch 1 speed-up": speed[True, 1] / speed[False, 1],
        "batch 64, MKL": f"{speed[False, 64]:.1f}",
        "batch 64, oneDNN": f"{speed[True, 64]:.1f}",
        "batch 64 speed-up": speed[True, 64] / speed[False, 64],
    }


def _onednn_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) through oneDNN, for any strides."""
    return onednn._linear_pointwise(x, weight, bias, "none", [], "")


class OneDNNLinearFunction(torch.autograd.Function):
    """F.linear whose forward, input gradient and weight gradient each run as one oneDNN product."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn_product(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        x2, grad2 = x.reshape(-1, x.size(-1)), grad.reshape(-1, grad.size(-1))
        grad_x = _onednn_product(grad2, weight.t()).view_as(x) if ctx.needs_input_grad[0] else None  # g @ W
        grad_w = _onednn_product(grad2.t(), x2.t()) if ctx.needs_input_grad[1] else None  # g.T @ x
        grad_b = grad2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def training_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The decoder's linear with OneDNNLinearFunction for large float32 weights when autograd is on, else the
    library's own (which decodes through oneDNN where it does)."""
    if (
        torch.is_grad_enabled()
        and weight.numel() >= TRAIN_MIN_WEIGHT
        and x.dtype == weight.dtype == torch.float32
        and not torch.is_autocast_enabled("cpu")
    ):
        return OneDNNLinearFunction.apply(x, weight, bias)
    return _library_linear(x, weight, bias)


def _training_lstm_cell(self, x, state=None):
    """The library's LSTMCell, with its two products through `onednn.linear` (so, in the block below, through
    training_linear) when autograd is on."""
    if not torch.is_grad_enabled() or state is None:
        return _library_lstm_cell(self, x, state)
    h, c = state
    gates = onednn.linear(x, self.weight_ih, self.bias_ih) + onednn.linear(h, self.weight_hh, self.bias_hh)
    return onednn.lstm_state(gates, c)


@contextlib.contextmanager
def onednn_training(flag: bool):
    """Within the block, with flag, the decoder trains through OneDNNLinearFunction (the library does not)."""
    if not flag:
        yield
        return
    with patch.object(onednn, "linear", training_linear), patch.object(onednn.LSTMCell, "forward", _training_lstm_cell):
        yield


def gradient_difference(sizes: str = "shapes") -> float:
    """The largest difference between the gradients of one training step with and without oneDNN, over the largest
    gradient (both over all parameters)."""
    P, E, D, A, M, V = SIZES[sizes]
    annotations, captions, lengths = make_batch(P, E, V)
    grads = []
    for flag in (False, True):
        torch.manual_seed(0)
        decoder = AttentionDecoder(V, E, embed_dim=M, decoder_dim=D, attention_dim=A, dropout=0.0)
        with onednn_training(flag):
            logits, alphas = decoder(annotations, captions, lengths)
            loss, _, _ = caption_loss(logits, captions[:, 1 : 1 + logits.size(1)], alphas)
            loss.backward()
        grads.append([p.grad for p in decoder.parameters() if p.grad is not None])
    largest = max(float(g.abs().max()) for g in grads[0])
    return max(float((a - b).abs().max()) for a, b in zip(*grads, strict=True)) / largest


def training(sizes: str) -> dict:
    steps = {}
    for flag in (False, True):
        with onednn_training(flag):
            steps[flag] = trainer(AttentionDecoder, sizes, batches=BATCHES[sizes])
    times = {False: [], True: []}
    for _ in range(ROUNDS):
        for flag in (False, True):
            with onednn_training(flag):
                times[flag] += samples(steps[flag], repeats=TRAIN_CALLS)
    fastest = {flag: min(t) for flag, t in times.items()}
    median = {flag: statistics.median(t) for flag, t in times.items()}
    return {
        "sizes": sizes,
        "MKL ms, fastest / median": f"{1e3 * fastest[False]:.0f} / {1e3 * median[False]:.0f}",
        "oneDNN ms, fastest / median": f"{1e3 * fastest[True]:.0f} / {1e3 * median[True]:.0f}",
        "speed-up, fastest": fastest[False] / fastest[True],
        "speed-up, median": median[False] / median[True],
    }


def main() -> None:
    vendor = cpu_vendor() or "unknown"
    print(f"{machine()}; oneDNN linear available: {onednn.AVAILABLE}")
    print(f"CPU vendor {vendor}; the decoder uses oneDNN by default here: {onednn.enabled}\n")
    if not onednn.AVAILABLE:
        raise SystemExit("this torch build has no oneDNN linear: nothing to compare")
    matmuls = [matmul_rows(sizes) for sizes in ("shapes", "paper")]
    print("LSTM input projection, median us per call (MKL / oneDNN):\n")
    print(table([{k: v for k, v in row.items() if not k.isdigit()} for row in matmuls]))
    searches = [decoding(sizes) for sizes in ("shapes", "paper")]
    print(f"\nBeam 3, random decoder, {MAX_LEN} steps, images/s (fastest call):\n")
    print(table([{k: f"{v:.2f}x" if isinstance(v, float) else v for k, v in row.items()} for row in searches]))
    same = same_bundled_captions(lambda _: onednn.use(False), lambda _: onednn.use(True))
    print(f"\nBundled shapes model, 64 test images, beam 3: {same} captions identical with and without oneDNN")
    trainings = [training(sizes) for sizes in ("shapes", "paper")]
    print(
        f"\nTraining step (train_step.py's, float32) with weights of >= 2^{TRAIN_MIN_WEIGHT.bit_length() - 1}"
        " elements through oneDNN, not adopted:\n"
    )
    print(table([{k: f"{v:.2f}x" if isinstance(v, float) else v for k, v in row.items()} for row in trainings]))
    grad_difference = gradient_difference()
    print(f"\nGradients of one shapes step, largest difference over the largest gradient: {grad_difference:.1e}")
    shapes, paper = searches
    print(
        result(
            shapes_3rows_speedup=f"{matmuls[0]['3']:.1f}",
            paper_3rows_speedup=f"{matmuls[1]['3']:.1f}",
            shapes_192rows_speedup=f"{matmuls[0]['192']:.2f}",
            paper_192rows_speedup=f"{matmuls[1]['192']:.2f}",
            shapes_beam3_b1_speedup=f"{shapes['batch 1 speed-up']:.2f}",
            shapes_beam3_b64_speedup=f"{shapes['batch 64 speed-up']:.2f}",
            paper_beam3_b1_speedup=f"{paper['batch 1 speed-up']:.2f}",
            paper_beam3_b64_speedup=f"{paper['batch 64 speed-up']:.2f}",
            same_captions=same,
            train_shapes_speedup=f"{trainings[0]['speed-up, fastest']:.2f}",
            train_paper_speedup=f"{trainings[1]['speed-up, fastest']:.2f}",
            train_shapes_speedup_median=f"{trainings[0]['speed-up, median']:.2f}",
            train_paper_speedup_median=f"{trainings[1]['speed-up, median']:.2f}",
            train_grad_difference=f"{grad_difference:.1e}",
            default_on=onednn.enabled,
        )
    )


if __name__ == "__main__":
    main()
