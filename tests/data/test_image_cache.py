"""The image cache (`captioner.data.image_cache`): the split's images resized once and kept as JPEG in one file, read
by the loaders where the encoder runs on images; its disk need said and checked before a build; damage reported and
built again; a kill mid-build leaves no cache that looks complete; unreadable images skipped."""

import json
import logging
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from captioner.data import disk_cache, image_cache
from captioner.data.datamodules import CocoDataModule, ShapesDataModule
from captioner.data.image_cache import ImageCache
from captioner.models.encoder import Encoder


@pytest.fixture(scope="module")
def encoder() -> Encoder:
    return Encoder("efficientnet_lite0").eval()


def image_module(data_dir, encoder, **options) -> ShapesDataModule:
    """Shapes whose encoder runs on images (no feature cache), read from the image cache, set up for fit."""
    options = {"feature_cache": False, "image_cache": True, "num_workers": 0, "batch_size": 4} | options
    module = ShapesDataModule(str(data_dir), train_size=8, val_size=6, test_size=4, canvas_size=96, **options)
    module.set_encoder(encoder)
    module.setup("fit")
    return module


def test_batches_from_the_image_cache_are_the_resized_images_to_jpeg_s_rounding(tmp_path, encoder):
    """The loader's images are the same images resized (uint8, which the encoder normalises), to within quality 95's
    rounding (a few of 255 per pixel); the batches otherwise as they are from the files (captions, order); a second
    run reads the cache the first built."""
    cached, plain = image_module(tmp_path / "a", encoder), image_module(tmp_path / "b", encoder, image_cache=False)
    for split in ("train", "val"):
        torch.manual_seed(0)
        got = list(cached.train_dataloader() if split == "train" else cached.val_dataloader())
        torch.manual_seed(0)
        want = list(plain.train_dataloader() if split == "train" else plain.val_dataloader())
        assert cached.datasets[split].inputs.kind == "image cache" and plain.datasets[split].inputs.kind == "files"
        for a, b in zip(got, want, strict=True):
            assert a.keys() == b.keys() and a["images"].shape == b["images"].shape == (len(a["index"]), 3, 224, 224)
            assert a["images"].dtype == b["images"].dtype == torch.uint8  # the encoder normalises them
            assert torch.equal(a["captions"], b["captions"]) and torch.equal(a["index"], b["index"])
            difference = (a["images"].int() - b["images"].int()).abs().float()  # in pixel levels
            assert 0 < difference.mean() < 6 and difference.max() < 100  # sharp drawn edges: JPEG's worst case
    folders = sorted(p for p in (tmp_path / "a" / "image_cache").iterdir() if p.is_dir())
    assert len(folders) == 2 and all(
        cached.split(split).identity in folders[i].name for i, split in enumerate(["train", "val"])
    )
    written = {p: p.stat().st_mtime_ns for folder in folders for p in folder.iterdir()}
    again = image_module(tmp_path / "a", encoder)
    next(iter(again.train_dataloader()))
    assert {p: p.stat().st_mtime_ns for folder in folders for p in folder.iterdir()} == written


def test_loader_workers_read_the_image_cache(tmp_path, encoder):
    module = image_module(tmp_path, encoder, num_workers=2)
    loader = module.val_dataloader()
    assert loader.num_workers == 2
    batches = list(loader)
    module.num_workers = 0
    assert all(torch.equal(a["images"], b["images"]) for a, b in zip(batches, module.val_dataloader(), strict=True))


