"""Image cache: a split's images resized once to the encoder's input, kept as JPEG in one file.

Where the feature cache cannot be used (an encoder being fine-tuned, or annotations too large for the disk: ResNet-101's
14x14x2048 are 84.7 GiB in float16 for COCO's training split), the encoder runs on images at every step, and the
loader reads, decodes and resizes each original photo at every epoch (about 3 ms for a 640x480 JPEG on one core of the
2-core machine these figures come from). The cache keeps each image at the encoder's input size, square, as JPEG of
quality 95, every image end to end in one file (`images.bin`) with their offsets (`offsets.npy`). A cached 448x448
image is decoded in about 1.3 ms and needs no resize; the file is about 100 KB an image, 10.7 GiB for COCO's training
split. Uncompressed 448x448x3 bytes would be 63.5 GiB: more than a 64 GiB disk holds beside COCO's own 19 GB of
photos.

The cached pixels are the ones the uncached path gives the model, which `Captioner.caption` uses too: each image is
resized by the preprocessing's own transform (`Preprocessing.transforms(normalize=False)`: torchvision's resize of the
image as a tensor), then JPEG-encoded. JPEG at quality 95 is what separates them, a couple of levels of 255 a pixel
(data/README.md has what it does to the annotations). With augmentation, the cached path crops the resized image and
scales the crop back up, where the uncached path crops the original photo: the same crop, at the cache's resolution
rather than the photo's (data/README.md measures the difference).

Like the feature cache (`captioner.data.disk_cache`): keyed by the split, the input size and the format, built by one
process while the others wait, published whole (its offsets last: their presence means the cache is complete), rebuilt
with a warning when damaged, and before a build, the disk space it needs is estimated from a sample of its images,
said, and checked.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from captioner.data.disk_cache import DiskCache, ImageSource
from captioner.data.images import ImageError
from captioner.models.encoder import Preprocessing

log = logging.getLogger(__name__)

QUALITY = 95  # JPEG quality of the cached images
SAMPLE = 16  # images encoded to estimate a build's size
MARGIN = 1.1  # the estimate's allowance for images larger than the sample's
# The cache's layout and pixels; a new one builds a new cache. 2: images resized as the uncached path resizes them
# (format 1 resized them with PIL's filter, other pixels than the model sees when it captions a file).
FORMAT = 2


class _Encoded(Dataset):
    """Image i of the split, resized as the uncached path resizes it (`resize`) and encoded as JPEG (bytes; b"" for
    an unreadable image)."""

    def __init__(self, source: ImageSource, preprocessing: Preprocessing, quiet: bool = False):
        self.source, self.quiet = source, quiet
        self.transform = preprocessing.transforms(normalize=False)

    def __len__(self) -> int:
        return len(self.source)

    def resize(self, image: Image.Image) -> np.ndarray:
        """The image's pixels (S,S,3) uint8, as the model gets them from its file."""
        return self.transform(image).permute(1, 2, 0).numpy()

    def __getitem__(self, index: int) -> bytes:
        try:
            pixels = self.resize(self.source.load_image(index))
        except ImageError as err:
            if not self.quiet:
                log.warning("skipping %s", err)
            return b""
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, "JPEG", quality=QUALITY)
        return buffer.getvalue()


