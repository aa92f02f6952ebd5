"""Reading real-world image files: any mode, EXIF orientation, and clear errors for broken files."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from ..errors import CaptionerError  # relative: deploy/ installs this file as captioner_onnx.data.images

SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".jfif")
IMAGE_SUFFIXES = set(SUFFIXES)


class ImageError(CaptionerError):
    """An image that cannot be read; the message names the file and the reason."""


def to_rgb(image: Image.Image) -> Image.Image:
    """Any PIL mode -> RGB: respects EXIF orientation, puts transparency on white, rescales 16-bit/float images."""
    image = ImageOps.exif_transpose(image)
    if image.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
        pixels = np.asarray(image, dtype=np.float64)
        low, high = pixels.min(), pixels.max()
        scaled = (pixels - low) / (high - low) * 255 if high > low else np.zeros_like(pixels)
        return Image.fromarray(scaled.astype(np.uint8), "L").convert("RGB")
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def load_image(
    path: str | Path | BinaryIO, name: str | None = None, max_pixels: int | None = None, reduce_to: int | None = None
) -> Image.Image:
    """Open, fully decode and convert an image file (a path, or an open binary file called `name`) to RGB, or raise
    ImageError("<name>: <reason>").

    PIL's decompression-bomb guard stays on, and its warning is an error: a header claiming more than
    Image.MAX_IMAGE_PIXELS is refused before any pixel is decoded.

    Args:
        max_pixels: refuse, from the header and before decoding, an image of more pixels (None: PIL's limit only).
        reduce_to: an image at least twice this size on both sides is made smaller, to no less than it: a JPEG is
            decoded at 1/2, 1/4 or 1/8 scale (`Image.draft`), any other image reduced by an integer factor after
            decoding. For a server that needs only the model's input size.
    """
    path = Path(path) if isinstance(path, (str, Path)) else path
    name = name or str(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                width, height = image.size
                if max_pixels is not None and width * height > max_pixels:
                    limit = f"{max_pixels / 1e6:g} Mpx"
                    raise ImageError(f"{name}: {width}x{height} pixels is over the {limit} limit")
                if reduce_to:
                    image.draft(image.mode, (reduce_to, reduce_to))  # JPEG only; any other format ignores it
                image.load()  # decode now, so a truncated file fails here and not later
                rgb = to_rgb(image)
                factor = min(rgb.size) // reduce_to if reduce_to else 1
                return rgb.reduce(factor) if factor >= 2 else rgb
    except FileNotFoundError:
        reason = "file not found"
    except IsADirectoryError:
        reason = "is a directory"
    except PermissionError:
        reason = "permission denied"
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        reason = f"refused as a possible decompression bomb ({err})"
    except UnidentifiedImageError:
        empty = path.stat().st_size == 0 if isinstance(path, Path) else path.seek(0, 2) == 0
        reason = "empty file" if empty else "not an image file PIL can read"
    except (OSError, SyntaxError, ValueError) as err:
        reason = f"cannot decode image ({err})"
    raise ImageError(f"{name}: {reason}")


def find_images(paths: list[str | Path]) -> tuple[list[Path], list[ImageError]]:
    """Files as given, and folders searched recursively for files with an image suffix (sorted); and an error for each
    path that names no image: a URL (not supported: download the image first) or a folder with no image in it."""
    found, errors = [], []
    for given in map(str, paths):
        path = Path(given)
        if given.startswith(("http://", "https://")):
            errors.append(ImageError(f"{given}: URLs are not supported; download the image and pass its path"))
        elif path.is_dir():
            images = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES)
            if not images:
                errors.append(ImageError(f"{path}: no image files in this folder (looked for {', '.join(SUFFIXES)})"))
            found += images
        else:
            found.append(path)
    return found, errors


def read_batches(
    images: Iterable[str | Path | Image.Image], batch_size: int
) -> Iterator[list[tuple[str, Image.Image]] | ImageError]:
    """Images (paths or PIL images) read in order, as batches of at most `batch_size` (source, RGB image) pairs; a file
    that cannot be read yields its ImageError in its place, after the batch read before it. One batch is held at once:
    what both Captioners (torch's and ONNX Runtime's) caption from."""
    batch: list[tuple[str, Image.Image]] = []
    for item in images:
        try:
            if isinstance(item, Image.Image):
                batch.append(("<image>", to_rgb(item)))
            else:
                batch.append((str(item), load_image(item)))
        except ImageError as err:
            if batch:
                yield batch
            batch = []
            yield err
            continue
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch
