"""Frozen-encoder feature cache.

With a frozen encoder the annotations of an image never change, so they are computed once and stored as one
memory-mapped array (N,P,E). Later epochs, and later runs, read the array instead of running the CNN. The array is
float16, half the disk of float32, unless some annotation is beyond float16's range (65,504: an untrained ResNet's
reach 10^5): then it is float32, and a log line says so. A non-finite annotation is never stored.

The cache key covers everything the annotations depend on: the encoder's weights, its preprocessing and grid, and
the exact dataset split. Changing any of them builds a new cache next to the old one. Like the image cache, it is
built by one process at a time, published whole, checked for damage and rebuilt with a warning, and left out with a
warning when it cannot be written (`captioner.data.disk_cache`); the datamodule then gives images instead.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import hashlib
import json
import logging
import math
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from captioner.data.disk_cache import DiskCache, ImageSource
from captioner.data.images import ImageError
from captioner.errors import CaptionerError
from captioner.models.encoder import Encoder

log = logging.getLogger(__name__)

FLOAT16_MAX = float(np.finfo(np.float16).max)  # 65,504: a larger annotation would be stored as inf
CHECKED_ROWS = 64  # rows of an existing cache that `FeatureCache.problem` reads to look for non-finite values


class _Images(Dataset):
    def __init__(self, source: ImageSource, transform):
        self.source, self.transform = source, transform

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> tuple[torch.Tensor | None, bool]:
        try:
            return self.transform(self.source.load_image(index)), True
        except ImageError as err:
            log.warning("skipping %s", err)
            return None, False


def _stack(items: list[tuple[torch.Tensor | None, bool]]) -> tuple[torch.Tensor | None, torch.Tensor]:
    ok = torch.tensor([good for _, good in items])
    images = [image for image, good in items if good]
    return (torch.stack(images) if images else None), ok


def reserve(path: Path) -> None:
    """Allocate the disk blocks of the file at `path` (its current size), so that writing through a memory map
    cannot find the disk full; where the OS or the file system cannot (posix_fallocate missing or unsupported),
    nothing is done."""
    if not hasattr(os, "posix_fallocate"):  # macOS, Windows
        return
    with open(path, "r+b") as file:
        try:
            os.posix_fallocate(file.fileno(), 0, os.fstat(file.fileno()).st_size)
        except OSError as err:
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # ENOSPC and the like are real
                raise


class FeatureCache(DiskCache):
    """The cached annotations of one dataset split under one encoder: `annotations.npy` (N,P,E), memory-mapped, and
    meta.json (its type, the unreadable images). Built, checked and published as every disk cache is
    (`captioner.data.disk_cache`); the array is its marker, put in place last.

    Args:
        root: folder holding the caches (one subfolder per key).
        encoder: the frozen encoder.
        source: the dataset split.
    """

    kind = "feature cache"

    def __init__(self, root: str | Path, encoder: Encoder, source: ImageSource):
        self.encoder, self.source = encoder, source
        key = hashlib.sha256(f"{encoder.annotation_fingerprint()}|{source.identity}".encode()).hexdigest()[:16]
        super().__init__(Path(root) / f"{source.identity}-{encoder.name}-{key}", "annotations.npy")
        self.path = self.marker

    @property
    def exists(self) -> bool:
        return self.path.exists()

    def damage(self) -> str | None:
        """A truncated or corrupt array, or one of another shape or type than meta.json and the encoder say, or
        holding non-finite values (an older float16 cache of too-large annotations)."""
        expected = (len(self.source), self.encoder.num_pixels, self.encoder.out_dim)
        try:
            array = self.load()  # reads the header and maps the data: a truncated file fails here
        except (OSError, ValueError) as err:
            return f"damaged ({self.path.name}: {err})"
        try:
            dtype = self.dtype()
        except (OSError, ValueError) as err:
            return f"damaged ({self.meta.name}: {err})"
        if array.shape != expected or array.dtype != dtype:
            return f"damaged ({self.path.name} is {array.dtype} of shape {array.shape}, not {dtype} {expected})"
        rows = np.unique(np.linspace(0, len(array) - 1, min(len(array), CHECKED_ROWS)).astype(int))
        if len(rows) and not np.isfinite(array[rows]).all():
            return f"damaged ({self.path.name} holds non-finite values)"
        return None

    def shape(self) -> tuple[int, int, int]:
        return len(self.source), self.encoder.num_pixels, self.encoder.out_dim

    def needed(self) -> int:
        return np.dtype(np.float16).itemsize * math.prod(self.shape())

    def describe(self) -> str:
        N, P, E = self.shape()
        return f"{self.source.identity}: {N} images' {P}x{E} annotations from {self.encoder.name}"

    def write(self, batch_size: int = 32, num_workers: int = 0, device: torch.device | str = "cpu"):
        """Encode every image once into the (N,P,E) array, float16 (float32 if some value is beyond float16's
        range). The array is memory-mapped, and a write that found the disk full would kill the process with SIGBUS,
        so its space is reserved first where the OS allows. Raises CaptionerError when the encoder gives a non-finite
        value."""
        array, bad = self._encode_into(self._open_partial(np.float16), batch_size, num_workers, device)
        meta = {"source": self.source.identity, "encoder": self.encoder.name, "shape": list(self.shape())}
        meta["dtype"] = str(array.dtype)
        partial = Path(array.filename)
        del array
        return meta, bad, [(partial, self.path)]

    def _open_partial(self, dtype: type) -> np.memmap:
        """A new temporary array file, its disk space checked and reserved first (see `write`)."""
        self.check_space(np.dtype(dtype).itemsize * math.prod(self.shape()))
        path = self.temporary(f"annotations.{np.dtype(dtype).name}")
        array = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=self.shape())
        reserve(path)
        return array

    def _widen(self, array: np.memmap, done: int) -> np.memmap:
        """The float32 copy of a float16 array whose first `done` rows are written, in a new temporary file."""
        wide = self._open_partial(np.float32)
        for start in range(0, done, 1024):  # a piece at a time: the rows written so far may not fit in memory
            wide[start : min(done, start + 1024)] = array[start : min(done, start + 1024)]
        narrow = Path(array.filename)
        del array
        with contextlib.suppress(OSError):
            narrow.unlink()
        return wide

    def _encode_into(
        self, array: np.memmap, batch_size: int, num_workers: int, device: torch.device | str
    ) -> tuple[np.memmap, list[int]]:
        """Fill the memory-mapped array with the annotations of every image, widening it to float32 (a new array) at
        the first value beyond float16's range. Returns the array written, flushed, and the indices of the images
        that could not be read, whose rows stay zero."""
        loader = DataLoader(
            _Images(self.source, self.encoder.preprocessing.transforms()),
            batch_size=batch_size,
            num_workers=num_workers,
            collate_fn=_stack,
            # Its own generator: iterating a DataLoader draws a seed from the one it is given, by default the global
            # one, and the shuffling and dropout of the training that follows must not depend on whether the cache
            # had to be built first.
            generator=torch.Generator(),
        )
        # A copy with its BatchNorms folded into its convolutions: the same annotations up to float rounding, faster
        encoder = copy.deepcopy(self.encoder).eval().fold_batchnorm().to(device)
        start, bad = 0, []
        log.info("caching %s features of %d images in %s", self.source.identity, len(self.source), self.dir)
        progress = tqdm(loader, desc=f"caching {self.source.identity}", unit="batch", disable=None)  # a TTY only
        with torch.inference_mode():
            for images, ok in progress:
                rows = np.arange(start, start + len(ok))
                bad += rows[~ok.numpy()].tolist()  # unreadable images: their rows stay zero, marked bad
                if images is not None:
                    annotations = encoder(images.to(device)).float().cpu()  # (B',P,E)
                    if not torch.isfinite(annotations).all():
                        raise CaptionerError(
                            f"{self.encoder.name}: the encoder gives non-finite annotations for images {rows[0]}-"
                            f"{rows[-1]} of {self.source.identity}; check its weights (pretrained, fine-tuned)"
                        )
                    largest = float(annotations.abs().max())
                    if array.dtype == np.float16 and largest > FLOAT16_MAX:
                        log.warning(
                            "%s: %s annotations reach %.3g, beyond float16's range: the cache is float32 (twice the "
                            "disk space)",
                            self.dir,
                            self.encoder.name,
                            largest,
                        )
                        array = self._widen(array, start)
                    array[rows[ok.numpy()]] = annotations.numpy().astype(array.dtype)
                start += len(ok)
        array.flush()
        return array, bad

    def dtype(self) -> np.dtype:
        """The array's type as meta.json records it (float16 for caches written before it did)."""
        meta = json.loads(self.meta.read_text()) if self.meta.exists() else {}
        dtype = meta.get("dtype", "float16") if isinstance(meta, dict) else None
        if dtype not in ("float16", "float32"):
            raise ValueError(f'"dtype" is {dtype!r}, not float16 or float32')
        return np.dtype(dtype)

    def load(self) -> np.ndarray:
        """The cached (N,P,E) array (float16, or float32 for large annotations), memory-mapped read-only."""
        return np.load(self.path, mmap_mode="r")
