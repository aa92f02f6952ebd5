"""The model's input from a photo without torch: the resize that torchvision's `v2.Resize(antialias=True)` does to a
uint8 image on a CPU (the uncached path of `captioner caption`, `Captioner.caption` and training), in numpy.

torchvision resizes uint8 images natively on CPUs with AVX2 or AVX512 (bilinear, and bicubic everywhere), with
Pillow-SIMD's separable resampling: for each output pixel, the input pixels under the filter (a triangle for
bilinear, Keys' cubic with a = -0.5 for bicubic), widened by the scale when it shrinks the image, their weights
normalised, then held as 16-bit integers of a precision chosen so that the largest weight fits; one pass along the
width, then one along the height, each rounded to uint8. This module does the same integer arithmetic: the same
pixels, to the last bit, as torchvision on this project's machines (tests/test_onnx.py checks photos of several
sizes, down and up, against torch 2.14; torch 2.7's bilinear kernel, the oldest pyproject.toml allows, rounds a few
pixels a level apart). On a CPU without AVX2, torchvision's bilinear resize goes through floats instead, and may
differ by a level here and there.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


def _bicubic(x: np.ndarray, a: float = -0.5) -> np.ndarray:
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def _bilinear(x: np.ndarray) -> np.ndarray:
    return np.maximum(1 - np.abs(x), 0.0)


FILTERS = {"bicubic": (_bicubic, 2.0), "bilinear": (_bilinear, 1.0)}  # filter, support


@lru_cache(maxsize=64)
def weights(in_size: int, out_size: int, mode: str) -> tuple[np.ndarray, np.ndarray, int]:
    """One pass's taps: for each output pixel the (out_size, taps) indices of the input pixels under its filter and
    their integer weights (a tap beyond the filter weighs 0), and the weights' precision (bits)."""
    kernel, support = FILTERS[mode]
    scale = in_size / out_size
    widen = max(scale, 1.0)  # shrinking: the filter spans more input pixels
    support *= widen
    rows = []
    for x in range(out_size):
        center = (x + 0.5) * scale
        first = max(int(center - support + 0.5), 0)
        last = min(int(center + support + 0.5), in_size)
        w = kernel((np.arange(first, last) - center + 0.5) / widen)
        total = w.sum()
        rows.append((first, w / total if total != 0 else w))
    largest = max(float(np.max(w)) for _, w in rows)
    precision = 0  # as many bits as keep the largest weight within 16-bit integers
    while precision < 22 and int(0.5 + largest * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    taps = max(len(w) for _, w in rows)
    index = np.zeros((out_size, taps), dtype=np.intp)
    integer = np.zeros((out_size, taps), dtype=np.int32)
    for x, (first, w) in enumerate(rows):
        scaled = w * (1 << precision)
        index[x, : len(w)] = np.arange(first, first + len(w))
        integer[x, : len(w)] = np.trunc(np.where(scaled < 0, scaled - 0.5, scaled + 0.5))
    return index, integer, precision


def _pass(pixels: np.ndarray, index: np.ndarray, integer: np.ndarray, precision: int, axis: int) -> np.ndarray:
    """One pass along `axis` (0: the height, 1: the width) of an (H, W, 3) image, in 32-bit integers as torchvision's
    kernel sums (the weights' magnitudes add up to at most about 1.2 * 2**precision <= 1.2 * 2**22, so a sum of
    pixels of 255 stays within 2**31): each tap's pixels gathered as they are (uint8), then widened, weighted and
    added, so that the cost is the taps', not the whole row's, and the photo itself is never copied wider: beside it,
    a pass holds its output's sum (4 bytes a value) and one tap's gathered pixels (5), each the output's size."""
    shape = (-1, 1, 1) if axis == 0 else (1, -1, 1)
    total = None
    for tap in range(index.shape[1]):
        taken = np.take(pixels, index[:, tap], axis=axis).astype(np.int32)  # (out along axis, the rest) widened
        taken *= integer[:, tap].reshape(shape)
        if total is None:
            total = taken
            total += 1 << (precision - 1)  # the kernel's rounding
        else:
            total += taken
    return np.clip(total >> precision, 0, 255).astype(np.uint8)  # >>: floor, as the kernel's shift of signed sums


def resize(pixels: np.ndarray, size: int, mode: str) -> np.ndarray:
    """An image (H,W,3) uint8 -> (size,size,3) uint8, squashed to the square as the model's preprocessing does."""
    if mode not in FILTERS:
        raise ValueError(f"no resampling filter {mode!r} here; one of {', '.join(FILTERS)}")
    height, width = pixels.shape[:2]
    if width != size:
        pixels = _pass(pixels, *weights(width, size, mode), axis=1)
    if height != size:
        pixels = _pass(pixels, *weights(height, size, mode), axis=0)
    return pixels
