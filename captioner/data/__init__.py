"""Datasets and datamodules. The datamodules import Lightning, so they load on first use, not with the package."""

from captioner.data.shapes import ShapesDataset
from captioner.data.vocab import Vocabulary, tokenize

__all__ = ["CaptionDataModule", "ShapesDataModule", "ShapesDataset", "Vocabulary", "tokenize"]


def __getattr__(name: str):
    if name in ("CaptionDataModule", "ShapesDataModule"):
        from captioner.data import datamodules

        return getattr(datamodules, name)
    raise AttributeError(f"module 'captioner.data' has no attribute {name!r}")
