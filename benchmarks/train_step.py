"""Teacher-forced training throughput (captions/s): forward + backward + Adam step on precomputed annotations.

    python benchmarks/train_step.py

Compares captioner's decoder (in float32, and in bf16 mixed precision) with a naive variant that re-projects the
annotations at every step and runs the whole batch for the longest caption (what the popular tutorials do), at the
shapes sizes and the paper's sizes. Also reports, from the torch profiler, the share of CPU time spent in matmul and
LSTM kernels.
"""

from __future__ import annotations

import torch
from common import SIZES, TextbookAdditiveAttention, machine, result, table, timed
from torch.profiler import ProfilerActivity, profile

from captioner.lit_module import caption_loss
from captioner.models.decoder import AttentionDecoder

B, T = 64, 16
MATMUL_KERNELS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::_thnn_fused_lstm")


class NaiveDecoder(AttentionDecoder):
    """The tutorials' loop: W a recomputed at every step, every caption run to the longest length, and the
    textbook tanh scorer."""

    def __init__(self, vocab_size: int, encoder_dim: int, **kwargs):
        super().__init__(vocab_size, encoder_dim, **kwargs)
        self.attention = TextbookAdditiveAttention(encoder_dim, kwargs["decoder_dim"], kwargs["attention_dim"])

    def forward(self, annotations, captions, lengths):
        h, c = self.init_state(annotations)
        T = int(lengths.max()) - 1
        logits, alphas = [], []
        for t in range(T):
            _, keys = self.prepare(annotations)  # recomputed every step
            step_logits, (h, c), alpha = self.step(captions[:, t], (h, c), annotations, keys)
            logits.append(step_logits)
            alphas.append(alpha)
        mask = (torch.arange(T).unsqueeze(0) < (lengths - 1).unsqueeze(1)).unsqueeze(-1)  # (B,T,1)
        return torch.stack(logits, 1) * mask, torch.stack(alphas, 1) * mask


def make_batch(P: int, E: int, V: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(T // 2, 3 * T // 2 + 1, (B,), generator=generator)  # mean about T words
    captions = torch.randint(4, V, (B, int(lengths.max())), generator=generator)
    captions[:, 0] = 1
    for i, n in enumerate(lengths.tolist()):
        captions[i, n - 1], captions[i, n:] = 2, 0
    return torch.randn(B, P, E, generator=generator), captions, lengths


def trainer(decoder_cls, sizes: str, precision: str = "32"):
    """One training step; precision "bf16-mixed" runs forward and loss under CPU autocast to bfloat16, which is what
    Lightning's `trainer.precision: bf16-mixed` does on a CPU."""
    P, E, D, A, M, V = SIZES[sizes]
    torch.manual_seed(0)
    decoder = decoder_cls(V, E, embed_dim=M, decoder_dim=D, attention_dim=A, dropout=0.5)
    optimizer = torch.optim.Adam(decoder.parameters(), lr=4e-4)
    annotations, captions, lengths = make_batch(P, E, V)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")

    def step():
        with autocast:
            logits, alphas = decoder(annotations, captions, lengths)
            loss, _, _ = caption_loss(logits, captions[:, 1 : 1 + logits.size(1)], alphas)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def matmul_share(step) -> float:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    return sum(e.self_cpu_time_total for e in events if e.key in MATMUL_KERNELS) / total


def main() -> None:
    rows, figures = [], {}
    for sizes, repeats in (("shapes", 10), ("paper", 3)):
        for name, cls, precision in (
            ("captioner", AttentionDecoder, "32"),
            ("captioner", AttentionDecoder, "bf16-mixed"),
            ("naive", NaiveDecoder, "32"),
        ):
            step = trainer(cls, sizes, precision)
            seconds = timed(step, repeats)
            profiled = name == "captioner" and precision == "32"
            share = matmul_share(step) if profiled else float("nan")
            rows.append(
                {
                    "sizes": sizes,
                    "decoder": name,
                    "precision": precision,
                    "ms/step": f"{seconds * 1000:.0f}",
                    "captions/s": f"{B / seconds:.0f}",
                    "matmul share": f"{share:.0%}" if profiled else "",
                }
            )
            figures[(sizes, name, precision)] = B / seconds
            if profiled:
                figures[(sizes, "share")] = share
    print(f"batch {B}, mean caption length about {T} words; {machine()}\n")
    print(table(rows))
    speed = {key: value for key, value in figures.items() if len(key) == 3}

    def bf16_gain(sizes: str) -> float:
        return speed[(sizes, "captioner", "bf16-mixed")] / speed[(sizes, "captioner", "32")]

    print(
        result(
            shapes_captions_per_s=f"{speed[('shapes', 'captioner', '32')]:.0f}",
            shapes_speedup_vs_naive=f"{speed[('shapes', 'captioner', '32')] / speed[('shapes', 'naive', '32')]:.2f}",
            paper_captions_per_s=f"{speed[('paper', 'captioner', '32')]:.1f}",
            paper_speedup_vs_naive=f"{speed[('paper', 'captioner', '32')] / speed[('paper', 'naive', '32')]:.2f}",
            shapes_bf16_speedup=f"{bf16_gain('shapes'):.2f}",
            paper_bf16_speedup=f"{bf16_gain('paper'):.2f}",
            shapes_matmul_share=f"{figures[('shapes', 'share')]:.2f}",
            paper_matmul_share=f"{figures[('paper', 'share')]:.2f}",
        )
    )


if __name__ == "__main__":
    main()
