"""The bundled model (`Captioner.load("shapes")`), judged as issue #37 asks: on held-out images of its own split,
where it looks and what it says, and on single shapes drawn plainly by code apart from the generator."""

from __future__ import annotations

import itertools
import random

import pytest
from PIL import Image, ImageDraw

from captioner import Captioner
from captioner.data.shapes import COLORS, SHAPES, ShapesDataset, attention_correctness
from captioner.data.vocab import tokenize
from captioner.metrics import bleu


@pytest.fixture(scope="module")
def held_out():
    """200 images of the shapes test split, captioned greedily (as `captioner test` decodes)."""
    test = ShapesDataset("test", 200, seed=0)
    images = [test.load_image(i) for i in range(len(test))]
    return test, Captioner.load("shapes").caption(images, beam_size=1)


def test_on_its_test_split_its_attention_lands_on_the_object_it_names(held_out):
    test, results = held_out
    masses = []
    for i, result in enumerate(results):
        words_masses, _ = attention_correctness(
            result.tokens, result.alphas, result.grid_hw, test.objects(i), (test.image_size,) * 2
        )
        masses += words_masses
    assert len(masses) > 300  # most images' object words are named right, so they count
    assert sum(masses) / len(masses) >= 0.75


def test_on_its_test_split_it_says_what_is_there(held_out):
    test, results = held_out
    references = [[tokenize(c) for c in test.captions(i)] for i in range(len(test))]
    assert bleu([r.tokens for r in results], references) >= 0.93
    exact = sum(r.tokens in refs for r, refs in zip(results, references, strict=True))
    assert exact >= 0.6 * len(results)  # most captions reproduce one of the five references word for word


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
    """Single shapes drawn plainly: PIL primitives in PIL's standard colours ("blue" is 0,0,255) on plain
    backgrounds. Every shape, colour and background once (120 images), at a random size and place (seeded)."""
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