def test_the_disk_need_is_said_and_checked_before_a_build(tmp_path, encoder, caplog, monkeypatch):
    """Before anything is written: one info line with the images, their size and the estimated need; too little
    space gives one warning, no file, and images read from their files."""
    source = ShapesDataModule(str(tmp_path), train_size=8, val_size=6, test_size=4, canvas_size=96).split("val")
    cache = ImageCache(tmp_path / "image_cache", encoder.preprocessing, source)
    estimate = cache.estimate()
    with caplog.at_level(logging.INFO, logger="captioner.data"):
        cache.ensure()
    (said,) = [r.getMessage() for r in caplog.records if r.name == "captioner.data.disk_cache"]
    assert said.startswith(f"image cache of {source.identity}: 6 images at 224x224, JPEG quality 95; about ")
    assert 0.8 * estimate < cache.data.stat().st_size < estimate  # a margin of 10% over the sample's mean

    full = type(shutil.disk_usage(tmp_path))(total=10**9, used=10**9 - 1000, free=1000)
    monkeypatch.setattr(disk_cache.shutil, "disk_usage", lambda path: full)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="captioner.data"):
        module = image_module(tmp_path / "full", encoder)
        module.val_dataloader()
    (folder,) = [p for p in (tmp_path / "full" / "image_cache").iterdir() if p.is_dir()]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"{folder}: cannot write the image cache (no space left: it needs about {disk_cache.size(estimate)}, "
        "0.0 MiB are free); images are read from their files instead"
    ]
    assert module.datasets["val"].inputs.kind == "files" and list(folder.iterdir()) == []


def test_a_feature_cache_that_does_not_fit_falls_back_to_the_image_cache(tmp_path, encoder, caplog, monkeypatch):
    """The paper's configuration at COCO's size: its annotations do not fit on the disk, its JPEG images do."""
    usage = shutil.disk_usage
    full = type(usage(tmp_path))(total=10**9, used=10**9 - 1000, free=1000)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: full if "features" in str(path) else usage(path))
    with caplog.at_level(logging.WARNING, logger="captioner.data"):
        module = image_module(tmp_path, encoder, feature_cache=True)
        module.val_dataloader()
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "cannot write the feature cache (no space left" in warning
    assert warning.endswith("; the encoder will run at every step instead (on the image cache)")
    inputs = module.datasets["val"].inputs
    assert inputs.key == "images" and inputs.kind == "image cache" and inputs.images.problem() is None


def damage_offsets(cache: ImageCache) -> None:
    np.save(cache.offsets_path, np.load(cache.offsets_path)[:-1])


def truncate_data(cache: ImageCache) -> None:
    cache.data.write_bytes(cache.data.read_bytes()[:100])


def corrupt_meta(cache: ImageCache) -> None:
    cache.meta.write_text('{"bad": [')


