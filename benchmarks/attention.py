"""The additive scorer, v . tanh(W a + U h): the textbook form against captioner's.

    python benchmarks/attention.py

captioner computes the same function as 2v . sigmoid(2x) + b - sum(v) with x = W a + U h, updating the one
(B,G,P,A) tensor of the step in place (captioner.models.attention.AdditiveAttention.score). This times one scoring
call both ways: while decoding (batch 64, beam 3, inference mode) and while training (batch 64, forward + backward).
"""

from __future__ import annotations

import torch
from common import SIZES, TextbookAdditiveAttention, machine, result, table, timed

from captioner.models.attention import AdditiveAttention

BATCH = 64


def milliseconds(score, attention, keys, h, train: bool) -> float:
    def run():
        if train:
            score(attention, keys, h).sum().backward()
        else:
            with torch.inference_mode():
                score(attention, keys, h)

    return 1e3 * timed(run, repeats=30, warmup=3)


def main() -> None:
    rows, figures = [], {}
    for sizes in ("shapes", "paper"):
        P, E, D, A, _, _ = SIZES[sizes]
        torch.manual_seed(0)
        attention = AdditiveAttention(E, D, A)
        for mode, G in (("decode, beam 3", 3), ("train", 1)):
            train = mode == "train"
            keys = torch.randn(BATCH, P, A, requires_grad=train)
            h = torch.randn(BATCH, G, D, requires_grad=train)
            slow = milliseconds(TextbookAdditiveAttention.score, attention, keys, h, train)
            fast = milliseconds(AdditiveAttention.score, attention, keys, h, train)
            figures[(sizes, mode)] = slow / fast
            rows.append(
                {
                    "sizes": sizes,
                    "use": mode,
                    "textbook ms": f"{slow:.2f}",
                    "captioner ms": f"{fast:.2f}",
                    "speed-up": f"{slow / fast:.1f}x",
                }
            )
    print(f"one scoring call, batch {BATCH}; {machine()}\n")
    print(table(rows))
    print(
        result(
            shapes_decode_speedup=f"{figures[('shapes', 'decode, beam 3')]:.1f}",
            shapes_train_speedup=f"{figures[('shapes', 'train')]:.1f}",
            paper_decode_speedup=f"{figures[('paper', 'decode, beam 3')]:.1f}",
            paper_train_speedup=f"{figures[('paper', 'train')]:.1f}",
        )
    )


if __name__ == "__main__":
    main()
