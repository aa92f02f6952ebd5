"""Caption generation speed (images/s) on precomputed annotations: greedy, beam 3 and beam 5 at batch 1, 16 and 64.

    python benchmarks/decode.py

Runs under torch.inference_mode with a randomly initialised decoder and a fixed max_len, so every configuration
decodes the same number of steps (an untrained model rarely ends early) and only the batching differs. Every batch
size gets the same number of timed calls, over three rounds in which the batch sizes take turns, so that a slow
spell of the shared machine hits them all. The table gives the fastest call (noise only ever slows a call down) and
the median call (what a run typically gets). The same number of calls matters for the fastest one: the fastest of
many noisy calls is faster than the fastest of a few, and an earlier version, which timed 32 images per round (96
calls at batch 1 against 6 at batch 64), favoured batch 1 (docs/benchmarks-earlier.md, Decoding).

A second table uses the bundled shapes model on 64 test images, where captions end at different steps: it counts
the rows the decoder's LSTM and output layer ran against the rows of a fixed-shape search (every hypothesis of every
image run to the last step), which is what the shrinking batch and the skipping of ended hypotheses save.

A third table times the largest matmul of a step, the LSTM input projection, as the decoder runs it
(captioner.models.onednn), for 1 to 5 rows (at batch 1 a beam of K runs K rows, and a few rows do not cost the same
as one) and for the 192 rows of beam 3 at batch 64: how much batching can gain on the kernel that takes the largest
share of a batch-64 step.

A fourth table counts the matmul work of one beam-3 call (torch.utils.flop_counter) and compares its time with the
rate this machine reaches on one large matmul: how far each batch size is from being bound by arithmetic alone.

A fifth table shows what `torch.inference_mode` (how the library decodes in float32) gives: greedy and beam 3 at
batch 1 and 64, shapes sizes, under inference mode, under `torch.no_grad`, and with autograd on (a model in eval()
mode called without either, as a script that forgets them does: every step's graph is built, and kept for as long
as the search's result lives, whose scores and attention weights hold it). The decoder's matmuls run through torch's
own kernels in every row (oneDNN off, which with autograd on is the library's path anyway), so that only gradient
tracking differs; the modes take turns, 12 calls each. benchmarks/grad_memory.py measures the memory side.

The first table also counts the page faults per call (the untimed first call of each round included): memory that
glibc's malloc gave back to the kernel and took again, which costs a fault and a zero-fill per 4 KiB page.
"""

from __future__ import annotations

import contextlib
import statistics

import torch
from common import SIZES, machine, page_faults, result, samples, table, timed
from torch.utils.flop_counter import FlopCounterMode

from captioner.api import Captioner
from captioner.data.shapes import ShapesDataset
from captioner.decoding import beam_search, greedy_search
from captioner.models import onednn
from captioner.models.decoder import AttentionDecoder
from captioner.precision import decoding

MAX_LEN = 16
BATCHES = (1, 16, 64)
ROUNDS = 3
CALLS = 4  # timed calls per round, the same for every batch size
SPECIAL = {"start_index": 1, "end_index": 2, "pad_index": 0}


def random_decoder(sizes: str) -> AttentionDecoder:
    """The decoder these benchmarks time: random weights (seed 0) at `sizes`, in eval mode, with `<end>` suppressed
    so that every call decodes exactly MAX_LEN steps. Seeds torch, so inputs drawn next are the same in every run."""
    _, E, D, A, M, V = SIZES[sizes]
    torch.manual_seed(0)
    decoder = AttentionDecoder(V, E, embed_dim=M, decoder_dim=D, attention_dim=A).eval()
    decoder.L_o.bias.data[SPECIAL["end_index"]] = -1e4
    return decoder