@pytest.mark.parametrize("damage", [damage_offsets, truncate_data, corrupt_meta])
def test_a_damaged_image_cache_is_said_and_built_again(tmp_path, encoder, caplog, damage):
    module = image_module(tmp_path, encoder)
    module.val_dataloader()
    cache = module.datasets["val"].inputs.images
    want = cache.data.read_bytes()
    damage(cache)
    assert cache.problem().startswith("damaged (")
    with caplog.at_level(logging.WARNING, logger="captioner.data"):
        again = ImageCache(cache.dir.parent, encoder.preprocessing, cache.source)
        again.ensure()
    (said,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert said.startswith(f"{cache.dir}: image cache damaged (") and said.endswith("); building it again")
    assert again.problem() is None and cache.data.read_bytes() == want


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_build_that_fails_midway_leaves_no_cache_and_no_temporary_file(tmp_path, encoder, monkeypatch, failure):
    source = ShapesDataModule(str(tmp_path), train_size=8, val_size=6, test_size=4, canvas_size=96).split("val")
    cache = ImageCache(tmp_path / "image_cache", encoder.preprocessing, source)
    encode = image_cache._Encoded.__getitem__

    def fail(self, index):
        if index == 4:
            assert list(cache.dir.glob("images.*.tmp"))  # the data file being written
            raise failure
        return encode(self, index)

    monkeypatch.setattr(image_cache._Encoded, "__getitem__", fail)
    monkeypatch.setattr(ImageCache, "estimate", lambda self: 0)
    with pytest.raises(type(failure)):
        cache.ensure()
    assert cache.problem() == "missing" and sorted(p.name for p in cache.dir.iterdir()) == []


def test_unreadable_images_are_said_once_skipped_and_remembered(tmp_path, encoder, caplog):
    """A Karpathy split with a broken file: one warning when the cache is built, the image left out of every batch,
    and its index kept in meta.json, so that a later run skips it without reading it."""
    root = tmp_path / "data"
    (root / "images").mkdir(parents=True)
    images = []
    for i in range(6):
        Image.new("RGB", (60, 40), (40 * i, 100, 200)).save(root / "images" / f"{i}.jpg")
        images.append({"filename": f"{i}.jpg", "split": "val", "sentences": [{"raw": f"a photo number {i}"}]})
    images.append({"filename": "0.jpg", "split": "train", "sentences": [{"raw": "a photo"}]})
    (root / "dataset.json").write_text(json.dumps({"images": images}))
    module = CocoDataModule(
        str(root), split_file="dataset.json", image_root="images", min_word_count=1, num_workers=0, batch_size=8
    )
    module.feature_cache, module.image_cache = False, True
    module.set_encoder(encoder)
    module.setup("validate")
    (root / "images" / "3.jpg").write_bytes(b"not a jpeg")  # broken after the split was read
    with caplog.at_level(logging.WARNING):
        (batch,) = list(module.val_dataloader())
    assert [r.getMessage() for r in caplog.records if "3.jpg" in r.getMessage()] == [
        f"skipping {root / 'images' / '3.jpg'}: not an image file PIL can read"
    ]
    assert batch["index"].tolist() == [0, 1, 2, 4, 5]
    cache = module.datasets["val"].inputs.images
    assert json.loads(cache.meta.read_text())["bad"] == [3]


def test_images_stored_channel_last_are_stacked_as_stored():
    """`stack`: the same batch as torch.stack, in channels-last memory when each image is a view of pixels stored
    channel last (as `ToImage` makes them from PIL images); other inputs stacked as torch.stack stacks them."""
    from captioner.data.dataset import stack

    pixels = [torch.randint(0, 256, (5, 7, 3), dtype=torch.uint8).permute(2, 0, 1) for _ in range(4)]
    batch = stack(pixels)
    assert torch.equal(batch, torch.stack(pixels)) and batch.is_contiguous(memory_format=torch.channels_last)
    rows = [torch.randn(6, 8) for _ in range(3)]
    assert torch.equal(stack(rows), torch.stack(rows)) and stack(rows).is_contiguous()
    contiguous = [p.contiguous() for p in pixels]
    assert stack(contiguous).is_contiguous() and torch.equal(stack(contiguous), torch.stack(pixels))


def test_the_cache_stores_the_pixels_that_the_model_gets_from_the_file(tmp_path, monkeypatch):
    """For the same photo files (of several sizes and shapes), the pixels that the datamodule's image cache stores,
    before JPEG, are those that `Captioner.caption` feeds the model, normalised alike (format 1 resized them with
    PIL's filter instead)."""
    from captioner.api import Captioner
    from captioner.data.vocab import Vocabulary
    from tests.datasets import write_custom
    from tests.helpers import V, small_model

    write_custom(tmp_path)  # photos of several sizes, in files
    model = small_model()
    stored = []  # (S,S,3) uint8, as the cache's build hands them to the JPEG encoder
    fromarray = image_cache.Image.fromarray
    monkeypatch.setattr(image_cache.Image, "fromarray", lambda pixels: stored.append(pixels) or fromarray(pixels))
    options = {"feature_cache": False, "image_cache": True, "num_workers": 0, "test_fraction": 0.0, "val_fraction": 0.5}
    module = CocoDataModule(str(tmp_path), format="custom", **options)
    module.set_encoder(model.encoder)
    module.setup("fit")
    module.val_dataloader()  # builds the val split's image cache
    source = module.split("val")
    stored = stored[-len(source) :]  # the build's own, after the sample that estimated its size
    assert len(source) > 1

    fed = []  # what the Captioner's model gets: normalised floats (B,3,S,S)
    captioner = Captioner(model, Vocabulary([f"w{i}" for i in range(V - 4)]), device="cpu")  # V ids, 4 special
    generate = captioner.model.generate
    monkeypatch.setattr(captioner.model, "generate", lambda images, **o: fed.append(images) or generate(images, **o))
    captioner.caption([str(source.image(i)) for i in range(len(source))], beam_size=1, max_len=2)
    normalize = model.encoder.preprocessing.normalize
    for pixels, image in zip(stored, torch.cat(fed), strict=True):
        assert torch.equal(normalize(torch.from_numpy(pixels).permute(2, 0, 1)), image)
    assert image_cache.FORMAT == 2  # caches of format 1 are built again, not reused
