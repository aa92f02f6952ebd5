"""Teacher-forced training throughput (captions/s): forward + backward + Adam step on precomputed annotations.

    python benchmarks/train_step.py                  # on the CPU
    python benchmarks/train_step.py --device cuda    # on a GPU, with 16-mixed too

Compares captioner's decoder (in float32, and in mixed precision) with a naive variant that re-projects the
annotations at every step and runs the whole batch for the longest caption (what the popular tutorials do), at the
shapes sizes and the paper's sizes. Each step runs on the next of a cycle of batches of different caption lengths
(16 at the shapes sizes, 4 at the paper's), as an epoch's steps do; the table gives the median step of one pass over
the cycle, after an untimed pass. Also reports, on a CPU, the share of CPU time spent in matmul and LSTM kernels
(torch profiler).

Mixed precision runs as `captioner fit --trainer.precision ...` runs it: the forward pass and the loss in the
autocast of Lightning's own `MixedPrecision` plugin, whose cast cache is off (each weight is cast again at every
word), and 16-mixed scales the loss with the plugin's GradScaler. bf16-mixed is measured on a CPU, and on a GPU that
supports it; 16-mixed on a GPU only (Lightning runs it as bf16-mixed on a CPU). On a CPU without native bfloat16,
bf16-mixed is left out unless BENCH_BF16=1 (common.bf16_timed_on_cpu). The process starts with the
settings the `captioner` command starts with (captioner.runtime): among them room for 16384 oneDNN kernels, without
which bf16-mixed training rebuilds kernels all the time.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools

import torch
from common import (
    SIZES,
    TextbookAdditiveAttention,
    bf16_skipped,
    bf16_timed_on_cpu,
    machine,
    result,
    synchronize,
    table,
    timed,
)
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.profiler import ProfilerActivity, profile

from captioner.lit_module import caption_loss
from captioner.models.decoder import AttentionDecoder
from captioner.runtime import keep_freed_memory, keep_more_onednn_kernels

B, T = 64, 16
# A training epoch's batches differ in their caption lengths, so the decoder's shrinking batch gives its matmuls
# different row counts from batch to batch; a step repeated on one batch would see the same few shapes every time.
# That matters for bf16-mixed on a CPU, where oneDNN makes a kernel per matmul shape and keeps a limited number of them.
BATCHES = {"shapes": 16, "paper": 4}
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
        steps = torch.arange(T, device=lengths.device)
        mask = (steps.unsqueeze(0) < (lengths - 1).unsqueeze(1)).unsqueeze(-1)  # (B,T,1)
        return torch.stack(logits, 1) * mask, torch.stack(alphas, 1) * mask


def make_batch(
    P: int, E: int, V: int, device: torch.device | str = "cpu", seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)  # drawn on the CPU, so every device gets the same batch
    lengths = torch.randint(T // 2, 3 * T // 2 + 1, (B,), generator=generator)  # mean about T words
    captions = torch.randint(4, V, (B, int(lengths.max())), generator=generator)
    captions[:, 0] = 1
    for i, n in enumerate(lengths.tolist()):
        captions[i, n - 1], captions[i, n:] = 2, 0
    annotations = torch.randn(B, P, E, generator=generator)
    return annotations.to(device), captions.to(device), lengths.to(device)


def mixed_precisions(device: torch.device, cpu_bf16: bool = True) -> tuple[str, ...]:
    """The mixed precisions Lightning runs as such on `device`; on a CPU, bf16-mixed if `cpu_bf16`."""
    if device.type == "cpu":
        return ("bf16-mixed",) if cpu_bf16 else ()
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return ("16-mixed",)
    return ("16-mixed", "bf16-mixed")


def trainer(
    decoder_cls,
    sizes: str,
    device: torch.device | str = "cpu",
    precision: str = "32-true",
    batches: int = 16,
):
    """A training step at `precision`, as `captioner fit` runs it (see the module docstring), each call on the next of
    `batches` batches."""
    P, E, D, A, M, V = SIZES[sizes]
    device = torch.device(device)
    torch.manual_seed(0)
    decoder = decoder_cls(V, E, embed_dim=M, decoder_dim=D, attention_dim=A, dropout=0.5).to(device)
    optimizer = torch.optim.Adam(decoder.parameters(), lr=4e-4)
    cycle = itertools.cycle([make_batch(P, E, V, device, seed) for seed in range(batches)])
    plugin = None if precision == "32-true" else MixedPrecision(precision, device.type)
    scaler = getattr(plugin, "scaler", None)  # 16-mixed's GradScaler

    def step():
        annotations, captions, lengths = next(cycle)
        with plugin.forward_context() if plugin is not None else contextlib.nullcontext():
            logits, alphas = decoder(annotations, captions, lengths)
            loss, _, _ = caption_loss(logits, captions[:, 1 : 1 + logits.size(1)], alphas)
        optimizer.zero_grad(set_to_none=True)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:  # 16-mixed, as the plugin's backward and optimizer_step run it
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        synchronize(device)

    return step


def matmul_share(step) -> float:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    return sum(e.self_cpu_time_total for e in events if e.key in MATMUL_KERNELS) / total


def parse_device(argv: list[str] | None = None) -> torch.device:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="the torch device to train on: cpu (default), cuda, ...")
    name = parser.parse_args(argv).device
    try:
        device = torch.device(name)
    except RuntimeError as error:
        parser.error(f"--device {name}: {error}")
    if device.type != "cpu" and not torch.get_device_module(device).is_available():
        parser.error(f"--device {name}: this machine has no {device.type} device")
    return device


def main(argv: list[str] | None = None) -> None:
    device = parse_device(argv)
    keep_freed_memory()  # as the `captioner` command starts
    keep_more_onednn_kernels()
    mixed = mixed_precisions(device, cpu_bf16=bf16_timed_on_cpu())  # cpu_bf16 only matters on a CPU
    variants = [("captioner", AttentionDecoder, "32-true")]
    variants += [("captioner", AttentionDecoder, precision) for precision in mixed]
    variants.append(("naive", NaiveDecoder, "32-true"))
    rows, speed, shares = [], {}, {}
    for sizes, batches in BATCHES.items():
        for name, cls, precision in variants:
            step = trainer(cls, sizes, device, precision, batches)
            seconds = timed(step, repeats=batches, warmup=batches)  # an untimed pass over the cycle, then a timed one
            profiled = name == "captioner" and precision == "32-true" and device.type == "cpu"
            if profiled:
                shares[sizes] = matmul_share(step)
            rows.append(
                {
                    "sizes": sizes,
                    "decoder": name,
                    "precision": precision,
                    "ms/step": f"{seconds * 1000:.0f}",
                    "captions/s": f"{B / seconds:.0f}",
                    "matmul share": f"{shares[sizes]:.0%}" if profiled else "",
                }
            )
            speed[(sizes, name, precision)] = B / seconds
    print(f"batch {B}, mean caption length about {T} words; {machine(device)}\n")
    if not mixed:
        print(f"{bf16_skipped()}\n")
    print(table(rows))

    def captioner(sizes: str, precision: str = "32-true") -> float:
        return speed[(sizes, "captioner", precision)]

    figures = {}
    for sizes in BATCHES:
        digits = 0 if sizes == "shapes" else 1
        figures[f"{sizes}_captions_per_s"] = f"{captioner(sizes):.{digits}f}"
        figures[f"{sizes}_speedup_vs_naive"] = f"{captioner(sizes) / speed[(sizes, 'naive', '32-true')]:.2f}"
    for precision in mixed:
        short = {"bf16-mixed": "bf16", "16-mixed": "fp16"}[precision]
        for sizes in BATCHES:
            figures[f"{sizes}_{short}_speedup"] = f"{captioner(sizes, precision) / captioner(sizes):.2f}"
    for sizes, share in shares.items():
        figures[f"{sizes}_matmul_share"] = f"{share:.2f}"
    print(result(**figures))


if __name__ == "__main__":
    main()
