"""Where does a batch-64 beam-3 call spend its time? Parts of the decoder step switched off, and scorer piece sizes.

    python benchmarks/step_parts.py

decode.py's setting at the shapes sizes: random decoder, `<end>` suppressed, 16 steps, beam 3, batch 64. The first
table times the whole call with one part of every step replaced by something nearly free (the additive scores by
zeros; the whole attention by a uniform one and a zero context; the LSTM cell by its input state), so the time a part
saves is its cost inside the step. The outputs are meaningless then; only the time counts. The additive scorer is
also timed alone on the same inputs. The second table varies `AdditiveAttention.chunk_elements`, the size of the
pieces the scorer builds when decoding, at the shapes and the paper's sizes, for beam 3 at batch 64 and at batch 1.
The variants take turns over ROUNDS rounds; each figure is the fastest call.
"""

from __future__ import annotations

from contextlib import nullcontext
from unittest.mock import patch

import torch
from common import SIZES, machine, result, table, timed
from decode import MAX_LEN, SPECIAL, random_decoder

from captioner.decoding import beam_search
from captioner.models.attention import AdditiveAttention, Attention

B, BEAM, ROUNDS = 64, 3, 6
CHUNKS = (16, 18, 20, 22, 24, 26)  # log2 of chunk_elements


def zero_scores(self, keys, h):
    return keys.new_zeros(keys.size(0), h.size(1), keys.size(1))


def uniform_attention(self, annotations, keys, h, mask=None):
    N, (_, P, E) = h.size(0), annotations.shape
    return annotations.new_zeros(N, E), annotations.new_full((N, P), 1.0 / P)


def fastest(variants: dict, run) -> dict[str, float]:
    """Fastest call of each variant (a factory of the context that sets it up), the variants taking turns."""
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(ROUNDS):
        for name, setup in variants.items():
            with setup():
                best[name] = min(best[name], timed(run, repeats=1, best=True))
    return best


def decoder_and_call(sizes: str, batch: int):
    """decode.py's random decoder at `sizes`, and a function that runs one beam-3 call on `batch` images."""
    P, E = SIZES[sizes][:2]
    decoder = random_decoder(sizes)
    annotations = torch.randn(batch, P, E)

    def run():
        with torch.inference_mode():
            beam_search(decoder, annotations, beam_size=BEAM, max_len=MAX_LEN, **SPECIAL)

    return decoder, annotations, run


def chunk_sweep(sizes: str, batch: int) -> dict[int, float]:
    _, _, run = decoder_and_call(sizes, batch)
    run()
    variants = {n: lambda n=n: patch.object(AdditiveAttention, "chunk_elements", 2**n) for n in CHUNKS}
    return {n: batch / s for n, s in fastest(variants, run).items()}


def main() -> None:
    D = SIZES["shapes"][2]
    decoder, annotations, run = decoder_and_call("shapes", B)

    parts = fastest(
        {
            "whole step": nullcontext,
            "additive scores": lambda: patch.object(AdditiveAttention, "score", zero_scores),
            "attention (scores, softmax, context)": lambda: patch.object(Attention, "forward", uniform_attention),
            "LSTM cell": lambda: patch.object(decoder.lstm, "forward", lambda x, state: state),
        },
        run,
    )
    with torch.inference_mode():
        _, keys = decoder.prepare(annotations)
        h = torch.randn(B, BEAM, D)
        scorer_alone = timed(lambda: decoder.attention.score(keys, h), repeats=50, warmup=5, best=True)

    whole = parts.pop("whole step")
    rows = [{"part switched off": "none", "ms per call": f"{1e3 * whole:.0f}", "part's share": ""}]
    rows += [
        {"part switched off": name, "ms per call": f"{1e3 * s:.0f}", "part's share": f"{1 - s / whole:.0%}"}
        for name, s in parts.items()
    ]
    scorer_in_step = (whole - parts["additive scores"]) / MAX_LEN
    print(f"shapes sizes, beam {BEAM}, batch {B}, {MAX_LEN} steps; {machine()}\n")
    print(table(rows))
    print(
        f"\nadditive scorer: {1e3 * scorer_in_step:.2f} ms per step inside the call, "
        f"{1e3 * scorer_alone:.2f} ms timed alone (batch {B} x {BEAM} hypotheses)\n"
    )

    sweep_rows, best_chunk = [], {}
    for sizes in ("shapes", "paper"):
        for batch in (B, 1):
            speeds = chunk_sweep(sizes, batch)
            best_chunk[sizes, batch] = max(speeds, key=speeds.get)
            row = {"sizes": sizes, "batch": batch}
            row |= {f"2^{n}": f"{v:.1f}" if v < 100 else f"{v:.0f}" for n, v in speeds.items()}
            sweep_rows.append(row)
    print(f"beam {BEAM}, images/s by chunk_elements (the default is 2^20):\n")
    print(table(sweep_rows))
    print(
        result(
            whole_ms=f"{1e3 * whole:.0f}",
            lstm_share=f"{1 - parts['LSTM cell'] / whole:.2f}",
            attention_share=f"{1 - parts['attention (scores, softmax, context)'] / whole:.2f}",
            scorer_share=f"{1 - parts['additive scores'] / whole:.2f}",
            scorer_in_step_ms=f"{1e3 * scorer_in_step:.2f}",
            scorer_alone_ms=f"{1e3 * scorer_alone:.2f}",
            best_chunk_shapes_b64=f"2^{best_chunk['shapes', B]}",
            best_chunk_shapes_b1=f"2^{best_chunk['shapes', 1]}",
            best_chunk_paper_b64=f"2^{best_chunk['paper', B]}",
            best_chunk_paper_b1=f"2^{best_chunk['paper', 1]}",
        )
    )


if __name__ == "__main__":
    main()
