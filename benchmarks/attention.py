"""The additive scorer, v . tanh(W a + U h): the textbook form against captioner's two forms.

    python benchmarks/attention.py

captioner updates the one (B,G,P,A) tensor of the step in place, and while decoding builds it a few images at a time
(captioner.models.attention.AdditiveAttention.score), computing either v . tanh(x) + b ("tanh" form) or the same
function as 2v . sigmoid(2x) + b - sum(v) ("sigmoid" form); which is the default depends on the CPU. This times one
scoring call each way: while decoding (batch 64, beam 3, inference mode) and while training (batch 64, forward +
backward). The forms take turns over three rounds; each figure is the fastest round's median call. The RESULT line
gives the speed-up of this CPU's default form over the textbook, and of the tanh form over the sigmoid form.
"""

from __future__ import annotations

import torch
from common import SIZES, TextbookAdditiveAttention, machine, result, table, timed

from captioner.models.attention import FORMS, AdditiveAttention
from captioner.runtime import cpu_vendor

BATCH = 64
ROUNDS = 3


def milliseconds(attention, keys, h, train: bool) -> float:
    def run():
        if train:
            attention.score(keys, h).sum().backward()
        else:
            with torch.inference_mode():
                attention.score(keys, h)

    return 1e3 * timed(run, repeats=30, warmup=3)


def main() -> None:
    rows, figures = [], {}
    for sizes in ("shapes", "paper"):
        P, E, D, A, _, _ = SIZES[sizes]
        torch.manual_seed(0)
        captioner = AdditiveAttention(E, D, A)
        textbook = TextbookAdditiveAttention(E, D, A)
        textbook.load_state_dict(captioner.state_dict())
        for mode, G in (("decode, beam 3", 3), ("train", 1)):
            train = mode == "train"
            keys = torch.randn(BATCH, P, A, requires_grad=train)
            h = torch.randn(BATCH, G, D, requires_grad=train)
            ms = {name: float("inf") for name in ("textbook", *FORMS)}
            for _ in range(ROUNDS):
                ms["textbook"] = min(ms["textbook"], milliseconds(textbook, keys, h, train))
                for form in FORMS:
                    captioner.form = form
                    ms[form] = min(ms[form], milliseconds(captioner, keys, h, train))
            default = AdditiveAttention.form
            figures[sizes, mode] = (ms["textbook"] / ms[default], ms["sigmoid"] / ms["tanh"])
            rows.append(
                {
                    "sizes": sizes,
                    "use": mode,
                    "textbook ms": f"{ms['textbook']:.2f}",
                    "tanh form ms": f"{ms['tanh']:.2f}",
                    "sigmoid form ms": f"{ms['sigmoid']:.2f}",
                    f"default ({default}) over textbook": f"{figures[sizes, mode][0]:.1f}x",
                    "tanh over sigmoid": f"{figures[sizes, mode][1]:.2f}x",
                }
            )
    vendor = cpu_vendor() or "unknown"
    print(f"one scoring call, batch {BATCH}; {machine()}; vendor {vendor}, default form {AdditiveAttention.form}\n")
    print(table(rows))
    print(
        result(
            default_form=AdditiveAttention.form,
            shapes_decode_speedup=f"{figures['shapes', 'decode, beam 3'][0]:.1f}",
            shapes_train_speedup=f"{figures['shapes', 'train'][0]:.1f}",
            paper_decode_speedup=f"{figures['paper', 'decode, beam 3'][0]:.1f}",
            paper_train_speedup=f"{figures['paper', 'train'][0]:.1f}",
            shapes_decode_tanh_over_sigmoid=f"{figures['shapes', 'decode, beam 3'][1]:.2f}",
            shapes_train_tanh_over_sigmoid=f"{figures['shapes', 'train'][1]:.2f}",
            paper_decode_tanh_over_sigmoid=f"{figures['paper', 'decode, beam 3'][1]:.2f}",
            paper_train_tanh_over_sigmoid=f"{figures['paper', 'train'][1]:.2f}",
        )
    )


if __name__ == "__main__":
    main()
