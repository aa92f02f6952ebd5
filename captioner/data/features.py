"""Frozen-encoder feature cache.

With a frozen encoder the annotations of an image never change, so they are computed once and stored as one
memory-mapped array (N,P,E). Later epochs, and later runs, read the array instead of running the CNN. The array is
float16, half the disk of float32, unless some annotation is beyond float16's range (65,504: an untrained ResNet's
reach 10^5): then it is float32, and a log line says so. A non-finite annotation is never stored.

The cache key covers everything the annotations depend on: the encoder's weights, its preprocessing and grid, and
the exact dataset split. Changing any of them builds a new cache next to the old one. A cache that is there but
damaged (`FeatureCache.problem`) is built again, with a warning naming its file; one that cannot be written (a full
disk) is left out, with a warning, and the datamodule gives images instead.
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
import shutil
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from captioner.data.images import ImageError
from captioner.errors import CaptionerError
from captioner.files import build_lock, write_text_atomically
from captioner.models.encoder import Encoder

log = logging.getLogger(__name__)

FLOAT16_MAX = float(np.finfo(np.float16).max)  # 65,504: a larger annotation would be stored as inf
CHECKED_ROWS = 64  # rows of an existing cache that `FeatureCache.problem` reads to look for non-finite values


class ImageSource(Protocol):
    """What the cache (and the datamodules) need of a dataset split."""

    identity: str

    def __len__(self) -> int: ...

    def load_image(self, index: int) -> Image.Image: ...


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


def size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


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


class FeatureCache:
    """The cached annotations of one dataset split under one encoder.

    Args:
        root: folder holding the caches (one subfolder per key).
        encoder: the frozen encoder.
        source: the dataset split.
    """

    def __init__(self, root: str | Path, encoder: Encoder, source: ImageSource):
        self.encoder, self.source = encoder, source
        key = hashlib.sha256(f"{encoder.annotation_fingerprint()}|{source.identity}".encode()).hexdigest()[:16]
        self.dir = Path(root) / f"{source.identity}-{encoder.name}-{key}"
        self.path = self.dir / "annotations.npy"
        self.meta = self.dir / "meta.json"
        self._partial: list[Path] = []  # the temporary array files of a build, the one being written last

    @property
    def exists(self) -> bool:
        return self.path.exists()

    def problem(self) -> str | None:
        """Why the cache on disk cannot be used, or None when it can: missing, or damaged (a truncated or corrupt
        array or meta.json, as a full disk or a broken copy leaves them, or an array of the wrong shape)."""
        if not self.exists:
            return "missing"
        expected = (len(self.source), self.encoder.num_pixels, self.encoder.out_dim)
        try:
            array = self.load()  # reads the header and maps the data: a truncated file fails here
        except (OSError, ValueError) as err:
            return f"damaged ({self.path.name}: {err})"
        try:
            self.bad_indices()
            dtype = self.dtype()
        except (OSError, ValueError) as err:  # json's JSONDecodeError is a ValueError
            return f"damaged ({self.meta.name}: {err})"
        if array.shape != expected or array.dtype != dtype:
            return f"damaged ({self.path.name} is {array.dtype} of shape {array.shape}, not {dtype} {expected})"
        # A sample of rows, spread over the file: an older float16 cache of too-large annotations holds inf.
        rows = np.unique(np.linspace(0, len(array) - 1, min(len(array), CHECKED_ROWS)).astype(int))
        if len(rows) and not np.isfinite(array[rows]).all():
            return f"damaged ({self.path.name} holds non-finite values)"
        return None

    def ensure(self, batch_size: int = 32, num_workers: int = 0, device: torch.device | str = "cpu") -> None:
        """Build the cache unless a usable one is there (see `problem`; a damaged one is named in a warning).

        Holds the cache's lock file while it looks and builds: of two processes that need the same cache, one builds
        it and the other waits, then finds it built. Raises OSError when it cannot be written (see `build`).
        """
        self.dir.mkdir(parents=True, exist_ok=True)  # first, so that a warning names the folder that cannot be made
        with build_lock(self.dir):
            problem = self.problem()
            if problem is None:
                return
            if problem != "missing":
                log.warning("%s: feature cache %s; building it again", self.dir, problem)
            self.build(batch_size, num_workers, device)

    def build(self, batch_size: int = 32, num_workers: int = 0, device: torch.device | str = "cpu") -> None:
        """Encode every image once and write the (N,P,E) array, float16 (float32 if some value is beyond float16's
        range); written to a temporary file first, so an interrupted build never leaves a cache that looks complete.

        Raises OSError, before encoding anything, when the cache cannot be written: its folder cannot be made, or the
        disk has too little space for the whole array (the array is memory-mapped, and a write that found the disk
        full would kill the process with SIGBUS, so its space is reserved first where the OS allows). Raises
        CaptionerError when the encoder gives a non-finite value. A build that fails removes its temporary files.
        """
        shape = (len(self.source), self.encoder.num_pixels, self.encoder.out_dim)
        self._partial = []
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            array, bad = self._encode_into(self._open_partial(shape, np.float16), batch_size, num_workers, device)
            dtype = array.dtype
            del array
            meta = {
                "source": self.source.identity,
                "encoder": self.encoder.name,
                "shape": list(shape),
                "dtype": str(dtype),
                "bad": bad,
            }
            write_text_atomically(self.meta, json.dumps(meta, indent=1))
            os.replace(self._partial[-1], self.path)  # last: the array's presence means the cache is complete
        finally:
            for path in self._partial:
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)

    def _open_partial(self, shape: tuple[int, ...], dtype: type) -> np.memmap:
        """A new temporary array file of `shape`, its disk space checked and reserved first (see `build`)."""
        tmp = self.dir / f"annotations.{os.getpid()}.{np.dtype(dtype).name}.tmp.npy"
        needed, free = np.dtype(dtype).itemsize * math.prod(shape), shutil.disk_usage(self.dir).free
        if needed > free:
            raise OSError(errno.ENOSPC, f"no space left: it needs {size(needed)}, {size(free)} are free", str(self.dir))
        self._partial.append(tmp)
        array = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=shape)
        reserve(tmp)
        return array

    def _widen(self, array: np.memmap, done: int) -> np.memmap:
        """The float32 copy of a float16 array whose first `done` rows are written, in a new temporary file."""
        wide = self._open_partial(array.shape, np.float32)
        for start in range(0, done, 1024):  # a piece at a time: the rows written so far may not fit in memory
            wide[start : min(done, start + 1024)] = array[start : min(done, start + 1024)]
        del array
        with contextlib.suppress(OSError):
            self._partial.pop(0).unlink()
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

    def bad_indices(self) -> set[int]:
        """Images that could not be read when the cache was built. Raises ValueError when meta.json is not JSON, or
        not an object whose "bad" is a list of indices."""
        if not self.meta.exists():
            return set()
        meta = json.loads(self.meta.read_text())
        bad = meta.get("bad", []) if isinstance(meta, dict) else None
        if not isinstance(bad, list) or not all(isinstance(index, int) for index in bad):
            raise ValueError('not an object whose "bad" is a list of image indices')
        return set(bad)

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
