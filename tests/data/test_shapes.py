import colorsys
import hashlib

import numpy as np
import pytest
import torch

from captioner.data.shapes import (
    COLORS,
    SHAPES,
    SIZES,
    ShapeObject,
    ShapesDataset,
    _shade,
    link_words_to_objects,
    word_boxes,
)
from captioner.data.vocab import tokenize
from captioner.metrics import attention_ceiling, attention_correctness, oracle_attention


def digest(dataset, index):
    return hashlib.sha256(dataset.load_image(index).tobytes()).hexdigest()


def test_same_seed_same_bytes_other_seed_other_bytes():
    a, b = ShapesDataset("train", 5, seed=3), ShapesDataset("train", 5, seed=3)
    assert [digest(a, i) for i in range(5)] == [digest(b, i) for i in range(5)]
    assert [a.captions(i) for i in range(5)] == [b.captions(i) for i in range(5)]
    c = ShapesDataset("train", 5, seed=4)
    assert digest(a, 0) != digest(c, 0)
    assert digest(a, 0) != digest(ShapesDataset("val", 5, seed=3), 0)  # splits are disjoint streams


def test_cached_png_gives_the_same_pixels(tmp_path):
    fresh = ShapesDataset("val", 2, seed=1)
    cached = ShapesDataset("val", 2, seed=1, image_dir=str(tmp_path))
    first = digest(cached, 1)  # drawn and written
    assert list(tmp_path.glob("*.png"))
    assert digest(cached, 1) == first == digest(fresh, 1)  # read back


def test_scenes_have_the_promised_variety_and_no_overlaps():
    dataset = ShapesDataset("train", 300, seed=0)
    seen = {"count": set(), "shape": set(), "color": set(), "size": set()}
    for i in range(len(dataset)):
        objects = dataset.objects(i)
        seen["count"].add(len(objects))
        for j, o in enumerate(objects):
            seen["shape"].add(o.shape), seen["color"].add(o.color), seen["size"].add(o.size)
            for other in objects[j + 1 :]:
                x0, y0, x1, y1 = o.box
                u0, v0, u1, v1 = other.box
                assert x1 <= u0 or u1 <= x0 or y1 <= v0 or v1 <= y0
    assert seen == {"count": {1, 2, 3}, "shape": set(SHAPES), "color": set(COLORS), "size": set(SIZES)}


def test_five_different_captions_with_word_to_object_links():
    dataset = ShapesDataset("train", 50, seed=0)
    for i in range(len(dataset)):
        sample = dataset[i]
        assert len({c.text for c in sample.captions}) == 5
        for caption in sample.captions:
            assert tokenize(caption.text) == caption.tokens
            named = [(w, k) for w, k in zip(caption.tokens, caption.objects, strict=True) if k >= 0]
            assert {k for _, k in named} == set(range(len(sample.objects)))  # every object is named
            for word, k in named:
                obj = sample.objects[k]
                assert word in (obj.shape, obj.color, obj.size)


def test_relations_follow_the_boxes():
    dataset = ShapesDataset("train", 200, seed=0)
    checked = 0
    for i in range(len(dataset)):
        objects = dataset.objects(i)
        if len(objects) != 2:
            continue
        first = dataset[i].captions[0].text  # "a <first> <relation> a <second>"
        (ax, ay), (bx, by) = objects[0].center, objects[1].center
        if abs(bx - ax) >= abs(by - ay):
            assert "to the left of" in first
        else:
            assert ("above" if by > ay else "below") in first
        checked += 1
    assert checked > 20


def test_each_colour_word_is_a_range_of_shades_on_varied_backgrounds():
    """A colour word names shades of one hue range; backgrounds are light and dark, clean or noisy."""
    dataset = ShapesDataset("train", 200, seed=0)
    shades, corners, flat = {name: [] for name in COLORS}, [], []
    for i in range(len(dataset)):
        pixels = np.asarray(dataset.load_image(i), dtype=np.float64) / 255
        corners.append(pixels[:6, :6].mean())
        flat.append(np.ptp(pixels[:6, :6].reshape(-1, 3), axis=0).max() == 0)
        for obj in dataset.objects(i):
            cx, cy = (round(v) for v in obj.center)
            r, g, b = pixels[cy - 3 : cy + 4, cx - 3 : cx + 4].reshape(-1, 3).mean(0)  # the middle, noise averaged
            hue, _, value = colorsys.rgb_to_hsv(r, g, b)
            shades[obj.color].append((hue * 360, value))
    for name, ((low, high), _) in COLORS.items():
        hues = np.array([h for h, _ in shades[name]])
        hues = np.where(hues > 180, hues - 360, hues) if low < 0 else hues  # red straddles 0 degrees
        assert np.all((hues > low - 12) & (hues < high + 12)), name  # noise and JPEG move a hue a little
        assert hues.std() > (high - low) / 5, name  # and the shade varies over the range (uniform: width / 3.5)
    assert min(corners) < 0.3 and max(corners) > 0.75  # dark and light backgrounds
    assert 0.3 < np.mean(flat) < 0.6  # no noise in half the images, as in plain drawings (a flat corner: 0.465)


