"""Caption generation speed (images/s) on precomputed annotations: greedy, beam 3 and beam 5 at batch 1, 16 and 64.

    python benchmarks/decode.py

Runs under torch.inference_mode with a randomly initialised decoder and a fixed max_len, so every configuration
decodes the same number of steps (an untrained model rarely ends early) and only the batching differs.
"""

from __future__ import annotations

import torch
from common import SIZES, machine, result, table, timed

from captioner.decoding import beam_search, greedy_search
from captioner.models.decoder import AttentionDecoder

MAX_LEN = 16
SPECIAL = {"start_index": 1, "end_index": 2, "pad_index": 0}


def images_per_second(decoder, annotations, beam: int) -> float:
    def run():
        with torch.inference_mode():
            if beam == 1:
                greedy_search(decoder, annotations, max_len=MAX_LEN, **SPECIAL)
            else:
                beam_search(decoder, annotations, beam_size=beam, max_len=MAX_LEN, **SPECIAL)

    images = annotations.size(0)
    repeats = max(3, 64 // images)
    return images / timed(run, repeats)


def main() -> None:
    rows, figures = [], {}
    for sizes in ("shapes", "paper"):
        P, E, D, A, M, V = SIZES[sizes]
        torch.manual_seed(0)
        decoder = AttentionDecoder(V, E, embed_dim=M, decoder_dim=D, attention_dim=A).eval()
        decoder.L_o.bias.data[2] = -1e4  # never emit <end>: every run decodes exactly MAX_LEN steps
        for beam in (1, 3, 5):
            for batch in (1, 16, 64):
                speed = images_per_second(decoder, torch.randn(batch, P, E), beam)
                figures[(sizes, beam, batch)] = speed
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
    print(
        result(
            shapes_beam3_b64_over_b1=f"{figures[('shapes', 3, 64)] / figures[('shapes', 3, 1)]:.1f}",
            paper_beam3_b64_over_b1=f"{figures[('paper', 3, 64)] / figures[('paper', 3, 1)]:.1f}",
            shapes_beam3_b64_images_per_s=f"{figures[('shapes', 3, 64)]:.0f}",
            paper_beam3_b64_images_per_s=f"{figures[('paper', 3, 64)]:.1f}",
        )
    )


if __name__ == "__main__":
    main()