def search(
    decoder,
    annotations: torch.Tensor,
    beam: int,
    max_len: int = MAX_LEN,
    special: dict = SPECIAL,
    precision: str = "32-true",
):
    """Greedy search when beam is 1, else beam search, in the context `Captioner` decodes in at `precision`
    (inference mode in float32; captioner.precision.decoding)."""
    with decoding(precision, annotations.device):
        if beam == 1:
            return greedy_search(decoder, annotations, max_len=max_len, **special)
        return beam_search(decoder, annotations, beam_size=beam, max_len=max_len, **special)


def call_seconds(decoder, annotations, beam: int, precision: str = "32-true", calls: int = CALLS) -> list[float]:
    """Seconds of each of `calls` searches of the whole batch, after one untimed."""
    return samples(lambda: search(decoder, annotations, beam, precision=precision), repeats=calls)


def bundled_model_inputs(batch: int = 64) -> tuple[torch.nn.Module, torch.Tensor, dict]:
    """The bundled shapes model, the annotations of the first `batch` test images, and its special token indices."""
    captioner = Captioner.load("shapes", device="cpu")
    model = captioner.model
    dataset = ShapesDataset("test", batch, seed=0)
    with torch.inference_mode():
        images = torch.stack([captioner.transform(dataset.load_image(i)) for i in range(batch)])
        annotations = model.encoder(images)
    special = {"start_index": model.start_index, "end_index": model.end_index, "pad_index": model.pad_index}
    return model, annotations, special


def trained_model_rows(batch: int = 64, max_len: int = 30) -> list[dict]:
    model, annotations, special = bundled_model_inputs(batch)
    rows = []
    for beam in (1, 3, 5):

        def run(beam=beam):
            return search(model.decoder, annotations, beam, max_len, special)

        out = run()
        ran, steps = sum(out.decoder_rows), len(out.decoder_rows)
        seconds = timed(run, repeats=5)
        rows.append(
            {
                "search": "greedy" if beam == 1 else f"beam {beam}",
                "images/s": f"{batch / seconds:.1f}",
                "mean words": f"{out.lengths.float().mean():.1f}",
                "steps": steps,
                "decoder rows run": ran,
                "fixed-shape rows": batch * beam * steps,
                "saved": f"{1 - ran / (batch * beam * steps):.0%}",
            }
        )
    return rows


def lstm_input_rows(sizes: str, beam_b64_seconds: float) -> dict:
    """The LSTM input projection for 1 to 5 rows, and for 192 rows: beam 3 at batch 64.

    "b64 over b1" is 64 x t(3 rows) / t(192 rows), the per-image gain that batching gives this one kernel; "share of
    b64 beam 3" is 16 x t(192 rows) over the whole beam-3 batch-64 call timed in the first table.
    """
    _, E, D, _, M, _ = SIZES[sizes]
    weight, bias = torch.randn(4 * D, M + E), torch.randn(4 * D)
    row = {"sizes": sizes, "matmul": f"(rows x {M + E}) @ ({M + E} x {4 * D})"}
    seconds = {}
    with torch.inference_mode():
        for n in (1, 2, 3, 4, 5, 192):
            x = torch.randn(n, M + E)
            seconds[n] = timed(lambda x=x: onednn.linear(x, weight, bias), repeats=200 if n < 192 else 50, warmup=20)
            row[f"{n} rows, us"] = f"{1e6 * seconds[n]:.0f}"
    row["192 rows, GFLOP/s"] = f"{2 * 192 * (M + E) * 4 * D / seconds[192] / 1e9:.0f}"
    row["b64 over b1"] = f"{64 * seconds[3] / seconds[192]:.1f}"
    row["share of b64 beam 3"] = f"{MAX_LEN * seconds[192] / beam_b64_seconds:.0%}"
    return row


