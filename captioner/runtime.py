"""Process-wide settings for running captioner on a CPU, and the CPU facts that choose between equivalent kernels.

glibc's malloc serves large blocks (above a threshold that starts at 128 KiB and adapts) with fresh `mmap` pages and
gives the top of its heap back to the system once more than twice that threshold is free. A decoding or training
step allocates and frees tensors of several MiB, so the memory can go back and forth between the process and the
kernel, and every fresh page costs a page fault and zero-filling. `benchmarks/malloc.py` counted 29,000-33,000
page faults per beam-search call at batch 64 in some processes (none in others) when the additive scorer took fresh
memory for its largest tensor at every step; since it reuses a per-thread workspace (captioner.models.attention),
0-1,900 without this setting, and none with it.

`keep_freed_memory` raises both thresholds so that freed blocks stay in the process for reuse: the same trade that
PyTorch's CPU tuning guides make by preloading jemalloc or tcmalloc. The process then holds on to memory it freed
(up to its peak), which is what a captioning or training run wants. The `captioner` command calls it at start-up;
set CAPTIONER_KEEP_FREED_MEMORY=0 to leave malloc alone. Python users may call it themselves.

`keep_more_onednn_kernels` raises oneDNN's kernel cache from 1024 to 16384 kernels, for bf16-mixed training on a CPU
(see its docstring). The `captioner` command calls it at start-up too.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # the largest glibc accepts on 64-bit systems
TRIM_THRESHOLD = 2**30


def keep_freed_memory() -> bool:
    """Keep freed memory in the process for reuse (glibc only). Returns whether the setting was applied.

    Does nothing, and returns False, on systems without glibc (macOS, Windows, musl) or when the environment
    variable CAPTIONER_KEEP_FREED_MEMORY is "0".
    """
    if os.environ.get("CAPTIONER_KEEP_FREED_MEMORY", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    mallopt = glibc_mallopt()
    if mallopt is None:
        return False
    # Both or neither: setting either one turns off glibc's adaptive thresholds, so the trim threshold alone would
    # leave every block above 128 KiB to mmap. `and` skips it when the mmap threshold is refused (returns 0).
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def glibc_mallopt():
    """glibc's `mallopt(param, value)` (returns 1 when it applied the value, 0 when it refused it), from the C library
    the interpreter runs on; None where that library has none (not glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt


ONEDNN_KERNELS = 16384


def keep_more_onednn_kernels(capacity: int = ONEDNN_KERNELS) -> bool:
    """Let oneDNN keep `capacity` kernels rather than its default 1024, unless the environment variable
    ONEDNN_PRIMITIVE_CACHE_CAPACITY already says how many. Returns whether it set it.

    oneDNN runs torch's bfloat16 matmuls on a CPU (and, on AMD CPUs, captioner's float32 decoding matmuls:
    captioner.models.onednn), and builds a kernel for each new matmul shape. The decoder's shrinking batch gives its
    matmuls a different number of rows at almost every word, and in bf16-mixed training each of them is a new shape
    forward and backward: more shapes than the 1024 kernels oneDNN keeps by default, so it kept rebuilding them
    (tests/test_runtime.py shows it on 1,100 shapes). On an Intel Xeon, `captioner fit --config configs/shapes.yaml
    --trainer.precision=bf16-mixed` took 318-341 s with this and 552 s without, with the same results, and peak
    memory within its run-to-run variation (docs/benchmarks-earlier.md, Training step). oneDNN reads the variable
    when it first needs its cache, so this must run before oneDNN builds its first kernel in the process. The
    `captioner` command calls it at start-up, and CaptioningModule and Captioner when they are made: training with
    one's own Lightning Trainer and captioning from Python get the same room.
    """
    if "ONEDNN_PRIMITIVE_CACHE_CAPACITY" in os.environ:
        return False
    os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(capacity)
    return True


def cpu_info(field: str) -> str:
    """The value of `field` ("vendor_id", "model name") in Linux's /proc/cpuinfo, or "" where there is none."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_vendor() -> str:
    """The CPU's vendor string ("AuthenticAMD", "GenuineIntel"; Linux's /proc/cpuinfo, else what `platform` knows,
    which on Windows includes it), or "" when unknown (an Arm CPU has no vendor_id line).

    Some kernels that compute the same function differ in speed by CPU (captioner.models.onednn and
    captioner.models.attention choose by it; docs/benchmarks-log.md, On an Intel Xeon).
    """
    return cpu_info("vendor_id") or platform.processor()


def is_amd_cpu(vendor: str | None = None) -> bool:
    """Whether `vendor` (default: this CPU's, `cpu_vendor()`) is AMD's: the CPU whose kernels' speeds set the
    non-default choices of captioner.models.onednn and captioner.models.attention."""
    return "AuthenticAMD" in (cpu_vendor() if vendor is None else vendor)
