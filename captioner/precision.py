"""Mixed precision for captioning outside the Lightning trainer, under Lightning's names for it.

    with decoding("bf16-mixed", device):
        generation = model.generate(images=x, beam_size=3)

"32-true" is plain float32. "bf16-mixed" and "16-mixed" run under `torch.autocast` to bfloat16 or float16: what
`trainer.precision` does in `captioner fit/validate/test/predict`, here for `Captioner` and for `captioner caption`
and `captioner evaluate`. The weights stay float32; `decoding` lets autocast cast each one once per block, and
`cast_weights_once` does the same inside Lightning's evaluation loops.

On the 2-core CPUs with native bfloat16 (AVX512-BF16; `lscpu | grep bf16`) these were measured on,
"bf16-mixed" made the encoder 1.3-2.4x as fast and changed 20-35 of 256 shapes test captions. Batch-64 beam search
gained 1.0-1.4x on an AMD EPYC (1.8x in one run since the additive scorer runs under plain autocast there) and,
since the changes of 2026-11-23 (this module's `decoding`, and the scorer's float32 under CPU autocast on Intel
CPUs), 1.1-1.8x on an Intel Xeon; single-image decoding stays slower than float32
(`benchmarks/precision.py`, docs/benchmarks.md). A CPU for which oneDNN has no bfloat16 kernels (on x86, one
without AVX-512) emulates it, far slower than float32: on an AMD EPYC with AVX2 only, a shapes training step took
12x as long and `captioner caption` on 512 images 9.5x (`benchmarks/train_step.py`, `benchmarks/caption_cli.py`).
`resolve`, and so `autocast`, `decoding`, `Captioner` and `captioner caption`/`evaluate`, warns once when asked for
bf16-mixed on such a CPU, and so does CaptioningModule when a Trainer runs it at a bfloat16 precision on a CPU.
"16-mixed" is meant for GPUs: on a CPU it runs as "bf16-mixed", with a warning, as Lightning's Trainer does.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator

import torch

from captioner.errors import CaptionerWarning, ConfigError

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    return precision


def resolve(precision: str, device: torch.device | str) -> str:
    """The precision that runs on `device`: "16-mixed" becomes "bf16-mixed" on a CPU, as in Lightning's Trainer.

    Warns when that is "bf16-mixed" on a CPU without fast bfloat16 (`warn_if_bfloat16_is_slow`).
    """
    if check_precision(precision) == "16-mixed" and torch.device(device).type == "cpu":
        warnings.warn(
            "16-mixed (float16 AMP) is not supported on CPU; using bf16-mixed instead", CaptionerWarning, stacklevel=3
        )
        precision = "bf16-mixed"
    if precision == "bf16-mixed":
        warn_if_bfloat16_is_slow(device, stacklevel=3)  # as the warning above
    return precision


@functools.cache  # a fact of the CPU: asked once per process, not at every decoding batch
def cpu_has_fast_bfloat16() -> bool:
    """Whether oneDNN, which runs torch's bfloat16 matmuls and convolutions on a CPU, has bfloat16 kernels for this
    CPU (on x86 it needs AVX-512; AVX512-BF16 or AMX make them native). True when torch cannot tell."""
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return supported is None or bool(supported())
    except RuntimeError:  # an op this build of torch declares but cannot run
        return True


SLOW_BFLOAT16 = (
    "bf16-mixed emulates bfloat16 on this CPU (oneDNN has no bfloat16 kernels for it; x86 CPUs need AVX-512) and "
    "may run 10x slower than 32-true or more"
)


def warn_if_bfloat16_is_slow(device: torch.device | str, stacklevel: int = 2) -> None:
    """Warn that bfloat16 is emulated when `device` is a CPU without fast bfloat16 (`cpu_has_fast_bfloat16`): once
    per line the warning is attributed to, as Python's warnings do. `stacklevel` is `warnings.warn`'s, as if the
    caller had called it."""
    if torch.device(device).type == "cpu" and not cpu_has_fast_bfloat16():
        warnings.warn(SLOW_BFLOAT16, CaptionerWarning, stacklevel=stacklevel + 1)


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
