"""The built-in "shapes" caption set: procedurally drawn scenes with COCO-style captions and ground-truth boxes.

Each image holds 1-3 non-overlapping objects (4 shapes, 5 colours, 2 sizes), slightly rotated and anti-aliased
or not, on a varied background (plain or a gradient, light, mid or dark, clean or with noise of several strengths),
and a third of the images are JPEG-compressed. Each colour word covers a range of shades, so a model learns the word,
not one RGB value. Every image has five captions, one per annotator style, each naming colour, size, shape and spatial
relations in its own phrasing. For attention checks, every object's box is kept, and every caption word that names
an object (its size, colour or shape word) is linked to that object.

Everything is a pure function of (seed, split, index): the same seed always gives the same bytes.
"""

from __future__ import annotations

import colorsys
import io
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
from PIL import Image, ImageDraw

from captioner.data.images import load_image
from captioner.errors import ConfigError, check_choice

SHAPES = ("circle", "square", "triangle", "diamond")
# Each colour word is a range of shades: (hue range in degrees, value range); saturation is 0.65-1. The ranges hold
# PIL's and CSS's colours of the same name (green is 0,128,0 and purple 128,0,128: value 0.5).
COLORS = {
    "red": ((-10, 10), (0.55, 1.0)),
    "green": ((95, 145), (0.4, 0.9)),
    "blue": ((205, 240), (0.55, 1.0)),
    "yellow": ((48, 62), (0.8, 1.0)),
    "purple": ((275, 305), (0.45, 0.85)),
}
SIZES = {"small": 44, "large": 80}  # side of the object's box, in pixels of a 224x224 image
SPLITS = ("train", "val", "test")
GENERATOR_VERSION = 3  # bump when drawing or captions change, so feature caches are rebuilt
NUMBERS = ("one", "two", "three")


class ShapeObject(NamedTuple):
    shape: str
    color: str
    size: str
    box: tuple[int, int, int, int]  # x0, y0, x1, y1 in pixels, x1/y1 exclusive

    @property
    def center(self) -> tuple[float, float]:
        x0, y0, x1, y1 = self.box
        return (x0 + x1) / 2, (y0 + y1) / 2


@dataclass
class Caption:
    text: str
    tokens: list[str]
    objects: list[int]  # for each token, the index of the object it names, or -1


@dataclass
class ShapesSample:
    image: Image.Image
    captions: list[Caption]
    objects: list[ShapeObject]


def _rng(seed: int, split: str, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, SPLITS.index(split), index])


def sample_scene(rng: np.random.Generator, image_size: int = 224, max_tries: int = 200) -> list[ShapeObject]:
    """1-3 objects, sorted left to right, whose boxes keep a gap and whose pairwise relations are unambiguous."""
    scale = image_size / 224
    count = int(rng.integers(1, 4))
    for _ in range(max_tries):
        objects = []
        for _ in range(count):
            size = str(rng.choice(list(SIZES)))
            side = round(SIZES[size] * scale)
            x0, y0 = (int(v) for v in rng.integers(4, image_size - side - 4, size=2))
            objects.append(
                ShapeObject(
                    str(rng.choice(SHAPES)), str(rng.choice(list(COLORS))), size, (x0, y0, x0 + side, y0 + side)
                )
            )
        objects.sort(key=lambda o: o.center[0])
        if _well_separated(objects, gap=8 * scale, margin=16 * scale):
            return objects
    raise RuntimeError("could not place the objects; the image is too small")  # unreachable at sane sizes


def _well_separated(objects: list[ShapeObject], gap: float, margin: float) -> bool:
    for i, a in enumerate(objects):
        for b in objects[i + 1 :]:
            ax0, ay0, ax1, ay1 = a.box
            bx0, by0, bx1, by1 = b.box
            if ax0 < bx1 + gap and bx0 < ax1 + gap and ay0 < by1 + gap and by0 < ay1 + gap:
                return False
            dx, dy = abs(b.center[0] - a.center[0]), abs(b.center[1] - a.center[1])
            if abs(dx - dy) < margin:  # neither clearly beside nor clearly above: "left of" vs "above" is ambiguous
                return False
    return True


def _shade(rng: np.random.Generator, low: float, high: float) -> float:
    """Uniform in [low, high], except that each end is drawn a sixth of the time: vivid and pure shades (full
    saturation, full brightness, a pure white background) are common in real drawings and would be rare otherwise."""
    spill = (high - low) / 4
    return float(np.clip(rng.uniform(low - spill, high + spill), low, high))


def _hsv(hue: float, saturation: float, value: float) -> np.ndarray:
    return np.array(colorsys.hsv_to_rgb((hue / 360) % 1, saturation, value)) * 255


