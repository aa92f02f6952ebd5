from captioner.data.datamodules import CaptionDataModule, ShapesDataModule
from captioner.data.shapes import ShapesDataset
from captioner.data.vocab import Vocabulary, tokenize

__all__ = ["CaptionDataModule", "ShapesDataModule", "ShapesDataset", "Vocabulary", "tokenize"]
