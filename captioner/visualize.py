"""Per-word attention overlays, as in the paper's figures: where the model looked for each word.

`overlay_attention` and `attention_grid` need only PIL and numpy; `plot_attention` imports matplotlib when called,
so `import captioner` never pulls in plotting code.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont


def attention_map(alpha: torch.Tensor | np.ndarray, grid_hw: tuple[int, int], size: tuple[int, int]) -> np.ndarray:
    """Upsample one word's attention (P,) on a (h,w) grid smoothly (bicubic) to an image of size (W,H).

    Returns an (H,W) float array, non-negative and summing to 1.
    """
    grid = np.asarray(alpha.detach().cpu() if isinstance(alpha, torch.Tensor) else alpha, dtype=np.float32)
    grid = grid.reshape(grid_hw)
    heat = np.asarray(Image.fromarray(grid, mode="F").resize(size, Image.Resampling.BICUBIC), dtype=np.float64)
    heat = np.clip(heat, 0.0, None)  # bicubic overshoots slightly below zero
    total = heat.sum()
    return heat / total if total > 0 else np.full(heat.shape, 1.0 / heat.size)


def overlay_attention(
    image: Image.Image, alpha: torch.Tensor | np.ndarray, grid_hw: tuple[int, int], floor: float = 0.2
) -> Image.Image:
    """The image, dimmed where the word's attention is low: brightness = floor + (1 - floor) * attention / max."""
    image = image.convert("RGB")
    heat = attention_map(alpha, grid_hw, image.size)
    weight = floor + (1.0 - floor) * heat / heat.max()  # (H,W) in [floor, 1]
    pixels = np.asarray(image, dtype=np.float32) * weight[..., None]
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8), "RGB")


def attention_grid(
    image: Image.Image,
    words: Sequence[str],
    alphas: torch.Tensor | np.ndarray,
    grid_hw: tuple[int, int],
    tile: int = 192,
    columns: int = 5,
) -> Image.Image:
    """One PNG-ready picture: the image, then one overlay tile per word, each titled with its word."""
    if len(alphas) < len(words):
        raise ValueError(f"{len(words)} words but only {len(alphas)} attention maps")
    title_height = 22
    thumb = image.convert("RGB").resize((tile, tile), Image.Resampling.BICUBIC)
    tiles = [("", thumb)] + [(word, overlay_attention(thumb, alphas[i], grid_hw)) for i, word in enumerate(words)]
    rows = -(-len(tiles) // columns)
    sheet = Image.new("RGB", (columns * tile, rows * (tile + title_height)), "white")
    draw = ImageDraw.Draw(sheet)
    font = ImageFont.load_default()
    for k, (word, picture) in enumerate(tiles):
        x, y = (k % columns) * tile, (k // columns) * (tile + title_height)
        draw.text((x + 4, y + 4), word, fill="black", font=font)
        sheet.paste(picture, (x, y + title_height))
    return sheet


def plot_attention(
    image: Image.Image,
    words: Sequence[str],
    alphas: torch.Tensor | np.ndarray,
    grid_hw: tuple[int, int] | None = None,
    columns: int = 5,
):
    """A matplotlib Figure with the image and one overlay per word (titled with the word)."""
    import matplotlib.pyplot as plt

    alphas = np.asarray(alphas.detach().cpu() if isinstance(alphas, torch.Tensor) else alphas)
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
    for i, word in enumerate(words, start=1):
        ax = axes.flat[i]
        ax.imshow(image)
        ax.imshow(attention_map(alphas[i - 1], grid_hw, image.size), cmap="gray", alpha=0.7)
        ax.set_title(word)
    figure.tight_layout()
    return figure
