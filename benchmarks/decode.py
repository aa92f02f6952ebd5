"""Caption generation speed (images/s) on precomputed annotations: greedy, beam 3 and beam 5 at batch 1, 16 and 64.

    python benchmarks/decode.py

Runs under torch.inference_mode with a randomly initialised decoder and a fixed max_len, so every configuration
decodes the same number of steps (an untrained model rarely ends early) and only the batching differs. Each figure
is the fastest of several calls, over three rounds in which the batch sizes take turns: on a shared machine the
noise only ever slows a call down, and the ratios compare batch sizes measured under the same conditions.

A second table uses the bundled shapes model on 64 test images, where captions end at different steps: it counts
the rows the decoder ran against the rows of a fixed-shape search (every hypothesis of every image run to the
last step), which is what the shrinking batch saves.

A third table times the largest matmul of a step, the LSTM input projection, for 1 to 5 rows: at batch 1 a beam of
K runs K rows, and on this machine's BLAS a few rows do not cost the same as one.
"""

from __future__ import annotations

import torch
from common import SIZES, machine, result, table, timed

from captioner.api import Captioner
from captioner.data.shapes import ShapesDataset
from captioner.decoding import beam_search, greedy_search
from captioner.models.decoder import AttentionDecoder

MAX_LEN = 16
BATCHES = (1, 16, 64)
ROUNDS = 3
SPECIAL = {"start_index": 1, "end_index": 2, "pad_index": 0}


def seconds_per_batch(decoder, annotations, beam: int) -> float:
    def run():
        with torch.inference_mode():
            if beam == 1:
                greedy_search(decoder, annotations, max_len=MAX_LEN, **SPECIAL)
            else:
                beam_search(decoder, annotations, beam_size=beam, max_len=MAX_LEN, **SPECIAL)

    return timed(run, repeats=max(2, 32 // annotations.size(0)), best=True)


class RowCounter:
    """Wraps a decoder and counts the rows of every decoding step."""

    def __init__(self, decoder):
        self.decoder, self.rows = decoder, []

    def __getattr__(self, name):
        return getattr(self.decoder, name)

    def step(self, tokens, state, annotations, keys):
        self.rows.append(tokens.size(0))
        return self.decoder.step(tokens, state, annotations, keys)


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
        counter = RowCounter(model.decoder)

        def run(decoder=counter, beam=beam):
            with torch.inference_mode():
                if beam == 1:
                    return greedy_search(decoder, annotations, max_len=max_len, **special)
                return beam_search(decoder, annotations, beam_size=beam, max_len=max_len, **special)

        out = run()
        ran, steps = sum(counter.rows), len(counter.rows)
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


def lstm_input_rows(sizes: str) -> dict:
    _, E, D, _, M, _ = SIZES[sizes]
    weight, bias = torch.randn(4 * D, M + E), torch.randn(4 * D)
    row = {"sizes": sizes, "matmul": f"(rows x {M + E}) @ ({M + E} x {4 * D})"}
    with torch.inference_mode():
        for n in (1, 2, 3, 4, 5):
            x = torch.randn(n, M + E)
            row[f"{n} rows, us"] = (
                f"{1e6 * timed(lambda x=x: torch.addmm(bias, x, weight.t()), repeats=200, warmup=20):.0f}"
            )
    return row


def main() -> None:
    rows, figures = [], {}
    for sizes in ("shapes", "paper"):
        P, E, D, A, M, V = SIZES[sizes]
        torch.manual_seed(0)
        decoder = AttentionDecoder(V, E, embed_dim=M, decoder_dim=D, attention_dim=A).eval()
        decoder.L_o.bias.data[2] = -1e4  # never emit <end>: every run decodes exactly MAX_LEN steps
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
    print("\nThe LSTM input projection alone (median of 200 calls):\n")
    print(table([lstm_input_rows("shapes"), lstm_input_rows("paper")]))
    print(
        result(
            shapes_beam3_b64_over_b1=f"{figures[('shapes', 3, 64)] / figures[('shapes', 3, 1)]:.1f}",
            paper_beam3_b64_over_b1=f"{figures[('paper', 3, 64)] / figures[('paper', 3, 1)]:.1f}",
            shapes_beam3_b64_images_per_s=f"{figures[('shapes', 3, 64)]:.0f}",
            paper_beam3_b64_images_per_s=f"{figures[('paper', 3, 64)]:.1f}",
            shapes_beam5_b64_over_b1=f"{figures[('shapes', 5, 64)] / figures[('shapes', 5, 1)]:.1f}",
            shapes_greedy_b64_over_b1=f"{figures[('shapes', 1, 64)] / figures[('shapes', 1, 1)]:.1f}",
            trained_beam3_rows_saved=trained[1]["saved"],
        )
    )


if __name__ == "__main__":
    main()
