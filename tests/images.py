"""Real photos and deliberately broken files, written by the tests into tmp_path."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image
from skimage import data as skdata


def photo(name: str = "coffee") -> Image.Image:
    return Image.fromarray(getattr(skdata, name)())


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels (no pixel data): a decompression-bomb stand-in."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


def write_good_images(folder: Path) -> list[Path]:
    """One file per awkward-but-valid case: every PIL mode we promise, EXIF rotation, tiny and very wide images."""
    folder.mkdir(parents=True, exist_ok=True)
    rgb = photo("coffee").resize((160, 120))
    cases = {
        "rgb.jpg": rgb,
        "gray.png": rgb.convert("L"),
        "gray_alpha.png": rgb.convert("LA"),
        "rgba.png": rgb.convert("RGBA"),
        "palette.png": rgb.convert("P"),
        "cmyk.jpg": rgb.convert("CMYK"),
        "tiny.png": rgb.resize((1, 1)),
        "wide.png": rgb.resize((3000, 6)),
        "nested/astronaut.jpg": photo("astronaut").resize((128, 128)),
    }
    paths = []
    for name, image in cases.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        image.save(path)
        paths.append(path)
    sixteen = folder / "sixteen_bit.png"
    sixteen_bit = Image.fromarray(np.asarray(rgb.convert("L"), dtype=np.uint16) * 257)
    assert sixteen_bit.mode == "I;16"
    sixteen_bit.save(sixteen)
    rotated = folder / "exif_rotated.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    rgb.save(rotated, exif=exif)
    return [*paths, sixteen, rotated]


def write_bad_files(folder: Path) -> dict[Path, str]:
    """Broken files -> a fragment of the reason the error line must give."""
    folder.mkdir(parents=True, exist_ok=True)
    good = folder / "_good.jpg"
    photo("chelsea").save(good)
    data = good.read_bytes()
    good.unlink()
    files = {
        "empty.jpg": (b"", "empty file"),
        "truncated.jpg": (data[: len(data) // 3], "cannot decode image"),
        "notes.png": (b"these are my holiday notes, not a picture\n" * 20, "not an image file"),
        "random.jpg": (np.random.default_rng(0).bytes(4096), "not an image file"),
        "bomb.png": (png_claiming(100_000, 100_000), "decompression bomb"),
    }
    out = {}
    for name, (content, reason) in files.items():
        (folder / name).write_bytes(content)
        out[folder / name] = reason
    return out
