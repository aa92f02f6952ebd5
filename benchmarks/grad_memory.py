"""Memory of a beam search by gradient tracking: what `torch.inference_mode` (how the library decodes in float32)
saves over `torch.no_grad` and over autograd left on.

    python benchmarks/grad_memory.py

The memory side of decode.py's gradient-tracking table: beam 3 at batch 64 on precomputed annotations, at the shapes
and the paper's sizes, with decode.py's random decoder and MAX_LEN steps, the decoder's matmuls through torch's own
kernels in every mode (oneDNN off), so that only gradient tracking differs. "autograd on" is a model in eval() mode
called without either context, as a script that forgets them does: every step's graph is built and kept for as long
as the search's result lives, whose scores and attention weights hold it.

Each search runs in a new (spawned) process, PROCESSES per configuration, the configurations taking turns; the table
gives the median process and the range. Processes forked from one parent would share its heap's layout, and so its
malloc's figure; spawned ones vary as scripts do. The figure is how far the process's resident memory rose during
the search above where it stood just before (VmHWM, reset through /proc/self/clear_refs, against VmRSS). A new
process's first search also makes its one-time allocations (the scorer's workspace, the output buffers, torch's
thread pool), the same in every mode.

glibc's adaptive thresholds alone move the figure by tens of MiB from one process to another, so it is measured with
glibc's malloc in three settings: as it comes (a Python user's), as the `captioner` command sets it
(captioner.runtime.keep_freed_memory), and with every block above 64 KiB taken from mmap and given back when freed,
which brings the process's memory closest to what its tensors hold at each moment. Linux with glibc only (elsewhere
it stops with one line saying why). The RESULT line has the medians under the `captioner` setting, and no_grad
over inference mode with every block mmapped.
"""

from __future__ import annotations

import multiprocessing
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor

import torch
from common import SIZES, machine, result, table
from decode import GRAD_MODES, INFERENCE, MAX_LEN, SPECIAL, random_decoder

from captioner import runtime
from captioner.decoding import beam_search
from captioner.models import onednn

PROCESSES = 2  # new processes per configuration
BATCH, BEAM = 64, 3
KEPT = "keep_freed_memory (as `captioner` runs)"
MMAPPED = "every block above 64 KiB mmapped"
MALLOCS = ("glibc's default", KEPT, MMAPPED)
KEYS = dict(zip(GRAD_MODES, ("inference_mode", "no_grad", "autograd"), strict=True))


def status_mib(field: str) -> float:
    """A field of /proc/self/status in MiB: VmRSS (resident memory now) or VmHWM (its peak)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024  # kB
    raise OSError(f"/proc/self/status has no {field}")


def set_malloc(malloc: str) -> None:
    """Set glibc's malloc as MALLOCS names it, in this process; OSError where that cannot be done."""
    if malloc == KEPT and not runtime.keep_freed_memory():
        raise OSError("captioner.runtime.keep_freed_memory did not apply (not glibc, or CAPTIONER_KEEP_FREED_MEMORY=0)")
    if malloc == MMAPPED:
        mallopt = runtime.glibc_mallopt()
        if mallopt is None:
            raise OSError("no mallopt: not glibc")
        if not mallopt(runtime.M_MMAP_THRESHOLD, 64 * 2**10):  # also turns off glibc's adaptive threshold
            raise OSError("glibc refused an mmap threshold of 64 KiB")


def search_memory(mode: str, sizes: str, malloc: str = MALLOCS[0]) -> float:
    """For a new process: MiB of resident memory one search rose to above where it stood before it."""
    set_malloc(malloc)
    P, E = SIZES[sizes][:2]
    decoder = random_decoder(sizes)
    annotations = torch.randn(BATCH, P, E)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # the peak (VmHWM) starts again from the current resident memory
    before = status_mib("VmRSS")
    with onednn.use(False), GRAD_MODES[mode]():
        beam_search(decoder, annotations, beam_size=BEAM, max_len=MAX_LEN, **SPECIAL)
    return status_mib("VmHWM") - before


def measure(processes: int = PROCESSES) -> dict[tuple[str, str, str], list[float]]:
    """(sizes, malloc, mode) -> the MiB of each of `processes` new processes; the configurations take turns."""
    spawn = multiprocessing.get_context("spawn")
    peaks = {(sizes, malloc, mode): [] for sizes in SIZES for malloc in MALLOCS for mode in GRAD_MODES}
    for _ in range(processes):
        for sizes, malloc, mode in peaks:
            with ProcessPoolExecutor(1, mp_context=spawn) as new:
                peaks[sizes, malloc, mode].append(new.submit(search_memory, mode, sizes, malloc).result())
    return peaks


def main() -> None:
    if not sys.platform.startswith("linux"):
        raise SystemExit(f"grad_memory.py reads Linux's /proc/self; this is {sys.platform}")
    try:
        peaks = measure()
    except OSError as error:
        raise SystemExit(f"grad_memory.py: {error}") from None
    median = {key: statistics.median(values) for key, values in peaks.items()}
    rows = [
        {
            "sizes": sizes,
            "malloc": malloc,
            "gradient tracking": mode,
            "peak rise, MiB (median process)": f"{median[sizes, malloc, mode]:.0f}",
            "range": f"{min(values):.0f}–{max(values):.0f}",
            "over inference_mode": f"{median[sizes, malloc, mode] / median[sizes, malloc, INFERENCE]:.2f}x",
        }
        for (sizes, malloc, mode), values in peaks.items()
    ]
    print(f"Beam {BEAM}, batch {BATCH}, {MAX_LEN} steps, {PROCESSES} new processes per row; {machine()}\n")
    print(table(rows))
    kept = {sizes: {KEYS[mode]: median[sizes, KEPT, mode] for mode in GRAD_MODES} for sizes in SIZES}
    print(
        result(
            **{f"{sizes}_peak_mib_{key}": f"{mib:.0f}" for sizes in SIZES for key, mib in kept[sizes].items()},
            **{
                f"{sizes}_autograd_over_inference_mode": f"{mib['autograd'] / mib['inference_mode']:.1f}"
                for sizes, mib in kept.items()
            },
            **{
                f"{sizes}_mmapped_no_grad_over_inference_mode": (
                    f"{median[sizes, MMAPPED, 'no_grad'] / median[sizes, MMAPPED, INFERENCE]:.2f}"
                )
                for sizes in SIZES
            },
        )
    )


if __name__ == "__main__":
    main()