def _background(rng: np.random.Generator, size: int) -> np.ndarray:
    """A plain colour or a linear gradient, light, mid or dark, neutral or slightly tinted: (size, size, 3) floats."""
    low, high = ((0.8, 1.0), (0.4, 0.65), (0.0, 0.25))[rng.integers(3)]
    tint = rng.random() < 0.5  # else neutral: white, grey or black
    first = _hsv(rng.uniform(0, 360), rng.uniform(0, 0.25) * tint, _shade(rng, low, high))
    if rng.random() < 0.5:
        return np.broadcast_to(first, (size, size, 3)).copy()
    second = _hsv(rng.uniform(0, 360), rng.uniform(0, 0.25) * tint, _shade(rng, low, high))
    angle = rng.uniform(0, 2 * np.pi)
    y, x = np.mgrid[0:size, 0:size] / (size - 1) - 0.5
    t = np.clip(x * np.cos(angle) + y * np.sin(angle) + 0.5, 0, 1)[..., None]
    return (1 - t) * first + t * second


def _outline(obj: ShapeObject, angle: float, oversample: int) -> list[tuple[float, float]]:
    """The shape's corners, rotated by `angle` about its centre and shrunk to stay inside its box."""
    x0, y0, x1, y1 = (v * oversample for v in obj.box)
    cx, cy, r = (x0 + x1) / 2, (y0 + y1) / 2, (x1 - x0) / 2
    corners = {
        "square": [(-1, -1), (1, -1), (1, 1), (-1, 1)],
        "triangle": [(0, -1), (1, 1), (-1, 1)],
        "diamond": [(0, -1), (1, 0), (0, 1), (-1, 0)],
    }[obj.shape]
    cos, sin = np.cos(angle), np.sin(angle)
    shrink = r / (abs(cos) + abs(sin))
    return [(cx + shrink * (u * cos - v * sin), cy + shrink * (u * sin + v * cos)) for u, v in corners]


def render(objects: list[ShapeObject], rng: np.random.Generator, image_size: int = 224) -> Image.Image:
    """Draw the objects on a varied background: each in a random shade of its colour, rotated by up to 10 degrees
    (circles excepted), anti-aliased (drawn at 4x and reduced) in half the images; then, in half the images, noise
    over everything, and for a third of them a JPEG round trip."""
    pixels = _background(rng, image_size)
    oversample = 4 if rng.random() < 0.5 else 1
    for obj in objects:
        (hue_low, hue_high), (value_low, value_high) = COLORS[obj.color]
        color = _hsv(_shade(rng, hue_low, hue_high), _shade(rng, 0.65, 1.0), _shade(rng, value_low, value_high))
        mask = Image.new("L", (image_size * oversample,) * 2, 0)
        if obj.shape == "circle":
            x0, y0, x1, y1 = (v * oversample for v in obj.box)
            ImageDraw.Draw(mask).ellipse((x0, y0, x1 - 1, y1 - 1), fill=255)
        else:
            ImageDraw.Draw(mask).polygon(_outline(obj, np.radians(rng.uniform(-10, 10)), oversample), fill=255)
        cover = np.asarray(mask.reduce(oversample), dtype=np.float64)[..., None] / 255
        pixels = (1 - cover) * pixels + cover * color
    pixels += rng.normal(0, rng.choice([0, 0, 0, 0, 4, 8, 14, 20]), size=pixels.shape)
    image = Image.fromarray(np.clip(pixels, 0, 255).round().astype(np.uint8), "RGB")
    if rng.random() < 1 / 3:
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=int(rng.integers(35, 91)))
        image = Image.open(buffer).convert("RGB")
    return image


# ---- captions -------------------------------------------------------------------------------------------------------
# A caption is built as (word, object index) pairs, so the link from words to objects is exact.


def _noun_phrase(obj: ShapeObject, index: int, with_size: bool = True) -> list[tuple[str, int]]:
    words = [("a", -1)] + ([(obj.size, index)] if with_size else [])
    return words + [(obj.color, index), (obj.shape, index)]


def _relation(a: ShapeObject, b: ShapeObject) -> list[tuple[str, int]]:
    """Where a is relative to b."""
    dx, dy = b.center[0] - a.center[0], b.center[1] - a.center[1]
    if abs(dx) >= abs(dy):
        words = ["to", "the", "left" if dx > 0 else "right", "of"]
    else:
        words = ["above" if dy > 0 else "below"]
    return [(w, -1) for w in words]


def _where(obj: ShapeObject, image_size: int) -> list[tuple[str, int]]:
    third = obj.center[0] * 3 // image_size
    words = ["on", "the", "left"] if third == 0 else ["in", "the", "middle"] if third == 1 else ["on", "the", "right"]
    return [(w, -1) for w in words]


def _chain(objects: list[ShapeObject], order: list[int]) -> list[tuple[str, int]]:
    """'a X <rel> a Y <rel> a Z', following `order`."""
    words = _noun_phrase(objects[order[0]], order[0])
    for prev, cur in itertools.pairwise(order):
        words += _relation(objects[prev], objects[cur]) + _noun_phrase(objects[cur], cur)
    return words


