"""The captioner's page, which `captioner serve` serves and `captioner export --format web` writes: its files
(captioner/static: index.html and page.js, and where captions come from, server.js or web/source.js) and its example
images."""

from __future__ import annotations

import io
from pathlib import Path

from captioner.data.shapes import ShapesDataset

STATIC = Path(__file__).parent / "static"


def example_images(card: dict, count: int = 4) -> dict[str, bytes]:
    """The page's examples: the photos a model's card names (`examples`, paths from the repository's folder; the
    bundled `ucm` names UCM test photos in docs/images/ucm/) where they are, else a few held-out shapes images (the
    bundled `shapes` model's test split, as PNG files)."""
    repository = Path(__file__).resolve().parent.parent
    photos = [repository / name for name in card.get("examples", [])]
    if photos and all(photo.is_file() for photo in photos):
        return {photo.name: photo.read_bytes() for photo in photos}
    split = ShapesDataset("test", count)
    examples = {}
    for index in range(count):
        buffer = io.BytesIO()
        split.load_image(index).save(buffer, format="PNG")
        examples[f"shapes_{index}.png"] = buffer.getvalue()
    return examples
