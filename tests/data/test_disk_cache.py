"""What the two disk caches share (`captioner.data.disk_cache`): a rebuild never shows a complete-looking cache, and
under DDP every rank uses what local rank 0 built, or all fall back together."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from captioner.data.datamodules import ShapesDataModule
from captioner.data.disk_cache import shared
from captioner.data.features import FeatureCache
from captioner.data.image_cache import ImageCache
from captioner.models.encoder import Encoder


@pytest.fixture(scope="module")
def encoder() -> Encoder:
    return Encoder("efficientnet_lite0").eval()


def built(kind: str, tmp_path, encoder) -> tuple[FeatureCache | ImageCache, object]:
    source = ShapesDataModule(str(tmp_path), train_size=8, val_size=4, test_size=4, canvas_size=64).split("val")
    root = tmp_path / ("features" if kind == "feature" else "image_cache")
    cache = (
        FeatureCache(root, encoder, source) if kind == "feature" else ImageCache(root, encoder.preprocessing, source)
    )
    cache.ensure()
    return cache, source


@pytest.mark.parametrize("kind", ["image", "feature"])
def test_a_rebuild_never_shows_a_complete_marker_beside_its_new_data(tmp_path, encoder, monkeypatch, kind):
    """A damaged cache is built again: its marker (the image cache's offsets, the feature cache's array) is removed
    before anything is written, so that no reader pairs the old marker with data being replaced."""
    cache, source = built(kind, tmp_path, encoder)
    if kind == "image":
        with open(cache.data, "ab") as file:
            file.write(b"x")  # its offsets no longer describe it
    else:
        np.save(cache.path, np.load(cache.path)[:-1])  # the wrong shape
    assert cache.problem().startswith("damaged")
    seen, load = [], type(source).load_image

    def watching(self, index):
        seen.append(cache.marker.exists())
        return load(self, index)

    monkeypatch.setattr(type(source), "load_image", watching)
    cache.ensure()
    assert seen and not any(seen) and cache.problem() is None


class Strategy:
    """Two ranks: this one, and another whose outcome is `other`."""

    def __init__(self, other: bool):
        self.other, self.root_device, self.barriers = other, torch.device("cpu"), []

    def barrier(self, name=None):
        self.barriers.append(name)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return (decision and self.other) if all else (decision or self.other)


class Trainer:
    def __init__(self, local_rank: int, other: bool):
        self.world_size, self.local_rank, self.strategy = 2, local_rank, Strategy(other)


def test_a_rank_whose_rank_0_could_not_build_the_cache_neither_builds_nor_uses_it(tmp_path, encoder):
    """Rank 1 of a run whose rank 0 could not write the feature cache (a full disk): it waits at the barrier, only
    opens what rank 0 built (nothing), and with every rank falls back to images; before, it built the cache itself,
    and trained on other inputs than rank 0."""
    module = ShapesDataModule(str(tmp_path), 8, 4, 4, canvas_size=64, num_workers=0)
    module.set_encoder(encoder)
    module.setup("fit")
    module.trainer = Trainer(local_rank=1, other=False)
    module.image_cache = False
    loader = module.val_dataloader()
    assert loader.dataset.inputs.kind == "files" and not list((tmp_path / "features").rglob("annotations.npy"))
    assert module.trainer.strategy.barriers == ["feature cache"]


def test_every_rank_uses_the_cache_that_rank_0_built_or_all_fall_back(tmp_path, encoder, caplog):
    cache, _ = built("feature", tmp_path, encoder)
    assert shared(cache, Trainer(local_rank=1, other=True), "files instead")  # rank 0 built it: opened
    assert not shared(cache, Trainer(local_rank=1, other=False), "files instead")  # another rank cannot use it
    assert "another process cannot use the feature cache; files instead, in every process" in caplog.text
    assert not shared(cache, Trainer(local_rank=0, other=False), "files instead")
