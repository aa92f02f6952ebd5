"""Training speed (captions/s): one optimizer step of teacher forcing (forward, loss, backward, Adam) on annotations,
captioner's decoder against the same model trained the way the popular tutorials write the loop.

    python benchmarks/train_step.py

The tutorial loop projects the annotations for attention again at every word, runs the whole batch for as many
words as the longest caption has, and runs the output layer word by word. captioner's decoder (`AttentionDecoder`)
projects them once per batch, runs each word on the captions still going, and runs the output layer once on every
word. Both compute the same function with the same weights; batches of 64 captions of 8 to 16 words, as an epoch's
batches differ in length. Each figure is the median step over 3 passes over 4 batches, after one untimed pass.

The last table compares the decoder's two forms of teacher forcing, uncompiled: the shrinking batch (the CPU's) and
fixed shapes (every caption runs every step, padded to `bucket_steps`: the form the GPU compiles), taking turns over
3 rounds.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F
from common import SIZES, SPECIAL, annotations, machine, random_decoder, table, timed

from captioner.models.show_attend_tell import caption_loss, pad_to_bucket

B, T = 64, 16


def tutorial_forward(decoder, a: torch.Tensor, captions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher forcing as the tutorials write it, with captioner's modules: the same function, computed naively."""
    h, c = decoder.init_state(a)
    scorer, logits, alphas = decoder.attention, [], []
    for t in range(captions.size(1) - 1):
        e = scorer.v(torch.tanh(scorer.W(a) + scorer.U(h).unsqueeze(1))).squeeze(-1)  # W a again at every word
        alpha = F.softmax(e, dim=1)  # (B,P)
        context = torch.sigmoid(decoder.f_beta(h)) * (alpha.unsqueeze(2) * a).sum(dim=1)  # (B,E)
        y = decoder.embedding(captions[:, t])
        h, c = decoder.lstm(torch.cat([y, context], dim=1), (h, c))
        logits.append(decoder.output(y, h, context))
        alphas.append(alpha)
    return torch.stack(logits, dim=1), torch.stack(alphas, dim=1)  # (B,T-1,V), (B,T-1,P)


def batches(size: str) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    *_, V = SIZES[size]
    generator = torch.Generator().manual_seed(0)
    out = []
    for i in range(4):
        lengths = torch.randint(8, T + 1, (B,), generator=generator)
        lengths[0] = T  # every batch has a caption of T words
        captions = torch.randint(3, V, (B, T), generator=generator)
        captions[:, 0] = SPECIAL["start_index"]
        captions[torch.arange(B), lengths - 1] = SPECIAL["end_index"]
        captions[torch.arange(T) >= lengths.unsqueeze(1)] = SPECIAL["pad_index"]
        out.append((annotations(size, B, seed=i), captions, lengths))
    return out


def captions_per_second(size: str, naive: bool, fixed_shape: bool = False) -> float:
    decoder = random_decoder(size).train()
    optimizer = torch.optim.Adam(decoder.parameters(), lr=1e-4)
    data = batches(size)

    def step(a, captions, lengths):
        if naive:
            logits, alphas = tutorial_forward(decoder, a, captions)
        elif fixed_shape:
            captions = pad_to_bucket(captions, SPECIAL["pad_index"])
            logits, alphas = decoder(a, captions)
        else:
            logits, alphas = decoder(a, captions, lengths)
        loss = caption_loss(logits, captions[:, 1:], alphas, sync_free=fixed_shape)[0]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def one_pass():
        for batch in data:
            step(*batch)

    return B * len(data) / timed(one_pass, calls=3)


def main() -> None:
    print(f"# train_step.py on {machine()}\n")
    rows = []
    for size in SIZES:
        captioner, tutorial = captions_per_second(size, naive=False), captions_per_second(size, naive=True)
        rows.append(
            {
                "sizes": size,
                "captioner": f"{captioner:.1f}",
                "tutorial loop": f"{tutorial:.1f}",
                "speed-up": f"{captioner / tutorial:.2f}x",
            }
        )
    print(f"captions/s, batches of {B}\n")
    print(table(rows))

    rows = []
    for size in SIZES:
        rates = {"shrinking": [], "fixed shapes": []}
        for _ in range(3):  # the two take turns, so that a slow spell of the machine hits both
            for form in rates:
                rates[form].append(captions_per_second(size, naive=False, fixed_shape=form == "fixed shapes"))
        shrinking, fixed = (statistics.median(rates[form]) for form in rates)
        ratio = f"{fixed / shrinking:.2f}x"
        rows.append({"sizes": size, "shrinking": f"{shrinking:.1f}", "fixed shapes": f"{fixed:.1f}", "ratio": ratio})
    print(f"\nteacher forcing's two forms, uncompiled, captions/s, batches of {B} (median of 3 rounds)\n")
    print(table(rows))


if __name__ == "__main__":
    main()
