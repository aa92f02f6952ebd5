"""Shared helpers for the benchmark scripts: model sizes, timing, and the RESULT line."""

from __future__ import annotations

import contextlib
import os
import platform
import resource
import statistics
import time
from collections.abc import Callable

import torch

from captioner.api import Captioner
from captioner.data.shapes import ShapesDataset
from captioner.models.attention import AdditiveAttention
from captioner.precision import cpu_has_fast_bfloat16
from captioner.runtime import cpu_info

# name -> (P, E, D, A, M, V): grid positions, encoder channels, LSTM, attention, embedding and vocabulary sizes.
SIZES = {
    "shapes": (49, 1280, 256, 256, 128, 32),  # configs/shapes.yaml: lite0 7x7, its decoder sizes, its vocabulary
    "paper": (196, 2048, 512, 512, 512, 10000),  # ResNet 14x14 grid, the paper's decoder and vocabulary sizes
}


BF16_SWITCH = "BENCH_BF16"


def bf16_timed_on_cpu() -> bool:
    """Whether the scripts time bf16-mixed on the CPU. BENCH_BF16=1: always; BENCH_BF16=0: never; unset or "auto":
    only where oneDNN has bfloat16 kernels for the CPU (`captioner.precision.cpu_has_fast_bfloat16`).

    Elsewhere bfloat16 is emulated and captioner warns before running it: in the `make bench` of docs/benchmarks.md
    (a Zen 3) it made captioning 0.06-0.31x as fast as float32 and training 0.05-0.10x, and timing it took about 60
    of the run's 90 minutes (the next run, without it, took 28), all of it measuring the emulation. A GPU's mixed
    precisions are timed whatever the switch says.
    """
    value = os.environ.get(BF16_SWITCH, "auto").strip().lower()
    if value not in ("0", "1", "auto"):
        raise SystemExit(f"{BF16_SWITCH}={value!r}: use 1 (always), 0 (never) or auto (only with native bfloat16)")
    return value == "1" or (value == "auto" and cpu_has_fast_bfloat16())


def bf16_skipped() -> str:
    """The line a script prints where it leaves out its bf16-mixed rows on the CPU."""
    why = "it is emulated on this CPU" if not cpu_has_fast_bfloat16() else f"{BF16_SWITCH}=0"
    return f"bf16-mixed not timed: {why} (captioner warns before running it); {BF16_SWITCH}=1 times it anyway"


class TextbookAdditiveAttention(AdditiveAttention):
    """The additive scorer as the paper writes it and the tutorials code it: v(tanh(W a + U h))."""

    def score(self, keys: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.v(torch.tanh(keys.unsqueeze(1) + self.U(h).unsqueeze(2))).squeeze(-1)  # (B,G,P)


def cpu_model() -> str:
    """The CPU's model name, else what `platform` knows: the hardware behind the figures can change between runs on a
    rented machine, and the ratios depend on it."""
    return cpu_info("model name") or platform.processor() or platform.machine()


def machine(device: torch.device | None = None) -> str:
    """The CPU, torch's threads and version, and the GPU when `device` is one."""
    described = f"{cpu_model()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"
    if device is not None and device.type == "cuda":
        described += f", {torch.cuda.get_device_name(device)}"
    return described


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (a GPU runs it asynchronously), so that a timer stops when it is done."""
    if device.type != "cpu":
        torch.get_device_module(device).synchronize(device)


def page_faults() -> int:
    """Minor page faults of this process so far: each is a fresh page of memory the kernel had to map and zero."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def samples(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `repeats` calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def timed(fn: Callable[[], object], repeats: int, warmup: int = 1, best: bool = False) -> float:
    """Median seconds per call, or the fastest call with best=True."""
    times = samples(fn, repeats, warmup)
    return min(times) if best else statistics.median(times)


def same_bundled_captions(
    baseline: Callable[[Captioner], contextlib.AbstractContextManager],
    variant: Callable[[Captioner], contextlib.AbstractContextManager],
    n: int = 64,
    batch_size: int | None = None,
) -> str:
    """How many of the bundled shapes model's beam-3 captions of n test images are the same under `variant` as under
    `baseline` (each called with the model, giving the context to caption in), as "same/n"."""
    captioner = Captioner.load("shapes", device="cpu")
    dataset = ShapesDataset("test", n, seed=0)
    images = [dataset.load_image(i) for i in range(n)]
    captions = []
    for setting in (baseline, variant):
        with setting(captioner):
            captions.append([c.text for c in captioner.caption(images, beam_size=3, batch_size=batch_size or n)])
    return f"{sum(a == b for a, b in zip(*captions, strict=True))}/{n}"


def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in keys}
    lines = [" | ".join(k.ljust(widths[k]) for k in keys), "-|-".join("-" * widths[k] for k in keys)]
    lines += [" | ".join(str(r[k]).ljust(widths[k]) for k in keys) for r in rows]
    return "\n".join(lines)


def result(**values) -> str:
    return "RESULT " + " ".join(f"{k}={v}" for k, v in values.items())
