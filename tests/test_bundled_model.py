"""The bundled model `shapes` (`Captioner.load("shapes")`), judged against its targets: on held-out images of its own
split, where it looks and what it says, and on single shapes drawn plainly by code apart from the generator."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from PIL import Image, ImageDraw

from captioner import Captioner
from captioner.data.shapes import COLORS, SHAPES, ShapesDataset, word_boxes
from captioner.data.vocab import tokenize
from captioner.metrics import attention_ceiling, attention_correctness, bleu


@pytest.fixture(scope="module")
def model() -> Captioner:
    return Captioner.load("shapes")


@pytest.fixture(scope="module")
def split_images() -> tuple[ShapesDataset, list[Image.Image]]:
    """The shapes test split of 500 images, and the images, drawn once."""
    test = ShapesDataset("test", 500, seed=0)
    return test, [test.load_image(i) for i in range(len(test))]


@pytest.fixture(scope="module")
def held_out(model, split_images) -> dict[str, float]:
    """Attention correctness, BLEU-4 and exact captions on the 500 images of the shapes test split, decoded with
    beam 3 as `captioner caption`, `captioner serve` and `Captioner.caption` decode by default."""
    test, images = split_images
    results = model.caption(images, beam_size=3)
    references = [[tokenize(c) for c in test.captions(i)] for i in range(len(test))]
    masses, ceilings = [], []
    for i, r in enumerate(results):
        boxes = word_boxes(r.tokens, test.objects(i))
        masses += attention_correctness(r.alphas, boxes, r.grid_hw, r.image.size)[0]
        ceilings += attention_ceiling(boxes, r.grid_hw, r.image.size)
    assert len(masses) > 2000  # most object words are named right, so they count
    figures = {
        "attention": sum(masses) / len(masses),
        "ceiling": sum(ceilings) / len(ceilings),  # the same words, attended as well as a 14x14 grid can
        "bleu4": bleu([r.tokens for r in results], references),
        "exact": sum(r.tokens in refs for r, refs in zip(results, references, strict=True)) / len(results),
        "words": sum(len(r.tokens) for r in results) / len(results),
    }
    print("\nbundled model, 500 test images, beam 3:", {k: round(v, 4) for k, v in figures.items()})  # with -s
    return figures


@pytest.fixture(scope="module")
def plain(model) -> float:
    """The share of plainly drawn single shapes (`plain_split`) whose colour and shape the model names (beam 3)."""
    cases = plain_split()
    results = model.caption([image for *_, image in cases], beam_size=3)
    named = sum(shape in r.tokens and color in r.tokens for (shape, color, _), r in zip(cases, results, strict=True))
    print(f"\nbundled model, {len(cases)} plainly drawn shapes, colour and shape named: {named}")  # with -s
    return named / len(cases)


def test_sync_free_decoding_writes_the_same_captions_on_its_test_split(model, split_images):
    """The decoders' fixed-shape form (the default on CUDA) against the shrinking one (the CPU's), token for token."""
    _, images = split_images
    transform = model.model.encoder.preprocessing.transforms()
    with torch.inference_mode():
        annotations = torch.cat(
            [
                model.model.annotate(torch.stack([transform(image) for image in images[start : start + 100]]))
                for start in range(0, len(images), 100)
            ]
        )  # (500,P,E)
        for beam_size in (1, 3):
            want = model.model.generate(annotations=annotations, beam_size=beam_size, sync_free=False)
            got = model.model.generate(annotations=annotations, beam_size=beam_size, sync_free=True)
            assert torch.equal(got.tokens, want.tokens), beam_size
            assert torch.equal(got.lengths, want.lengths)
            assert torch.allclose(got.scores, want.scores, atol=1e-4)
            assert torch.allclose(got.alphas, want.alphas, atol=1e-5)


# Its targets, and what this model measured on this machine.


def test_on_its_test_split_its_attention_lands_on_the_object_it_names(held_out):
    assert held_out["attention"] >= 0.75  # 0.757; the uniform-attention baseline is 0.070
    assert held_out["attention"] < held_out["ceiling"] < 1  # the ceiling of these words


def test_on_its_test_split_it_says_what_is_there(held_out):
    assert held_out["bleu4"] >= 0.93  # 0.956
    assert held_out["exact"] >= 0.8  # 0.84 of the captions are one of the five references, word for word


def test_it_names_the_colour_and_shape_of_plainly_drawn_objects(plain):
    assert plain >= 0.9  # 117 of 120 (0.975)


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
