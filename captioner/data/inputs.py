"""What the model reads of a split's images, from one of three places (`Inputs.kind`): the frozen encoder's cached
annotations (the feature cache), the images resized to the encoder's input (the image cache), or the image files."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import torch

from captioner.data.disk_cache import ImageSource
from captioner.data.features import FeatureCache
from captioner.data.image_cache import ImageCache
from captioner.data.images import ImageError

log = logging.getLogger(__name__)


class Inputs:
    """The model input of image i: its cached annotations (P,E), or its preprocessed image (3,H,W) read from the
    image cache or from its file. An image that cannot be read gives None (the batch goes on without it) and one
    warning naming the file; the images known to be unreadable are `bad`.

    Args:
        source: the split.
        transform: image -> tensor (the encoder's preprocessing), where images are read.
        features: the feature cache, built; or None.
        images: the image cache, built; or None (the files are read), where there is no feature cache.
        pin: read the cache's rows straight into page-locked memory, for a copy to CUDA that does not wait (`rows`):
            where the trainer runs on CUDA.
    """

    def __init__(
        self,
        source: ImageSource,
        transform,
        features: FeatureCache | None = None,
        images: ImageCache | None = None,
        pin: bool = False,
    ):
        self.source, self.transform, self.features, self.images, self.pin = source, transform, features, images, pin
        self.cache = features if features is not None else images  # the one that feeds the batches, if any
        self.kind = "files" if self.cache is None else self.cache.kind
        self.key = "images" if features is None else "annotations"  # the batch's key for them
        self.bad = set() if self.cache is None else set(self.cache.bad)
        self._array: np.ndarray | None = None  # the feature cache's array, memory-mapped at the first read
        self._tensor: torch.Tensor | None = None  # the same as a tensor (`_table`), made at the first pinned read

    def where(self) -> str:
        """What feeds the batches, for the line said when a loader is made."""
        if self.cache is None:
            return f"the image files ({len(self.source)} images)"
        return f"the {self.kind} ({self.cache.dir})"

    def __call__(self, index: int) -> torch.Tensor | None:
        if index in self.bad:
            return None
        if self.features is not None:
            return torch.from_numpy(np.array(self.array()[index]))  # (P,E) float16
        try:
            image = self.source.load_image(index) if self.images is None else self.images.read(index)
            return self.transform(image)
        except ImageError as err:
            log.warning("skipping %s", err)
            self.bad.add(index)
            return None

    def rows(self, indices: list[int]) -> torch.Tensor:
        """The cached annotations (B,P,E) of images `indices` (none of them bad), in one indexed read of the cache.

        With `pin`, the rows are copied by torch's threads straight into page-locked memory from torch's caching host
        allocator, which hands the blocks of earlier batches back once their copies to the GPU are done: one copy, into
        memory that is already mapped; the loader's pinning finds the batch pinned, and the copy to the GPU does not
        wait. (At the paper's sizes a batch is 51 MiB: numpy's copy into a new array, faulting its pages in, then the
        loader's copy of it into pinned memory.) Otherwise numpy copies the rows into a new array."""
        if self.pin:
            table = self._table()
            out = torch.empty((len(indices), *table.shape[1:]), dtype=table.dtype, pin_memory=True)
            return torch.index_select(table, 0, torch.as_tensor(indices, dtype=torch.long), out=out)
        return torch.from_numpy(self.array()[np.asarray(indices)])

    def array(self) -> np.ndarray:
        """The feature cache's array, memory-mapped when first read (so each loader worker maps its own view)."""
        if self._array is None:
            self._array = self.features.load()
        return self._array

    def _table(self) -> torch.Tensor:
        """The cache as a tensor over the same read-only memory map (torch warns that it could write to it: nothing
        does)."""
        if self._tensor is None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
                self._tensor = torch.from_numpy(self.array())
        return self._tensor

    def __getstate__(self) -> dict:  # a loader worker maps the file itself
        return self.__dict__ | {"_array": None, "_tensor": None}
