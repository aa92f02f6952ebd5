"""What the benchmark scripts share: the two model sizes, a random decoder, the machine, timing and tables."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from captioner.models.decoder import AttentionDecoder

# name -> (P, E, D, A, M, V): grid positions, encoder channels, LSTM, attention, embedding and vocabulary sizes
SIZES = {
    "shapes": (49, 1280, 256, 256, 128, 32),  # the shapes decoder on EfficientNet-Lite0's 7x7 grid (feature_stride 32)
    "paper": (196, 2048, 512, 512, 512, 10000),  # a ResNet's 14x14 grid, the paper's decoder and vocabulary sizes
}
SPECIAL = {"pad_index": 0, "start_index": 1, "end_index": 2}


def random_decoder(size: str, seed: int = 0) -> AttentionDecoder:
    """A decoder with random weights at `size`, in eval mode, that never writes <end>: every search runs to max_len,
    so that the figures compare batching, not how soon captions end."""
    P, E, D, A, M, V = SIZES[size]
    torch.manual_seed(seed)
    decoder = AttentionDecoder(
        vocab_size=V, encoder_dim=E, num_pixels=P, embed_dim=M, decoder_dim=D, attention_dim=A, dropout=0.0
    ).eval()
    with torch.no_grad():
        decoder.L_o.bias[SPECIAL["end_index"]] = -1e4
    return decoder


def annotations(size: str, batch: int, seed: int = 1) -> torch.Tensor:
    P, E, *_ = SIZES[size]
    return torch.randn(batch, P, E, generator=torch.Generator().manual_seed(seed)).relu()  # (B,P,E), as after a ReLU


def machine() -> str:
    """The CPU model, torch's threads and version: the figures depend on all three."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line]
        cpu = names[0] if names else cpu
    return f"{cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def timed(fn: Callable[[], object], calls: int, warmup: int = 1) -> float:
    """The median seconds of `calls` calls of fn, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def table(rows: list[dict]) -> str:
    """A Markdown table of the rows' keys (the first row's, then any others'); a key a row lacks is an empty cell."""
    keys = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(keys) + " |", "|" + "|".join("---" for _ in keys) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(row.get(k, "")) for k in keys) + " |" for row in rows])
