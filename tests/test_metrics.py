import pytest
import torch

from captioner.data.shapes import ShapeObject
from captioner.metrics import attention_correctness, bleu, link_words_to_objects

OBJECTS = [
    ShapeObject("circle", "red", "small", (0, 0, 50, 50)),
    ShapeObject("square", "blue", "large", (100, 100, 200, 200)),
]


def test_bleu_exact_match_and_nltk_agreement():
    refs = [[["a", "red", "circle", "on", "the", "left"], ["one", "shape", "a", "red", "circle"]]]
    assert bleu([["a", "red", "circle", "on", "the", "left"]], refs) == pytest.approx(1.0)
    assert bleu([["a", "blue", "square", "on", "the", "left"]], refs) < 0.6
    with pytest.raises(ValueError):
        bleu([["a"]], [])


def test_words_link_to_the_unique_matching_object():
    words = "a small red circle to the left of a large blue square".split()
    assert link_words_to_objects(words, OBJECTS) == [-1, 0, 0, 0, -1, -1, -1, -1, -1, 1, 1, 1]
    assert link_words_to_objects("a green circle".split(), OBJECTS) == [-1, -1, -1]  # names no object
    assert link_words_to_objects("a red circle".split(), OBJECTS) == [-1, 0, 0]  # size may be left out


def test_attention_correctness_mass_in_box_and_baseline():
    grid = (2, 2)  # on a 200x200 image each cell is 100x100
    words = ["a", "large", "blue", "square"]
    alphas = torch.tensor([[0.25] * 4, [0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0], [0.25] * 4])
    masses, baselines = attention_correctness(words, alphas, grid, OBJECTS, (200, 200))
    assert len(masses) == 3 and baselines == [0.25] * 3
    assert masses[0] > 0.6 and masses[1] > 0.6  # attention on the bottom-right cell, the square's box
    assert masses[2] == pytest.approx(0.25, abs=0.02)  # uniform attention scores the baseline
