import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from captioner.visualize import attention_grid, attention_map, overlay_attention, plot_attention
from tests.images import photo


def count_tiles(sheet: Image.Image, image: Image.Image, tile: int = 192, title: int = 22, columns: int = 5) -> int:
    """Slots of the sheet whose picture area is not blank white; tiles are `tile` pixels on the image's longer side."""
    W, H = image.size
    width, height = (tile, round(tile * H / W)) if W >= H else (round(tile * W / H), tile)
    pixels = np.asarray(sheet)
    rows = sheet.size[1] // (height + title)
    filled = 0
    for k in range(rows * columns):
        x, y = (k % columns) * width, (k // columns) * (height + title) + title
        filled += bool((pixels[y : y + height, x : x + width] < 250).any())
    return filled


def test_map_is_smooth_normalised_and_peaks_where_attention_is():
    alpha = torch.zeros(9)
    alpha[2] = 1.0  # top-right cell of a 3x3 grid
    heat = attention_map(alpha, (3, 3), (90, 60))
    assert heat.shape == (60, 90) and heat.min() >= 0 and heat.sum() == pytest.approx(1.0)
    y, x = np.unravel_index(heat.argmax(), heat.shape)
    assert x >= 60 and y < 20
    assert len(np.unique(heat.round(8))) > 20  # interpolated, not blocky


def test_overlay_dims_where_attention_is_low():
    image = Image.new("RGB", (64, 64), (200, 200, 200))
    alpha = torch.tensor([1.0, 0.0, 0.0, 0.0])  # top-left of 2x2
    out = np.asarray(overlay_attention(image, alpha, (2, 2)))
    assert out.shape == (64, 64, 3)
    assert out[5, 5].mean() > 150 and out[58, 58].mean() < 60


def test_one_scale_for_every_word_unless_asked_per_word():
    image = Image.new("RGB", (64, 64), (200, 200, 200))
    focused = torch.tensor([1.0, 0.0, 0.0, 0.0])  # all on the top-left cell of a 2x2 grid
    diffuse = torch.tensor([0.4, 0.2, 0.2, 0.2])
    alphas = torch.stack([focused, diffuse])
    sheet_focused, sheet_diffuse = (np.asarray(overlay_attention(image, a, (2, 2), scale=1.0)) for a in alphas)
    assert (
        sheet_focused[5, 5].mean() > 190 and sheet_diffuse[5, 5].mean() < 130
    )  # α 0.4 of 1.0: 200 * (0.2 + 0.8 * 0.4) = 104
    per_word = np.asarray(overlay_attention(image, diffuse, (2, 2)))
    assert per_word[5, 5].mean() > 190  # per-word normalisation shows the diffuse word's peak at full brightness
    shared = np.asarray(attention_grid(image, ["on", "off"], alphas, (2, 2), tile=64))
    own = np.asarray(attention_grid(image, ["on", "off"], alphas, (2, 2), tile=64, per_word=True))
    second = (slice(22 + 5, 22 + 10), slice(2 * 64 + 5, 2 * 64 + 10))  # the top-left of the second word's tile
    assert shared[second].mean() < 130 and own[second].mean() > 190


@pytest.mark.parametrize("n_words", [1, 4, 7])
def test_grid_has_one_tile_per_word_plus_the_image(n_words):
    alphas = torch.softmax(torch.randn(n_words, 49), dim=-1)
    sheet = attention_grid(photo("chelsea"), [f"w{i}" for i in range(n_words)], alphas, (7, 7))
    assert count_tiles(sheet, photo("chelsea")) == n_words + 1


def test_plot_attention_returns_a_figure_with_titled_panels():
    import matplotlib

    matplotlib.use("Agg")
    words = ["a", "cat", "sleeping"]
    alphas = torch.softmax(torch.randn(3, 49), -1)
    figure = plot_attention(photo("chelsea"), words, alphas, peaks=False)
    titles = [ax.get_title() for ax in figure.axes if ax.get_title()]
    assert titles == words
    from captioner.visualize import top_tenth_share

    figure = plot_attention(photo("chelsea"), words, alphas)  # the share of each word's strongest tenth of the cells
    titles = [ax.get_title() for ax in figure.axes if ax.get_title()]
    shares = [f"{word} {top_tenth_share(alpha):.2f}" for word, alpha in zip(words, alphas, strict=True)]
    assert titles == ["top tenth: uniform 0.10", *shares]
    assert [ax.get_ylabel() for ax in figure.axes].count("α (attention weight)") == 1  # one colour bar for all words


def test_visualize_module_does_not_import_matplotlib():
    code = "import sys, captioner.visualize; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_an_empty_caption_gives_the_image_alone():
    sheet = attention_grid(photo("chelsea"), [], torch.zeros(0, 49), (7, 7))
    assert count_tiles(sheet, photo("chelsea")) == 1


@pytest.mark.parametrize(("size", "tile_size"), [((400, 200), (192, 96)), ((150, 300), (96, 192))])
def test_tiles_keep_the_photo_s_aspect_ratio(size, tile_size):
    """The attention grid covers the whole photo (the encoder squashes it, it does not crop), so a 2:1 photo's tiles
    are 2:1, and the grid's left column lies over the photo's left half."""
    image = Image.new("RGB", size, (200, 200, 200))
    left = torch.tensor([1.0, 0.0, 1.0, 0.0])  # the left column of a 2x2 grid
    sheet = np.asarray(attention_grid(image, ["left"], left.unsqueeze(0), (2, 2)))
    width, height = tile_size
    assert sheet.shape[0] == 22 + height + 24  # one row of tiles, then the colour bar
    tile = sheet[22 : 22 + height, width : 2 * width]  # the word's tile, right of the photo's
    assert tile[:, : width // 2 - 16].mean() > 150 and tile[:, width // 2 + 16 :].mean() < 80


@pytest.mark.parametrize(
    "caption",
    ["một con chó đen", "ein schöner Hund, façade, Ærø", "собака на траве", "ένας σκύλος", "a red circle"],
    ids=["vietnamese", "latin", "cyrillic", "greek", "english"],
)
def test_labels_of_every_script_the_tokenizer_keeps_are_drawn_from_the_bundled_font(caption):
    """Not PIL's default font, which draws "một con chó đen" as "m□t con ch□ □en"."""
    from captioner.visualize import FONT, _draws, label_font

    font = label_font(caption)
    assert font.path == str(FONT) and _draws(font, caption)
    assert not _draws(font, "\U000f0001")  # the check can fail: a character no font has


def test_a_script_the_bundled_font_lacks_takes_a_system_font_or_is_said_once(caplog):
    from captioner.visualize import FONT, _draws, label_font

    with caplog.at_level("WARNING", logger="captioner.visualize"):
        font = label_font("一只黑狗")
    if font.path != str(FONT):  # a system font with Chinese (fonts-noto-cjk, say)
        assert _draws(font, "一只黑狗") and not caplog.records
    else:
        assert [r.getMessage() for r in caplog.records] == [
            "no font here draws '一只狗黑': install one that does (Debian: fonts-noto-cjk) to see it in overlays"
        ]


def test_each_tile_can_be_titled_with_its_word_s_top_tenth_share():
    """`top_tenth_share` is `metrics.peakedness`'s first figure; with `peaks` (the default) only the titles change."""
    from captioner.metrics import peakedness
    from captioner.visualize import top_tenth_share

    alphas = torch.softmax(3 * torch.randn(4, 49), dim=-1)
    assert [top_tenth_share(a) for a in alphas] == pytest.approx(peakedness(alphas)[0].tolist(), abs=1e-6)
    assert top_tenth_share(torch.ones(49)) == pytest.approx(5 / 49) and top_tenth_share(torch.eye(49)[3]) == 1.0
    image = photo("chelsea")
    titled, plain = (np.asarray(attention_grid(image, list("abcd"), alphas, (7, 7), peaks=p)) for p in (True, False))
    assert titled.shape == plain.shape
    rows = np.any(titled != plain, axis=(1, 2))
    assert rows[:22].any() and not rows[22:].any()  # one row of five tiles: its titles differ, not its tiles or bar