def test_a_shade_is_uniform_in_its_range_with_each_end_a_sixth_of_the_time():
    rng = np.random.default_rng(0)
    shades = np.array([_shade(rng, 0.65, 1.0) for _ in range(3000)])
    assert shades.min() == 0.65 and shades.max() == 1.0
    for end in (0.65, 1.0):  # full saturation or brightness: pure colours, as plain drawings use them
        assert abs(np.mean(shades == end) - 1 / 6) < 0.03  # 3.5 standard errors
    inside = shades[(shades > 0.65) & (shades < 1.0)]
    assert abs(np.mean(inside < 0.825) - 0.5) < 0.05  # and uniform in between


OBJECTS = [
    ShapeObject("circle", "red", "small", (0, 0, 50, 50)),
    ShapeObject("square", "blue", "large", (100, 100, 200, 200)),
]


def test_words_link_to_the_unique_matching_object():
    words = "a small red circle to the left of a large blue square".split()
    assert link_words_to_objects(words, OBJECTS) == [-1, 0, 0, 0, -1, -1, -1, -1, -1, 1, 1, 1]
    assert link_words_to_objects("a green circle".split(), OBJECTS) == [-1, -1, -1]  # names no object
    assert link_words_to_objects("a red circle".split(), OBJECTS) == [-1, 0, 0]  # size may be left out
    assert word_boxes("a red circle".split(), OBJECTS) == [None, OBJECTS[0].box, OBJECTS[0].box]


def pil_bicubic_weights(in_size: int, out_size: int) -> np.ndarray:
    """(out, in): how PIL's bicubic resize weighs each input pixel for each output pixel, written out from its
    resampling code (Keys' kernel with a = -0.5, support 2 when enlarging, weights normalised within the image)."""

    def kernel(x: float, a: float = -0.5) -> float:
        x = abs(x)
        if x < 1:
            return ((a + 2) * x - (a + 3)) * x * x + 1
        return (((x - 5) * x + 8) * x - 4) * a if x < 2 else 0.0

    scale = in_size / out_size
    weights = np.zeros((out_size, in_size))
    for out in range(out_size):
        center = (out + 0.5) * scale
        low, high = max(int(center - 2 + 0.5), 0), min(int(center + 2 + 0.5), in_size)
        row = np.array([kernel(x - center + 0.5) for x in range(low, high)])
        weights[out, low:high] = row / row.sum()
    return weights


def test_attention_correctness_mass_in_box_and_baseline():
    grid = (2, 2)  # on a 200x200 image each cell is 100x100
    words = ["a", "large", "blue", "square"]
    alphas = torch.tensor([[0.25] * 4, [0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0], [0.25] * 4])
    masses, baselines = attention_correctness(alphas, word_boxes(words, OBJECTS), grid, (200, 200))
    assert len(masses) == 3 and baselines == [0.25] * 3
    # All attention on the bottom-right cell, the square's box: upsampled by bicubic, whose kernel reaches into the
    # neighbouring cells, the share inside the box is below 1 (0.797). Negative lobes are clipped to 0.
    profile = pil_bicubic_weights(2, 200)[:, 1]  # (200,) how much of cell 1 each row (and column) gets
    heat = np.clip(np.outer(profile, profile), 0, None)
    expected = heat[100:, 100:].sum() / heat.sum()
    assert masses[0] == masses[1] == pytest.approx(expected, abs=1e-4)
    assert 0.79 < expected < 0.80
    assert masses[2] == pytest.approx(0.25, abs=0.02)  # uniform attention scores the baseline


def test_the_ceiling_is_the_score_of_attention_spread_over_the_cells_inside_the_box():
    grid = (2, 2)
    # the square's box (100..200) holds the centre of cell 3 alone; the small circle's (0..50) no centre at all, so
    # the cell holding its centre stands in
    assert oracle_attention(OBJECTS[1].box, grid, (200, 200)).tolist() == [0.0, 0.0, 0.0, 1.0]
    assert oracle_attention(OBJECTS[0].box, grid, (200, 200)).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert oracle_attention((0, 0, 200, 100), (2, 2), (200, 200)).tolist() == [0.5, 0.5, 0.0, 0.0]
    words = "a small red circle and a large blue square".split()
    on_square = [0.0, 0.0, 0.0, 1.0]
    boxes = word_boxes(words, OBJECTS)
    one_hot, _ = attention_correctness(torch.tensor([on_square] * 3), boxes[-3:], grid, (200, 200))
    ceilings = attention_ceiling(boxes, grid, (200, 200))
    assert len(ceilings) == 6 and ceilings[3:] == pytest.approx(one_hot)
    assert 0 < ceilings[0] < ceilings[3] < 1  # a box smaller than a cell cannot hold its cell's upsampled weight
