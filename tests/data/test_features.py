"""The frozen encoder's feature cache: a damaged cache on disk is reported and built again, never read."""

import json
import logging
import re

import numpy as np
import pytest
import torch

from captioner.data.datamodules import ShapesDataModule
from captioner.data.features import FeatureCache
from captioner.models.encoder import Encoder


@pytest.fixture(scope="module")
def encoder() -> Encoder:
    return Encoder("efficientnet_lite0").eval()


def cached_module(data_dir, encoder) -> tuple[ShapesDataModule, FeatureCache]:
    """A datamodule whose validation split (4 images) is set up, and so cached, and its cache."""
    module = ShapesDataModule(str(data_dir), train_size=4, val_size=4, test_size=4, num_workers=0)
    module.set_encoder(encoder)
    module.setup("validate")
    return module, FeatureCache(data_dir / "features", encoder, module.split("val"))


def annotations(module: ShapesDataModule) -> torch.Tensor:
    """What the validation split gives the model: every image's (P,E) annotations, from the cache."""
    dataset = module.datasets["val"]
    assert dataset.inputs.key == "annotations"
    return torch.stack([dataset[i]["input"] for i in range(len(dataset))])


def truncate(cache: FeatureCache) -> None:
    cache.path.write_bytes(cache.path.read_bytes()[:1000])  # as a full disk or an interrupted copy leaves it


def wrong_shape(cache: FeatureCache) -> None:
    np.save(cache.path, np.zeros((3, 2, 5), dtype=np.float16))


def corrupt_meta(cache: FeatureCache) -> None:
    (cache.dir / "meta.json").write_text('{"bad": [')


@pytest.mark.parametrize(
    ("damage", "pattern"),
    [
        (truncate, r"damaged \(.*file size.*\)"),  # numpy's words
        (wrong_shape, r"damaged \(a float16 array of shape \(3, 2, 5\), not float16 \(4, 49, 1280\)\)"),
        (corrupt_meta, r"damaged \(Expecting value: .*\)"),  # json's
    ],
)
def test_a_damaged_cache_is_reported_by_file_and_built_again(tmp_path, encoder, caplog, damage, pattern):
    module, cache = cached_module(tmp_path, encoder)
    assert cache.problem() is None
    expected = annotations(module)
    damage(cache)
    reason = cache.problem()
    assert re.fullmatch(pattern, reason), reason

    with caplog.at_level(logging.WARNING, logger="captioner.data.datamodules"):
        again, _ = cached_module(tmp_path, encoder)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"{cache.path}: feature cache {reason}; building it again"]
    assert cache.problem() is None
    assert json.loads((cache.dir / "meta.json").read_text())["bad"] == []
    assert torch.equal(annotations(again), expected)  # the same as the first build's


def test_a_missing_cache_is_built_without_a_warning(tmp_path, encoder, caplog):
    with caplog.at_level(logging.WARNING, logger="captioner.data.datamodules"):
        _, cache = cached_module(tmp_path, encoder)
    assert cache.problem() is None and cache.exists
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert FeatureCache(tmp_path / "elsewhere", encoder, cache.source).problem() == "missing"
