"""Single shapes drawn plainly, by code apart from the shapes generator: PIL primitives in PIL's standard colours
("blue" is 0,0,255) on plain backgrounds. A model that learnt the words, not the generator's exact pixels, names the
colour and the shape of each."""

from __future__ import annotations

import itertools
import random

import pytest
from PIL import Image, ImageDraw

from captioner import Captioner
from captioner.data.shapes import COLORS, SHAPES

BACKGROUNDS = ("white", "lightgray", "gray", "black", "beige", "lightblue")


def draw(shape: str, color: str, side: int, corner: tuple[int, int], background: str) -> Image.Image:
    image = Image.new("RGB", (224, 224), background)
    draw = ImageDraw.Draw(image)
    (x0, y0), (x1, y1) = corner, (corner[0] + side, corner[1] + side)
    middle = ((x0 + x1) / 2, (y0 + y1) / 2)
    if shape == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=color)
    elif shape == "square":
        draw.rectangle((x0, y0, x1, y1), fill=color)
    elif shape == "triangle":
        draw.polygon([(middle[0], y0), (x1, y1), (x0, y1)], fill=color)
    else:  # diamond
        draw.polygon([(middle[0], y0), (x1, middle[1]), (middle[0], y1), (x0, middle[1])], fill=color)
    return image


def plain_split() -> list[tuple[str, str, Image.Image]]:
    """Every shape, colour and background once (120 images), at a random size and place (seeded)."""
    rng = random.Random(0)
    cases = []
    for shape, color, background in itertools.product(SHAPES, COLORS, BACKGROUNDS):
        side = rng.choice([44, 80])
        corner = (rng.randint(10, 214 - side), rng.randint(10, 214 - side))
        cases.append((shape, color, draw(shape, color, side, corner, background)))
    return cases


@pytest.mark.xfail(
    strict=True,
    reason="issue #37: the bundled model has seen one exact RGB per colour on noisy grey; it names colour and shape "
    "of 64 of these 120 (0.53)",
)
def test_the_bundled_model_names_the_colour_and_shape_of_plainly_drawn_objects():
    cases = plain_split()
    results = Captioner.load("shapes").caption([image for *_, image in cases], beam_size=3)
    named = sum(shape in r.tokens and color in r.tokens for (shape, color, _), r in zip(cases, results, strict=True))
    assert named / len(cases) >= 0.9, f"{named} of {len(cases)}"
