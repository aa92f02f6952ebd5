"""Mixed precision for captioning outside the Lightning trainer, under Lightning's names for it.

    with decoding("bf16-mixed", device):
        generation = model.generate(images=x, beam_size=3)

"32-true" is plain float32. "bf16-mixed" and "16-mixed" run under `torch.autocast` to bfloat16 or float16: what
`trainer.precision` does in `captioner fit/validate/test/predict`, here for `Captioner` and for `captioner caption`
and `captioner evaluate`. The weights stay float32; `decoding` lets autocast cast each one once per block, and
`cast_weights_once` does the same inside Lightning's evaluation loops.

On the 2-core CPUs these were measured on, which have native bfloat16 (AVX512-BF16; `lscpu | grep bf16`),
"bf16-mixed" made the encoder 1.3-2.4x as fast and changed 20-35 of 256 shapes test captions. Batch-64 beam search
gained 1.0-1.4x on an AMD EPYC (1.8x in one run since the additive scorer runs under plain autocast there) and,
since the changes of 2026-11-23 (this module's `decoding`, and the scorer's float32 under CPU autocast on Intel
CPUs), 1.1-1.8x on an Intel Xeon; single-image decoding stays slower than float32
(`benchmarks/precision.py`, docs/benchmarks.md). A CPU without native bfloat16 emulates it, and may be slower than
float32. "16-mixed" is meant for GPUs: on a CPU it runs as "bf16-mixed", with a warning, as Lightning's Trainer does.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

from captioner.errors import ConfigError

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    return precision


def resolve(precision: str, device: torch.device | str) -> str:
    """The precision that runs on `device`: "16-mixed" becomes "bf16-mixed" on a CPU, as in Lightning's Trainer."""
    if check_precision(precision) == "16-mixed" and torch.device(device).type == "cpu":
        warnings.warn("16-mixed (float16 AMP) is not supported on CPU; using bf16-mixed instead", stacklevel=3)
        return "bf16-mixed"
    return precision


def autocast(precision: str, device: torch.device | str) -> contextlib.AbstractContextManager:
    """The context to run a forward pass in at `precision` on `device`."""
    return _autocast(resolve(precision, device), device)


def _autocast(precision: str, device: torch.device | str) -> contextlib.AbstractContextManager:
    if precision == "32-true":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=_DTYPES[precision])


@contextlib.contextmanager
def decoding(precision: str, device: torch.device | str) -> Iterator[None]:
    """The context to caption in at `precision` on `device`, what `Captioner` and `captioner evaluate` use.

    At "32-true", `torch.inference_mode()`. At a mixed precision, autocast under `torch.no_grad()` with inference mode
    off: autocast keeps its cast of a weight for the rest of the block only outside inference mode (PyTorch has
    skipped its cast cache there since pytorch/pytorch#165068), and under inference mode every step of a search
    would cast every weight of the decoder again.
    """
    precision = resolve(precision, device)
    if precision == "32-true":
        with torch.inference_mode():
            yield
    else:
        with torch.inference_mode(False), torch.no_grad(), _autocast(precision, device):
            yield


@contextlib.contextmanager
def cast_weights_once(device: torch.device | str) -> Iterator[None]:
    """For decoding inside someone else's autocast block with autograd off, as in Lightning's `validate`, `test` and
    `predict` loops: autocast casts each weight once in the block instead of at every op.

    Lightning's autocast has its cast cache off, and the loops run under inference mode, where PyTorch skips the
    cache too (see `decoding`). So the block runs under `torch.no_grad()` with inference mode off, in a nested
    autocast of the same type with its cache on, and the cache is cleared when the block ends. Outside autocast, or
    with autograd on, it changes nothing.
    """
    device_type = torch.device(device).type
    if not torch.is_autocast_enabled(device_type) or torch.is_grad_enabled():
        yield
        return
    dtype = torch.get_autocast_dtype(device_type)
    try:
        with torch.inference_mode(False), torch.no_grad(), torch.autocast(device_type, dtype=dtype, cache_enabled=True):
            yield
    finally:
        torch.clear_autocast_cache()
