"""Per-word attention overlays, as in the paper's figures: where the model looked for each word.

`overlay_attention` and `attention_grid` need only PIL and numpy; `plot_attention` imports matplotlib when called,
so `import captioner` never pulls in plotting code.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import cache, lru_cache
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from captioner.errors import ConfigError, install_hint

log = logging.getLogger(__name__)

# Labels are drawn in DejaVu Sans, shipped with the package (assets/LICENSE-DejaVu.txt): Latin with any diacritics,
# Greek, Cyrillic and more. For scripts it lacks (Chinese, Japanese, Korean...), a font of the system that has them.
FONT = Path(__file__).parent / "assets" / "DejaVuSans.ttf"
FALLBACK_FONTS = (  # Debian's fonts-noto-cjk, fonts-wqy-zenhei, fonts-droid-fallback; macOS; Windows
    "/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc",
    "/usr/share/fonts/truetype/wqy/wqy-zenhei.ttc",
    "/usr/share/fonts/truetype/droid/DroidSansFallbackFull.ttf",
    "/System/Library/Fonts/PingFang.ttc",
    "C:/Windows/Fonts/msyh.ttc",
)
LABEL_SIZE = 13


@cache
def _font(path: str, size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.truetype(path, size)


def _draws(font: ImageFont.FreeTypeFont, text: str) -> bool:
    """Whether `font` has a glyph for every character of `text` (a missing one draws as the font's empty box)."""
    box = font.getmask("\U000f0000")  # a private-use character: no font draws it
    missing = (box.size, bytes(box))
    return all(ch.isspace() or (mask.size, bytes(mask)) != missing for ch in set(text) for mask in [font.getmask(ch)])


@lru_cache(maxsize=1024)
def label_font(text: str, size: int = LABEL_SIZE) -> ImageFont.FreeTypeFont:
    """The font that draws `text`: DejaVu Sans, or else the first system font of `FALLBACK_FONTS` that draws it all;
    where none does, DejaVu Sans, and one log line naming what cannot be drawn (its letters show as boxes)."""
    font = _font(str(FONT), size)
    if _draws(font, text):
        return font
    for path in FALLBACK_FONTS:
        if Path(path).is_file() and _draws(_font(path, size), text):
            return _font(path, size)
    lacking = "".join(sorted({ch for ch in text if not ch.isspace() and not _draws(font, ch)}))[:20]
    log.warning("no font here draws %r: install one that does (Debian: fonts-noto-cjk) to see it in overlays", lacking)
    return font


def _numpy(values: torch.Tensor | np.ndarray) -> np.ndarray:
    return np.asarray(values.detach().cpu() if isinstance(values, torch.Tensor) else values)


def upsample(alpha: torch.Tensor | np.ndarray, grid_hw: tuple[int, int], size: tuple[int, int]) -> np.ndarray:
    """Upsample one word's attention (P,) on a (h,w) grid smoothly (bicubic) to an (H,W) array for an image of size
    (W,H). The values stay α's own: each pixel holds about the weight of the grid cell it lies in."""
    grid = _numpy(alpha).astype(np.float32)
    heat = Image.fromarray(grid.reshape(grid_hw), mode="F").resize(size, Image.Resampling.BICUBIC)
    return np.clip(np.asarray(heat, dtype=np.float64), 0.0, None)  # bicubic overshoots slightly below zero


def attention_map(alpha: torch.Tensor | np.ndarray, grid_hw: tuple[int, int], size: tuple[int, int]) -> np.ndarray:
    """`upsample`, normalised: an (H,W) array, non-negative and summing to 1 (the attention's share per pixel)."""
    heat = upsample(alpha, grid_hw, size)
    total = heat.sum()
    return heat / total if total > 0 else np.full(heat.shape, 1.0 / heat.size)


def overlay_attention(
    image: Image.Image,
    alpha: torch.Tensor | np.ndarray,
    grid_hw: tuple[int, int],
    scale: float | None = None,
    floor: float = 0.2,
) -> Image.Image:
    """The image, dimmed where the word's attention is low: brightness = floor + (1 - floor) * min(α / scale, 1),
    with α upsampled (`upsample`).

    `scale` is the α shown at full brightness. Give every word of an image the same one (`attention_grid` uses their
    largest α) so that their overlays compare. None scales this word to its own largest α: per-word normalisation,
    which makes diffuse attention look sharp.
    """
    image = image.convert("RGB")
    heat = upsample(alpha, grid_hw, image.size)
    top = scale if scale is not None else heat.max()
    weight = floor + (1.0 - floor) * np.clip(heat / max(top, 1e-12), 0.0, 1.0)  # (H,W) in [floor, 1]
    pixels = np.asarray(image, dtype=np.float32) * weight[..., None]
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8), "RGB")