class ImageCache(DiskCache):
    """The images of one dataset split at one input size.

    Args:
        root: folder holding the caches (one subfolder per key).
        preprocessing: the encoder's (its size and resampling filter decide the cached images).
        source: the dataset split.
    """

    kind = "image cache"
    estimated = True

    def __init__(self, root: str | Path, preprocessing: Preprocessing, source: ImageSource):
        self.preprocessing, self.source = preprocessing, source
        p = preprocessing
        key = hashlib.sha256(f"{FORMAT}|{p.size}|{p.interpolation}|{QUALITY}|{source.identity}".encode()).hexdigest()
        super().__init__(Path(root) / f"{source.identity}-{p.size}px-{key[:16]}", "offsets.npy")
        self.data, self.offsets_path = self.dir / "images.bin", self.marker
        self._bytes: np.ndarray | None = None  # images.bin, memory-mapped when first read (in each loader worker)
        self._offsets: np.ndarray | None = None

    def damage(self) -> str | None:
        """Offsets that do not describe the data file: a truncated or replaced file."""
        try:
            offsets = np.load(self.offsets_path)
            length = self.data.stat().st_size
        except (OSError, ValueError) as err:
            return f"damaged ({err})"
        if offsets.shape != (len(self.source) + 1,) or offsets.dtype != np.int64:
            held = f"{offsets.shape} {offsets.dtype}"
            return f"damaged ({self.offsets_path.name} holds {held} for {len(self.source)} images)"
        if offsets[0] != 0 or (np.diff(offsets) < 0).any() or offsets[-1] != length:
            return f"damaged ({self.data.name} is {length} bytes; its offsets say {int(offsets[-1])})"
        return None

    def estimate(self) -> int:
        """The bytes a build will write: the mean size of up to `SAMPLE` of its images, spread over the split, times
        the number of images, with a margin."""
        encoded = _Encoded(self.source, self.preprocessing, quiet=True)  # the build says which cannot be read
        picks = np.unique(np.linspace(0, len(encoded) - 1, min(len(encoded), SAMPLE)).astype(int))
        sizes = [len(encoded[int(i)]) for i in picks]
        return int(MARGIN * np.mean(sizes) * len(encoded)) if sizes else 0

    def needed(self) -> int:
        return self.estimate()

    def describe(self) -> str:
        p = self.preprocessing
        return f"{self.source.identity}: {len(self.source)} images at {p.size}x{p.size}, JPEG quality {QUALITY}"

    def write(self, num_workers: int = 0):
        """Resize and encode every image (in `num_workers` loader workers) into the data file, and its offsets. An
        unreadable image is said in one warning, and kept as an empty entry."""
        loader = DataLoader(
            _Encoded(self.source, self.preprocessing),
            batch_size=16,
            num_workers=num_workers,
            collate_fn=list,
            generator=torch.Generator(),  # not the global one: training's draws must not depend on a build
        )
        data, offsets_file = self.temporary("images.bin"), self.temporary("offsets.npy")
        offsets, bad = [0], []
        with open(data, "wb") as file:
            progress = tqdm(loader, desc=f"caching {self.source.identity} images", unit="batch", disable=None)
            for batch in progress:
                for encoded in batch:
                    if not encoded:
                        bad.append(len(offsets) - 1)
                    file.write(encoded)
                    offsets.append(offsets[-1] + len(encoded))
            file.flush()
            os.fsync(file.fileno())
        with open(offsets_file, "wb") as file:
            np.save(file, np.array(offsets, dtype=np.int64))
            file.flush()
            os.fsync(file.fileno())
        meta = {"source": self.source.identity, "size": self.preprocessing.size, "quality": QUALITY, "format": FORMAT}
        return meta, bad, [(data, self.data), (offsets_file, self.offsets_path)]

    def read(self, index: int) -> Image.Image:
        """Image `index` (S,S, RGB), decoded from the cache; ImageError (naming the cache's file) when its bytes are
        not a JPEG any more."""
        if self._offsets is None:
            self._offsets = np.load(self.offsets_path)
            self._bytes = np.memmap(self.data, mode="r") if self._offsets[-1] else np.empty(0, np.uint8)
        start, end = int(self._offsets[index]), int(self._offsets[index + 1])
        try:
            with Image.open(io.BytesIO(self._bytes[start:end].tobytes())) as image:
                return image.convert("RGB")
        except (OSError, ValueError) as err:  # PIL's UnidentifiedImageError is an OSError
            raise ImageError(f"{self.data} (image {index}): not a JPEG any more ({err})") from None

    def __getstate__(self) -> dict:  # a loader worker maps the file itself
        return self.__dict__ | {"_bytes": None, "_offsets": None}
