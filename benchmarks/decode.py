"""Caption generation speed (images/s) on precomputed annotations: greedy, beam 3 and beam 5 at batch 1, 16 and 64.

    python benchmarks/decode.py

Runs under torch.inference_mode with a randomly initialised decoder and a fixed max_len, so every configuration
decodes the same number of steps (an untrained model rarely ends early) and only the batching differs. Each figure
is the fastest of several calls, over three rounds in which the batch sizes take turns: on a shared machine the
noise only ever slows a call down, and the ratios compare batch sizes measured under the same conditions.

A second table uses the bundled shapes model on 64 test images, where captions end at different steps: it counts
the rows the decoder ran against the rows of a fixed-shape search (every hypothesis of every image run to the
last step), which is what the shrinking batch saves.

A third table times the largest matmul of a step, the LSTM input projection, for 1 to 5 rows (at batch 1 a beam of
K runs K rows, and on this machine's BLAS a few rows do not cost the same as one) and for the 192 rows of beam 3 at
batch 64: how much batching can gain on the kernel that takes the largest share of a batch-64 step.
"""

from __future__ import annotations

import torch
from common import SIZES, machine, result, table, timed

from captioner.api import Captioner
from captioner.data.shapes import ShapesDataset
from captioner.decoding import beam_search, greedy_search
from captioner.models.decoder import AttentionDecoder
from captioner.precision import autocast

MAX_LEN = 16
BATCHES = (1, 16, 64)
ROUNDS = 3
SPECIAL = {"start_index": 1, "end_index": 2, "pad_index": 0}


def random_decoder(sizes: str) -> AttentionDecoder:
    """The decoder these benchmarks time: random weights (seed 0) at `sizes`, in eval mode, with `<end>` suppressed
    so that every call decodes exactly MAX_LEN steps. Seeds torch, so inputs drawn next are the same in every run."""
    _, E, D, A, M, V = SIZES[sizes]
    torch.manual_seed(0)
    decoder = AttentionDecoder(V, E, embed_dim=M, decoder_dim=D, attention_dim=A).eval()
    decoder.L_o.bias.data[SPECIAL["end_index"]] = -1e4
    return decoder


def seconds_per_batch(decoder, annotations, beam: int, precision: str = "32-true") -> float:
    def run():
        with torch.inference_mode(), autocast(precision, annotations.device):
            if beam == 1:
                greedy_search(decoder, annotations, max_len=MAX_LEN, **SPECIAL)
            else:
                beam_search(decoder, annotations, beam_size=beam, max_len=MAX_LEN, **SPECIAL)

    return timed(run, repeats=max(2, 32 // annotations.size(0)), best=True)


def trained_model_rows(batch: int = 64, max_len: int = 30) -> list[dict]:
    captioner = Captioner.load("shapes", device="cpu")
    model = captioner.model
    dataset = ShapesDataset("test", batch, seed=0)
    with torch.inference_mode():
        images = torch.stack([captioner.transform(dataset.load_image(i)) for i in range(batch)])
        annotations = model.encoder(images)
    special = {"start_index": model.start_index, "end_index": model.end_index, "pad_index": model.pad_index}
    rows = []
    for beam in (1, 3, 5):

        def run(beam=beam):
            with torch.inference_mode():
                if beam == 1:
                    return greedy_search(model.decoder, annotations, max_len=max_len, **special)
                return beam_search(model.decoder, annotations, beam_size=beam, max_len=max_len, **special)

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
            seconds[n] = timed(lambda x=x: torch.addmm(bias, x, weight.t()), repeats=200 if n < 192 else 50, warmup=20)
            row[f"{n} rows, us"] = f"{1e6 * seconds[n]:.0f}"
    row["192 rows, GFLOP/s"] = f"{2 * 192 * (M + E) * 4 * D / seconds[192] / 1e9:.0f}"
    row["b64 over b1"] = f"{64 * seconds[3] / seconds[192]:.1f}"
    row["share of b64 beam 3"] = f"{MAX_LEN * seconds[192] / beam_b64_seconds:.0%}"
    return row


def main() -> None:
    rows, figures = [], {}
    for sizes in ("shapes", "paper"):
        P, E = SIZES[sizes][:2]
        decoder = random_decoder(sizes)
        for beam in (1, 3, 5):
            inputs = {batch: torch.randn(batch, P, E) for batch in BATCHES}
            best = dict.fromkeys(BATCHES, float("inf"))
            for _ in range(ROUNDS):  # the batch sizes take turns, so that a slow spell of the machine hits them all
                for batch in BATCHES:
                    best[batch] = min(best[batch], seconds_per_batch(decoder, inputs[batch], beam))
            for batch in BATCHES:
                figures[(sizes, beam, batch)] = speed = batch / best[batch]
                rows.append(
                    {
                        "sizes": sizes,
                        "search": "greedy" if beam == 1 else f"beam {beam}",
                        "batch": batch,
                        "images/s": f"{speed:.1f}",
                    }
                )
    print(f"{MAX_LEN} decoding steps per image; {machine()}\n")
    print(table(rows))
    trained = trained_model_rows()
    print("\nBundled shapes model, 64 test images, batch 64, max_len 30:\n")
    print(table(trained))
    print("\nThe LSTM input projection alone (median of 200 calls; 50 for 192 rows):\n")
    lstm = [lstm_input_rows(sizes, 64 / figures[(sizes, 3, 64)]) for sizes in ("shapes", "paper")]
    print(table(lstm))
    print(
        result(
            shapes_beam3_b64_over_b1=f"{figures[('shapes', 3, 64)] / figures[('shapes', 3, 1)]:.1f}",
            paper_beam3_b64_over_b1=f"{figures[('paper', 3, 64)] / figures[('paper', 3, 1)]:.1f}",
            shapes_beam3_b64_images_per_s=f"{figures[('shapes', 3, 64)]:.0f}",
            paper_beam3_b64_images_per_s=f"{figures[('paper', 3, 64)]:.1f}",
            shapes_beam5_b64_over_b1=f"{figures[('shapes', 5, 64)] / figures[('shapes', 5, 1)]:.1f}",
            shapes_greedy_b64_over_b1=f"{figures[('shapes', 1, 64)] / figures[('shapes', 1, 1)]:.1f}",
            trained_beam3_rows_saved=trained[1]["saved"],
            shapes_lstm_matmul_b64_over_b1=lstm[0]["b64 over b1"],
        )
    )


if __name__ == "__main__":
    main()