def _listing(objects: list[ShapeObject], with_size: bool = True) -> list[tuple[str, int]]:
    """'a X , a Y and a Z'."""
    words: list[tuple[str, int]] = []
    for i, obj in enumerate(objects):
        if i:
            words.append(("and", -1) if i == len(objects) - 1 else (",", -1))
        words += _noun_phrase(obj, i, with_size)
    return words


def describe(objects: list[ShapeObject], image_size: int = 224) -> list[Caption]:
    """Five captions, one per annotator style. Objects are expected sorted left to right."""
    n = len(objects)
    last = n - 1
    if n == 1:
        relational = _chain(objects, [0]) + _where(objects[0], image_size)
        picture = [("a", -1), ("picture", -1), ("of", -1)] + relational
    else:
        relational = _chain(objects, list(range(n)))
        picture = [("a", -1), ("picture", -1), ("of", -1)] + _chain(objects, list(range(last, -1, -1)))
    counting = [(NUMBERS[last], -1), ("shape" if n == 1 else "shapes", -1), (":", -1)] + _listing(objects)
    there = [("there", -1), ("is", -1)] + _listing(objects) + [(w, -1) for w in ("in", "the", "picture")]
    short = _listing(objects, with_size=False)
    return [_caption(words) for words in (relational, counting, there, short, picture)]


def _caption(pairs: list[tuple[str, int]]) -> Caption:
    text = " ".join(w for w, _ in pairs).replace(" ,", ",").replace(" :", ":")
    kept = [(w, i) for w, i in pairs if w not in {",", ":"}]  # what tokenize(text) returns
    return Caption(text, [w for w, _ in kept], [i for _, i in kept])


class ShapesDataset:
    """One split of the shapes set; images are drawn on the fly, or cached as PNG under `image_dir`.

    Args:
        split: "train", "val" or "test".
        size: number of images.
        seed: the dataset seed; splits use disjoint random streams.
        image_size: side of the square images in pixels.
        image_dir: if set, each image is written there as PNG the first time it is drawn, and read back later (a file
            there that cannot be read is skipped, as in any dataset of files).
    """

    def __init__(self, split: str, size: int, seed: int = 0, image_size: int = 224, image_dir: str | None = None):
        check_choice("split", split, SPLITS)
        if size < 1:
            raise ConfigError(f"{split} size must be positive, got {size}")
        self.split, self.size, self.seed, self.image_size = split, size, seed, image_size
        self.image_dir = Path(image_dir) if image_dir else None

    @property
    def identity(self) -> str:
        """Names exactly what this split contains; part of the feature-cache key."""
        return f"shapes-v{GENERATOR_VERSION}-{self.split}-n{self.size}-seed{self.seed}-px{self.image_size}"

    def __len__(self) -> int:
        return self.size

    def objects(self, index: int) -> list[ShapeObject]:
        return sample_scene(_rng(self.seed, self.split, index), self.image_size)

    def captions(self, index: int) -> list[str]:
        return [c.text for c in describe(self.objects(index), self.image_size)]

    def load_image(self, index: int) -> Image.Image:
        path = self.image_dir / f"{self.identity}-{index:06d}.png" if self.image_dir else None
        if path is not None and path.exists():
            return load_image(path)  # a damaged file raises ImageError naming it, as any dataset's would
        rng = _rng(self.seed, self.split, index)
        objects = sample_scene(rng, self.image_size)
        image = render(objects, rng, self.image_size)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            image.save(path)
        return image

    def __getitem__(self, index: int) -> ShapesSample:
        if not 0 <= index < self.size:
            raise IndexError(index)
        objects = self.objects(index)
        return ShapesSample(self.load_image(index), describe(objects, self.image_size), objects)


def link_words_to_objects(words: Sequence[str], objects: Sequence) -> list[int]:
    """For each generated word, the index of the object it names, or -1.

    A phrase "[size] colour shape" names the object with those attributes; its words are linked only when exactly
    one object of the image matches (an ambiguous or wrong phrase links nothing).
    """
    links = [-1] * len(words)
    for t, word in enumerate(words):
        if word not in SHAPES or t == 0:
            continue
        color = words[t - 1]
        size = words[t - 2] if t >= 2 and words[t - 2] in SIZES else None
        matches = [
            k
            for k, o in enumerate(objects)
            if o.shape == word and o.color == color and (size is None or o.size == size)
        ]
        if len(matches) == 1:
            for position in range(t - 1 - (size is not None), t + 1):
                links[position] = matches[0]
    return links


def word_boxes(words: Sequence[str], objects: Sequence) -> list[tuple[int, int, int, int] | None]:
    """For each generated word, the box of the object it names (`link_words_to_objects`), or None: what
    `captioner.metrics.attention_correctness` scores."""
    return [objects[k].box if k >= 0 else None for k in link_words_to_objects(words, objects)]
