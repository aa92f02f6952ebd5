"""Image cache: a split's images resized once to the encoder's input, kept as JPEG in one file.

Where the feature cache cannot be used (an encoder being fine-tuned, or annotations too large for the disk: ResNet-101's
14x14x2048 are 84.7 GiB in float16 for COCO's training split), the encoder runs on images at every step, and the
loader reads, decodes and resizes each original photo at every epoch (about 3 ms for a 640x480 JPEG on one core of the
2-core machine these figures come from). The cache keeps each image at the encoder's input size, square, as JPEG of
quality 95, every image end to end in one file (`images.bin`) with their offsets (`offsets.npy`). A cached 448x448
image is decoded in about 1.3 ms and needs no resize; the file is about 100 KB an image, 10.7 GiB for COCO's training
split. Uncompressed 448x448x3 bytes would be 63.5 GiB: more than a 64 GiB disk holds beside COCO's own 19 GB of
photos. Quality 95 changes a pixel by about 2.3 of 255 on average (docs/benchmarks.md, `coco_scale.py`); that, and
only that, separates a run from the cache from one from the original files.

Training on it is otherwise the same: the preprocessing's resize finds the image at its size and leaves it as it is,
and augmentation crops and jitters the cached image. Like the feature cache: keyed by the split and the input size,
written under temporary names (its offsets last: their presence means the cache is complete), rebuilt with a warning
when damaged, built by one process while the others wait, and before a build, the disk space it needs is estimated
from a sample of its images, said, and checked.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2
from tqdm import tqdm

from captioner.data.features import ImageSource, size
from captioner.data.images import ImageError
from captioner.files import build_lock, replace_atomically, write_text_atomically
from captioner.models.encoder import Preprocessing

log = logging.getLogger(__name__)

QUALITY = 95  # JPEG quality of the cached images
SAMPLE = 16  # images encoded to estimate a build's size
MARGIN = 1.1  # the estimate's allowance for images larger than the sample's
FORMAT = 1  # the cache's layout; a new one builds a new cache


class _Encoded(Dataset):
    """Image i of the split, resized to the input size and encoded as JPEG (bytes; b"" for an unreadable image)."""

    def __init__(self, source: ImageSource, preprocessing: Preprocessing, quiet: bool = False):
        self.source, self.quiet = source, quiet
        mode = v2.InterpolationMode(preprocessing.interpolation)
        self.resize = v2.Resize((preprocessing.size, preprocessing.size), interpolation=mode, antialias=True)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> bytes:
        try:
            image = self.resize(self.source.load_image(index))
        except ImageError as err:
            if not self.quiet:
                log.warning("skipping %s", err)
            return b""
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=QUALITY)
        return buffer.getvalue()


class ImageCache:
    """The images of one dataset split at one input size.

    Args:
        root: folder holding the caches (one subfolder per key).
        preprocessing: the encoder's (its size and resampling filter decide the cached images).
        source: the dataset split.
    """

    def __init__(self, root: str | Path, preprocessing: Preprocessing, source: ImageSource):
        self.preprocessing, self.source = preprocessing, source
        p = preprocessing
        key = hashlib.sha256(f"{FORMAT}|{p.size}|{p.interpolation}|{QUALITY}|{source.identity}".encode()).hexdigest()
        self.dir = Path(root) / f"{source.identity}-{p.size}px-{key[:16]}"
        self.data, self.offsets_path, self.meta = (
            self.dir / "images.bin",
            self.dir / "offsets.npy",
            self.dir / "meta.json",
        )
        self._bytes: np.ndarray | None = None  # images.bin, memory-mapped when first read (in each loader worker)
        self._offsets: np.ndarray | None = None
        self.bad: set[int] = set()

    def problem(self) -> str | None:
        """Why the cache on disk cannot be used, or None: missing, or damaged (offsets that do not describe the data
        file: a truncated or replaced file; a meta.json that is not what it wrote)."""
        if not self.offsets_path.exists():
            return "missing"
        try:
            offsets = np.load(self.offsets_path)
            length = self.data.stat().st_size
            meta = json.loads(self.meta.read_text())
        except (OSError, ValueError) as err:  # json's JSONDecodeError is a ValueError
            return f"damaged ({err})"
        if offsets.shape != (len(self.source) + 1,) or offsets.dtype != np.int64:
            held = f"{offsets.shape} {offsets.dtype}"
            return f"damaged ({self.offsets_path.name} holds {held} for {len(self.source)} images)"
        if offsets[0] != 0 or (np.diff(offsets) < 0).any() or offsets[-1] != length:
            return f"damaged ({self.data.name} is {length} bytes; its offsets say {int(offsets[-1])})"
        bad = meta.get("bad") if isinstance(meta, dict) else None
        if not isinstance(bad, list) or not all(isinstance(index, int) for index in bad):
            return f'damaged ({self.meta.name} is not an object whose "bad" is a list of image indices)'
        return None

    def estimate(self) -> int:
        """The bytes a build will write: the mean size of up to `SAMPLE` of its images, spread over the split, times
        the number of images, with a margin."""
        encoded = _Encoded(self.source, self.preprocessing, quiet=True)  # the build says which cannot be read
        picks = np.unique(np.linspace(0, len(encoded) - 1, min(len(encoded), SAMPLE)).astype(int))
        sizes = [len(encoded[int(i)]) for i in picks]
        return int(MARGIN * np.mean(sizes) * len(encoded)) if sizes else 0

    def ensure(self, num_workers: int = 0) -> None:
        """Build the cache unless a usable one is there (a damaged one is named in a warning and built again), holding
        its lock file: of two processes that need it, one builds and the other then reads it. Raises OSError when it
        cannot be written: its folder, or too little disk for its estimated size (said before anything is written)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with build_lock(self.dir):
            problem = self.problem()
            if problem is None:
                self.bad = set(json.loads(self.meta.read_text())["bad"])
                return
            if problem != "missing":
                log.warning("%s: image cache %s; building it again", self.dir, problem)
            self.build(num_workers)

    def build(self, num_workers: int = 0) -> None:
        """Resize and encode every image (in `num_workers` loader workers) into a temporary data file, then write the
        meta and the offsets (last). An unreadable image is said in one warning, and kept as an empty entry."""
        needed, free = self.estimate(), shutil.disk_usage(self.dir).free
        p = self.preprocessing
        log.info(
            "image cache of %s: %d images at %dx%d, JPEG quality %d, about %s; %s free on its disk (%s)",
            self.source.identity,
            len(self.source),
            p.size,
            p.size,
            QUALITY,
            size(needed),
            size(free),
            self.dir,
        )
        if needed > free:
            raise OSError(
                errno.ENOSPC, f"no space left: it needs about {size(needed)}, {size(free)} are free", str(self.dir)
            )
        loader = DataLoader(
            _Encoded(self.source, self.preprocessing),
            batch_size=16,
            num_workers=num_workers,
            collate_fn=list,
            generator=torch.Generator(),  # not the global one: training's draws must not depend on a build
        )
        partial = self.dir / f"images.{os.getpid()}.tmp"
        offsets, bad = [0], []
        try:
            with open(partial, "wb") as file:
                progress = tqdm(loader, desc=f"caching {self.source.identity} images", unit="batch", disable=None)
                for batch in progress:
                    for data in batch:
                        if not data:
                            bad.append(len(offsets) - 1)
                        file.write(data)
                        offsets.append(offsets[-1] + len(data))
                file.flush()
                os.fsync(file.fileno())
            os.replace(partial, self.data)
        finally:
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
        meta = {"source": self.source.identity, "size": p.size, "quality": QUALITY, "bad": bad}
        write_text_atomically(self.meta, json.dumps(meta, indent=1))
        replace_atomically(self.offsets_path, lambda file: np.save(file, np.array(offsets, dtype=np.int64)))
        self.bad = set(bad)

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