def large_matmul_gflops(n: int = 2048) -> float:
    """The machine's matmul rate: the fastest of 10 (n x n) @ (n x n) products, by MKL or by oneDNN."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    with onednn.use(True), torch.inference_mode():
        seconds = min(
            timed(f, repeats=10, warmup=2, best=True) for f in (lambda: a @ b, lambda: onednn.linear(a, b, None))
        )
    return 2 * n**3 / seconds / 1e9


def matmul_work_rows(figures: dict, peak_gflops: float) -> list[dict]:
    """Per beam-3 call at batch 1 and 64: matmul GFLOP, the time those take at the large-matmul rate, and the share
    of the fastest measured call (first table) that this floor explains."""
    rows = []
    for sizes in ("shapes", "paper"):
        P, E = SIZES[sizes][:2]
        decoder = random_decoder(sizes)
        for batch in (1, 64):
            # the same matmuls, through torch's own operators, which the counter knows
            with onednn.use(False), torch.inference_mode(), FlopCounterMode(display=False) as counter:
                beam_search(decoder, torch.randn(batch, P, E), beam_size=3, max_len=MAX_LEN, **SPECIAL)
            gflop = counter.get_total_flops() / 1e9
            measured = batch / figures[(sizes, 3, batch)]
            rows.append(
                {
                    "sizes": sizes,
                    "batch": batch,
                    "matmul GFLOP per call": f"{gflop:.3f}",
                    "ms at the large-matmul rate": f"{1e3 * gflop / peak_gflops:.1f}",
                    "ms measured (fastest)": f"{1e3 * measured:.1f}",
                    "GFLOP/s reached": f"{gflop / measured:.0f}",
                    "share of the large-matmul rate": f"{gflop / measured / peak_gflops:.0%}",
                }
            )
    return rows


INFERENCE = "inference_mode (the library)"
GRAD_MODES = {INFERENCE: torch.inference_mode, "no_grad": torch.no_grad, "autograd on": contextlib.nullcontext}


def grad_mode_rows() -> tuple[list[dict], dict]:
    """Images/s of greedy and beam-3 search at batch 1 and 64 (shapes sizes) in each gradient mode, fastest and
    median call; the modes take turns over ROUNDS rounds. The decoder's matmuls go through torch's own kernels in
    every mode (oneDNN needs autograd off), so that only gradient tracking differs."""
    P, E = SIZES["shapes"][:2]
    decoder = random_decoder("shapes")
    rows, figures = [], {}
    for beam in (1, 3):
        for batch in (1, 64):
            annotations = torch.randn(batch, P, E)

            def run(beam=beam, annotations=annotations):
                if beam == 1:
                    return greedy_search(decoder, annotations, max_len=MAX_LEN, **SPECIAL)
                return beam_search(decoder, annotations, beam_size=beam, max_len=MAX_LEN, **SPECIAL)

            times = {mode: [] for mode in GRAD_MODES}
            with onednn.use(False):
                for _ in range(ROUNDS):
                    for mode, context in GRAD_MODES.items():
                        with context():
                            times[mode] += samples(run, repeats=CALLS)
            for mode in GRAD_MODES:
                figures[(beam, batch, mode)] = speed = batch / min(times[mode])
                rows.append(
                    {
                        "search": "greedy" if beam == 1 else f"beam {beam}",
                        "batch": batch,
                        "gradient tracking": mode,
                        "images/s, fastest call": f"{speed:.1f}",
                        "images/s, median call": f"{batch / statistics.median(times[mode]):.1f}",
                        "over autograd on": f"{min(times['autograd on']) / min(times[mode]):.2f}x",
                    }
                )
    return rows, figures


def main() -> None:
    rows, figures = [], {}
    for sizes in ("shapes", "paper"):
        P, E = SIZES[sizes][:2]
        decoder = random_decoder(sizes)
        for beam in (1, 3, 5):
            inputs = {batch: torch.randn(batch, P, E) for batch in BATCHES}
            times = {batch: [] for batch in BATCHES}
            faults = dict.fromkeys(BATCHES, 0)
            for _ in range(ROUNDS):  # the batch sizes take turns, so that a slow spell of the machine hits them all
                for batch in BATCHES:
                    before = page_faults()
                    times[batch] += call_seconds(decoder, inputs[batch], beam)
                    faults[batch] += page_faults() - before
            for batch in BATCHES:
                figures[(sizes, beam, batch)] = speed = batch / min(times[batch])
                figures[(sizes, beam, batch, "median")] = typical = batch / statistics.median(times[batch])
                rows.append(
                    {
                        "sizes": sizes,
                        "search": "greedy" if beam == 1 else f"beam {beam}",
                        "batch": batch,
                        "images/s, fastest call": f"{speed:.1f}",
                        "images/s, median call": f"{typical:.1f}",
                        "page faults per call": f"{faults[batch] / (ROUNDS * (CALLS + 1)):.0f}",
                    }
                )
    print(f"{MAX_LEN} decoding steps per image, {ROUNDS * CALLS} timed calls per configuration; {machine()}\n")
    print(table(rows))
    trained = trained_model_rows()
    print("\nBundled shapes model, 64 test images, batch 64, max_len 30:\n")
    print(table(trained))
    print("\nThe LSTM input projection alone, as the decoder runs it (median of 200 calls; 50 for 192 rows):\n")
    lstm = [lstm_input_rows(sizes, 64 / figures[(sizes, 3, 64)]) for sizes in ("shapes", "paper")]
    print(table(lstm))
    peak = large_matmul_gflops()
    print(f"\nMatmul work of one beam-3 call; this machine's rate on a 2048^3 matmul: {peak:.0f} GFLOP/s\n")
    work = matmul_work_rows(figures, peak)
    print(table(work))
    print("\nGradient tracking, shapes sizes, decoder matmuls through torch's own kernels in every row:\n")
    grad_rows, grad = grad_mode_rows()
    print(table(grad_rows))
    # If batch 64 ran at the large-matmul rate with everything else free, its gain over batch 1 would be:
    ceiling = 64 * float(work[0]["ms measured (fastest)"]) / float(work[1]["ms at the large-matmul rate"])

    def ratio(sizes, beam, *statistic):
        return figures[(sizes, beam, 64, *statistic)] / figures[(sizes, beam, 1, *statistic)]

    print(
        result(
            shapes_beam3_b64_over_b1=f"{ratio('shapes', 3):.1f}",
            shapes_beam3_b64_over_b1_median=f"{ratio('shapes', 3, 'median'):.1f}",
            paper_beam3_b64_over_b1=f"{ratio('paper', 3):.1f}",
            paper_beam3_b64_over_b1_median=f"{ratio('paper', 3, 'median'):.1f}",
            shapes_beam3_b64_images_per_s=f"{figures[('shapes', 3, 64)]:.0f}",
            paper_beam3_b64_images_per_s=f"{figures[('paper', 3, 64)]:.1f}",
            shapes_beam5_b64_over_b1=f"{ratio('shapes', 5):.1f}",
            shapes_greedy_b64_over_b1=f"{ratio('shapes', 1):.1f}",
            trained_beam3_rows_saved=trained[1]["saved"],
            shapes_lstm_matmul_b64_over_b1=lstm[0]["b64 over b1"],
            large_matmul_gflops=f"{peak:.0f}",
            shapes_beam3_b64_share_of_matmul_rate=work[1]["share of the large-matmul rate"],
            shapes_beam3_b64_over_b1_ceiling=f"{ceiling:.1f}",
            beam3_b64_inference_over_no_grad=f"{grad[(3, 64, INFERENCE)] / grad[(3, 64, 'no_grad')]:.2f}",
            beam3_b64_inference_over_autograd=f"{grad[(3, 64, INFERENCE)] / grad[(3, 64, 'autograd on')]:.2f}",
            beam3_b1_inference_over_no_grad=f"{grad[(3, 1, INFERENCE)] / grad[(3, 1, 'no_grad')]:.2f}",
            beam3_b1_inference_over_autograd=f"{grad[(3, 1, INFERENCE)] / grad[(3, 1, 'autograd on')]:.2f}",
        )
    )


if __name__ == "__main__":
    main()
