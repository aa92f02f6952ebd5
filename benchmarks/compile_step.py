"""Does torch.compile help? Greedy decoding and a teacher-forced training step, eager vs compiled decoder step.

    python benchmarks/compile_step.py

Shapes sizes, batch 64, 16 decoding steps. Only `AttentionDecoder.step` is compiled (the per-word work); the loops stay
in Python. Compilation time is reported separately from the steady-state time.
"""

from __future__ import annotations

import time

import torch
from common import SIZES, machine, result, table, timed
from train_step import make_batch

from captioner.decoding import greedy_search
from captioner.lit_module import caption_loss
from captioner.models.decoder import AttentionDecoder

B, MAX_LEN = 64, 16
SPECIAL = {"start_index": 1, "end_index": 2, "pad_index": 0}


def build() -> AttentionDecoder:
    _, E, D, A, M, V = SIZES["shapes"]
    torch.manual_seed(0)
    decoder = AttentionDecoder(V, E, embed_dim=M, decoder_dim=D, attention_dim=A, dropout=0.0)
    decoder.L_o.bias.data[2] = -1e4  # never emit <end>: every decode runs MAX_LEN steps
    return decoder


def measure(compiled: bool) -> dict[str, float]:
    decoder = build()
    if compiled:
        decoder.step = torch.compile(decoder.step, dynamic=False)
    P, E, *_, V = SIZES["shapes"]
    annotations = torch.randn(B, P, E)

    def decode():
        with torch.inference_mode():
            greedy_search(decoder.eval(), annotations, max_len=MAX_LEN, **SPECIAL)

    start = time.perf_counter()
    decode()  # the first call compiles
    first = time.perf_counter() - start
    decode_s = timed(decode, repeats=5, warmup=1)

    optimizer = torch.optim.Adam(decoder.parameters(), lr=4e-4)
    features, captions, lengths = make_batch(P, E, V)

    def train():
        decoder.train()
        logits, alphas = decoder(features, captions, lengths)
        loss, _, _ = caption_loss(logits, captions[:, 1 : 1 + logits.size(1)], alphas)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    start = time.perf_counter()
    train()  # compiles again: training (autograd) and every batch size the shrinking batch goes through
    train_first = time.perf_counter() - start
    train_s = timed(train, repeats=3, warmup=1)
    return {"decode_first": first, "decode": decode_s, "train_first": train_first, "train": train_s}


def main() -> None:
    eager, compiled = measure(False), measure(True)
    rows = [
        {
            "run": name,
            "greedy b64 first call s": f"{m['decode_first']:.2f}",
            "greedy b64 s": f"{m['decode']:.3f}",
            "train step first call s": f"{m['train_first']:.1f}",
            "train step s": f"{m['train']:.3f}",
        }
        for name, m in (("eager", eager), ("torch.compile(step)", compiled))
    ]
    print(f"shapes sizes, batch {B}; {machine()}\n")
    print(table(rows))
    print(
        result(
            decode_speedup=f"{eager['decode'] / compiled['decode']:.2f}",
            train_speedup=f"{eager['train'] / compiled['train']:.2f}",
            compile_s=f"{compiled['decode_first'] + compiled['train_first']:.0f}",
        )
    )


if __name__ == "__main__":
    main()