def top_tenth_share(alpha: torch.Tensor | np.ndarray) -> float:
    """The share of a word's attention (P,) in its strongest tenth of the cells, ceil(P/10) of them: 1 for attention
    on one cell, about 0.1 for uniform attention (`captioner.metrics.peakedness`'s first figure)."""
    alpha = _numpy(alpha).astype(np.float64).ravel()
    top = np.sort(alpha)[::-1][: -(-alpha.size // 10)].sum()
    return float(top / alpha.sum()) if alpha.sum() > 0 else 0.0


def common_scale(alphas: torch.Tensor | np.ndarray, per_word: bool) -> float | None:
    """The one α that every word's overlay shows at full brightness: the largest of all words; None with per_word (or
    no words)."""
    alphas = _numpy(alphas)
    return None if per_word or alphas.size == 0 else float(alphas.max())


def attention_grid(
    image: Image.Image,
    words: Sequence[str],
    alphas: torch.Tensor | np.ndarray,
    grid_hw: tuple[int, int],
    tile: int = 192,
    columns: int = 5,
    per_word: bool = False,
    peaks: bool = True,
) -> Image.Image:
    """One PNG-ready picture: the image, then one overlay tile per word, each titled with its word and (`peaks`) the
    share of its attention in its strongest tenth of the cells (`top_tenth_share`; the image's tile gives uniform
    attention's, about 0.10), and under them a colour bar: every word on one scale, from α = 0 to the largest α of
    any word (`per_word` scales each word to its own largest α instead, and the bar says so). Tiles keep the image's
    aspect ratio, `tile` pixels on the longer side: the attention grid covers the whole image (the encoder's input is
    the image squashed to a square, not cropped), so it is stretched back over the image as it is."""
    if len(alphas) < len(words):
        raise ValueError(f"{len(words)} words but only {len(alphas)} attention maps")
    title_height, bar_height, floor = 22, 24, 0.2
    scale = common_scale(alphas[: len(words)], per_word)
    W, H = image.size
    width, height = (tile, max(1, round(tile * H / W))) if W >= H else (max(1, round(tile * W / H)), tile)
    thumb = image.convert("RGB").resize((width, height), Image.Resampling.BICUBIC)
    titles = [f"{word} {top_tenth_share(alphas[i]):.2f}" if peaks else word for i, word in enumerate(words)]
    uniform = top_tenth_share(np.ones(grid_hw[0] * grid_hw[1]))
    tiles = [(f"top tenth: uniform {uniform:.2f}" if peaks and len(words) else "", thumb)] + [
        (title, overlay_attention(thumb, alphas[i], grid_hw, scale, floor)) for i, title in enumerate(titles)
    ]
    rows = -(-len(tiles) // columns)
    sheet = Image.new("RGB", (max(columns * width, 360), rows * (height + title_height) + bar_height), "white")
    draw = ImageDraw.Draw(sheet)
    font = label_font(" ".join(words))
    for k, (word, picture) in enumerate(tiles):
        x, y = (k % columns) * width, (k // columns) * (height + title_height)
        draw.text((x + 4, y + 3), word, fill="black", font=font)
        sheet.paste(picture, (x, y + title_height))
    y = rows * (height + title_height) + 6
    font = label_font("")
    top = "each word's own largest α" if scale is None else f"{scale:.3f}"
    draw.text((4, y), "attention α: 0", fill="black", font=font)
    for i in range(200):  # the bar, from the darkest overlay to the brightest
        level = round(255 * (floor + (1 - floor) * i / 199))
        draw.line([(130 + i, y), (130 + i, y + 12)], fill=(level, level, level))
    draw.text((340, y), top, fill="black", font=font)
    return sheet


def plot_attention(
    image: Image.Image,
    words: Sequence[str],
    alphas: torch.Tensor | np.ndarray,
    grid_hw: tuple[int, int] | None = None,
    columns: int = 5,
    per_word: bool = False,
    peaks: bool = True,
):
    """A matplotlib Figure with the image and one overlay per word (titled with the word and, with `peaks`, the share
    of its attention in its strongest tenth of the cells, `top_tenth_share`: uniform attention's is in the image's
    title), every word on one colour scale of α with a colour bar (`per_word`: each word on its own scale, without a
    bar)."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(f"plot_attention needs matplotlib: {install_hint('plot')}") from None

    alphas = _numpy(alphas)[: len(words)]
    if grid_hw is None:
        side = round(alphas.shape[-1] ** 0.5)
        grid_hw = (side, side)
    panels = len(words) + 1
    rows = -(-panels // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(2.4 * columns, 2.6 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    image = image.convert("RGB")
    axes.flat[0].imshow(image)
    if peaks and len(words):
        axes.flat[0].set_title(f"top tenth: uniform {top_tenth_share(np.ones(grid_hw[0] * grid_hw[1])):.2f}")
    scale = common_scale(alphas, per_word)
    for i, word in enumerate(words, start=1):
        ax = axes.flat[i]
        ax.imshow(image)
        heat = upsample(alphas[i - 1], grid_hw, image.size)
        shown = ax.imshow(heat, cmap="inferno", alpha=0.6, vmin=0, vmax=scale if scale is not None else heat.max())
        ax.set_title(f"{word} {top_tenth_share(alphas[i - 1]):.2f}" if peaks else word)
    figure.tight_layout()
    if scale is not None and len(words):
        figure.colorbar(shown, ax=axes.ravel().tolist(), shrink=0.6, label="α (attention weight)")
    return figure
