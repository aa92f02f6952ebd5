"""The frozen encoder's feature cache on real disks: a damaged cache is reported and built again, never read; a cache
that cannot be written (a full disk, a folder that cannot be made) is reported, and training goes on without it."""

import errno
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from functools import partial

import numpy as np
import pytest
import torch

from captioner.data import disk_cache
from captioner.data.datamodules import ShapesDataModule
from captioner.data.features import FeatureCache, reserve
from captioner.errors import CaptionerError
from captioner.models.encoder import Encoder
from tests.conftest import tiny_fit_args


@pytest.fixture(scope="module")
def encoder() -> Encoder:
    return Encoder("efficientnet_lite0").eval()


def cached_module(data_dir, encoder) -> tuple[ShapesDataModule, FeatureCache]:
    """A datamodule whose validation split (4 images) is set up, and so cached, and its cache."""
    module = ShapesDataModule(str(data_dir), train_size=4, val_size=4, test_size=4, num_workers=0)
    module.set_encoder(encoder)
    module.setup("validate")
    module.val_dataloader()  # the cache is built with the loader, from the encoder the model has then
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


def meta_not_a_dict(cache: FeatureCache) -> None:
    (cache.dir / "meta.json").write_text("[1, 2]")


def infinite(cache: FeatureCache) -> None:
    """What an older build wrote for annotations beyond float16's range: inf, which numpy only warns about."""
    array = np.array(cache.load())
    array[-1, 0, 0] = np.inf
    np.save(cache.path, array)


@pytest.mark.parametrize(
    ("damage", "pattern"),
    [
        (truncate, r"damaged \(annotations\.npy: .*file size.*\)"),  # numpy's words
        (wrong_shape, r"damaged \(annotations\.npy is float16 of shape \(3, 2, 5\), not float16 \(4, 49, 1280\)\)"),
        (corrupt_meta, r"damaged \(meta\.json: Expecting value: .*\)"),  # json's
        (meta_not_a_dict, r"damaged \(meta\.json: not a JSON object\)"),
        (infinite, r"damaged \(annotations\.npy holds non-finite values\)"),
    ],
)
def test_a_damaged_cache_is_reported_by_file_and_built_again(tmp_path, encoder, caplog, damage, pattern):
    module, cache = cached_module(tmp_path, encoder)
    assert cache.problem() is None
    expected = annotations(module)
    damage(cache)
    reason = cache.problem()
    assert re.fullmatch(pattern, reason), reason

    with caplog.at_level(logging.WARNING, logger="captioner.data"):
        again, _ = cached_module(tmp_path, encoder)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"{cache.dir}: feature cache {reason}; building it again"]
    assert cache.problem() is None
    assert json.loads((cache.dir / "meta.json").read_text())["bad"] == []
    assert torch.equal(annotations(again), expected)  # the same as the first build's


def test_a_cache_written_before_meta_json_recorded_unreadable_images_is_used_as_it_is(tmp_path, encoder, caplog):
    """A cache whose meta.json has no "bad" (written before it recorded the unreadable images; a COCO cache takes
    hours to build) is opened, not built again."""
    module, cache = cached_module(tmp_path, encoder)
    meta = json.loads(cache.meta.read_text())
    del meta["bad"]
    cache.meta.write_text(json.dumps(meta))
    built = cache.path.stat().st_mtime_ns
    with caplog.at_level(logging.WARNING, logger="captioner.data"):
        again, _ = cached_module(tmp_path, encoder)
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == []
    assert cache.path.stat().st_mtime_ns == built and "bad" not in json.loads(cache.meta.read_text())
    assert torch.equal(annotations(again), annotations(module))


class Scaled:
    """Patches Encoder.forward to multiply the annotations by `factor` from the `after`-th call on: Lite0's
    annotations (at most 6) become as large as an untrained ResNet's."""

    def __init__(self, monkeypatch, factor: float, after: int = 0):
        self.calls, self.factor, self.after = 0, factor, after
        forward = Encoder.forward

        def scaled(encoder, images):
            self.calls += 1
            return forward(encoder, images) * (self.factor if self.calls > self.after else 1.0)

        monkeypatch.setattr(Encoder, "forward", scaled)


@pytest.mark.parametrize("after", [0, 1])
def test_annotations_beyond_float16_are_cached_as_float32_with_one_warning(
    tmp_path, encoder, caplog, monkeypatch, after
):
    """From the first batch on, or from the second (the rows written as float16 are then copied over)."""
    source = ShapesDataModule(str(tmp_path), train_size=4, val_size=4, test_size=4).split("val")
    transform = encoder.preprocessing.transforms()
    with torch.inference_mode():
        plain = encoder(torch.stack([transform(source.load_image(i)) for i in range(4)]))  # (4,P,E)
    Scaled(monkeypatch, 2e4, after)
    cache = FeatureCache(tmp_path / "features", encoder, source)
    with caplog.at_level(logging.WARNING, logger="captioner.data"):
        cache.ensure(batch_size=2)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert re.fullmatch(
        rf"{re.escape(str(cache.dir))}: efficientnet_lite0 annotations reach 1\.\d+e\+05, beyond float16's "
        r"range: the cache is float32 \(twice the disk space\)",
        warning,
    ), warning
    assert cache.problem() is None and cache.load().dtype == np.float32 and cache.dtype() == np.float32
    assert json.loads(cache.meta.read_text())["dtype"] == "float32"
    assert sorted(p.name for p in cache.dir.iterdir()) == ["annotations.npy", "meta.json"]  # no temporary file left
    cached = torch.from_numpy(np.array(cache.load()))
    scaled = slice(2 * after, 4)  # the cache's encoder has its BatchNorms folded: float rounding apart
    assert (cached[scaled] - plain[scaled] * 2e4).abs().max() < 1e-4 * (plain[scaled] * 2e4).abs().max()
    if after:  # the first batch went in as float16, then was copied into the float32 array
        assert torch.allclose(cached[:2], plain[:2], atol=1e-2) and cached[:2].abs().max() > 1


def test_an_encoder_that_gives_non_finite_annotations_is_a_one_line_error(tmp_path, encoder, monkeypatch):
    source = ShapesDataModule(str(tmp_path), train_size=4, val_size=4, test_size=4).split("val")
    Scaled(monkeypatch, float("nan"), after=1)
    cache = FeatureCache(tmp_path / "features", encoder, source)
    message = r"efficientnet_lite0: the encoder gives non-finite annotations for images 2-3 of shapes-v\d-val-\S+; "
    with pytest.raises(CaptionerError, match=message + r"check its weights \(pretrained, fine-tuned\)$"):
        cache.ensure(batch_size=2)
    assert cache.problem() == "missing" and list(cache.dir.iterdir()) == []


def test_a_missing_cache_is_built_without_a_warning(tmp_path, encoder, caplog):
    with caplog.at_level(logging.WARNING, logger="captioner.data"):
        _, cache = cached_module(tmp_path, encoder)
    assert cache.problem() is None and cache.exists
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert FeatureCache(tmp_path / "elsewhere", encoder, cache.source).problem() == "missing"


def fallback_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "cannot write the feature cache" in r.getMessage()]


def test_no_space_for_the_cache_trains_on_without_it(tmp_path, encoder, caplog, monkeypatch):
    """The space is checked before anything is encoded: a memory-mapped write on a full disk would kill the process."""
    full = type(shutil.disk_usage(tmp_path))(total=10**9, used=10**9 - 1000, free=1000)
    monkeypatch.setattr(disk_cache.shutil, "disk_usage", lambda path: full)
    with caplog.at_level(logging.WARNING, logger="captioner.data"):
        module, cache = cached_module(tmp_path, encoder)
    assert fallback_warnings(caplog) == [
        f"{cache.dir}: cannot write the feature cache (no space left: it needs 0.5 MiB, 0.0 MiB are free); the "
        "encoder will run at every step instead"
    ]
    dataset = module.datasets["val"]
    assert dataset.inputs.key == "images"  # the encoder runs on each batch
    assert dataset[0]["input"].shape == (3, 224, 224)
    assert list(cache.dir.iterdir()) == []  # no temporary file left behind


def test_a_cache_folder_that_cannot_be_made_trains_on_without_it(tmp_path, encoder, caplog):
    (tmp_path / "features").write_text("a file where the caches' folder should be")
    with caplog.at_level(logging.WARNING, logger="captioner.data"):
        module, cache = cached_module(tmp_path, encoder)
    assert fallback_warnings(caplog) == [
        f"{cache.dir}: cannot write the feature cache (Not a directory); the encoder will run at every step instead"
    ]
    assert module.datasets["val"].inputs.key == "images"


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_build_that_fails_midway_leaves_no_temporary_file_and_no_cache(tmp_path, encoder, monkeypatch, failure):
    source = ShapesDataModule(str(tmp_path), train_size=4, val_size=4, test_size=4).split("val")
    cache = FeatureCache(tmp_path / "features", encoder, source)

    def fail(*args):
        assert list(cache.dir.glob("*.tmp"))  # the array being written
        raise failure

    monkeypatch.setattr(FeatureCache, "_encode_into", fail)
    with pytest.raises(type(failure)):
        cache.build()
    assert list(cache.dir.iterdir()) == [] and cache.problem() == "missing"


def test_reserving_the_arrays_blocks_ignores_only_what_the_file_system_cannot_do(tmp_path, monkeypatch):
    path = tmp_path / "array.npy"
    path.write_bytes(b"\0" * 4096)
    calls = []

    def fallocate(fd, offset, length, error=None):
        calls.append((offset, length))
        if error is not None:
            raise OSError(error, os.strerror(error))

    monkeypatch.setattr(os, "posix_fallocate", fallocate, raising=False)
    reserve(path)
    assert calls == [(0, 4096)]
    monkeypatch.setattr(os, "posix_fallocate", partial(fallocate, error=errno.EOPNOTSUPP), raising=False)
    reserve(path)  # a file system without fallocate: the write goes on unreserved
    monkeypatch.setattr(os, "posix_fallocate", partial(fallocate, error=errno.ENOSPC), raising=False)
    with pytest.raises(OSError, match="No space left"):
        reserve(path)


LOGGING_CLI = "import logging, sys; logging.basicConfig(level=logging.INFO); from captioner.cli import main; main()"


def test_two_runs_started_at_once_on_one_data_dir_build_each_cache_once(tmp_path):
    """Two `captioner fit` processes need the same caches: one builds each (its log line says so), the other
    waits on the cache's lock file and then reads it. Without the lock both would build, each into its own temporary
    file, both renamed into place."""
    data = tmp_path / "data"

    def start(name: str) -> subprocess.Popen:
        args = [*tiny_fit_args(tmp_path / name), f"--data.init_args.data_dir={data}", "--trainer.max_epochs=1"]
        return subprocess.Popen(
            [sys.executable, "-c", LOGGING_CLI, "fit", *args],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
        )

    runs = [start("a"), start("b")]
    stderr = [run.communicate(timeout=600)[1] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], stderr
    caches = sorted((data / "features").iterdir())
    assert [path.name.split("-")[2] for path in caches if not path.name.startswith(".")] == ["train", "val"]
    for split in ("train", "val"):  # each built by one process
        assert sum(bool(re.search(rf"caching shapes-v\d+-{split}-", err)) for err in stderr) == 1, split
    assert not any("%|" in err for err in stderr)  # the build's progress bar is for terminals only
    module = ShapesDataModule(str(data), train_size=64, val_size=16, test_size=16)
    encoder = Encoder("efficientnet_lite0")
    for split in ("train", "val"):
        cache = FeatureCache(data / "features", encoder, module.split(split))
        assert cache.problem() is None and sorted(p.name for p in cache.dir.iterdir()) == [
            "annotations.npy",
            "meta.json",
        ]


def test_the_cache_is_keyed_on_the_grid(tmp_path):
    """The 7x7 and the 14x14 (feature_stride=16) annotations of one split live in two caches."""
    from captioner.data.shapes import ShapesDataset

    split = ShapesDataset("val", 4)
    coarse, fine = (Encoder("efficientnet_lite0", feature_stride=stride) for stride in (32, 16))
    assert FeatureCache(tmp_path, coarse, split).dir != FeatureCache(tmp_path, fine, split).dir
    cache = FeatureCache(tmp_path, fine, split)
    cache.ensure(batch_size=4, num_workers=0, device="cpu")
    assert cache.load().shape == (4, 196, 112)


@pytest.mark.parametrize("mode", ["all", "random"])
def test_batches_read_in_one_go_from_the_cache_are_the_item_by_item_batches(tmp_path, encoder, mode):
    """`CaptionDataset.__getitems__` (one indexed read of the batch's cache rows, its captions gathered at once) gives,
    for the sampler's order and the same random draws, exactly the batches that loading item by item and collating
    gave before it; training batches carry no references, validation batches carry them. The loaders use it."""
    import random

    from captioner.data.dataset import collate

    module = ShapesDataModule(str(tmp_path), 12, 6, 4, batch_size=5, num_workers=0, train_captions=mode)
    module.set_encoder(encoder)
    module.setup("fit")
    for split in ("train", "val"):
        loader = module.train_dataloader() if split == "train" else module.val_dataloader()
        dataset = loader.dataset
        assert dataset.inputs.key == "annotations"
        torch.manual_seed(0)
        order = list(loader.batch_sampler)
        assert len(order) > 1 and sum(map(len, order)) == len(dataset)
        for step, indices in enumerate(order):
            random.seed(step)
            batch = dataset.__getitems__(indices)
            random.seed(step)
            want = collate([dataset[i] for i in indices])
            assert batch.keys() == want.keys() and ("references" in batch) == (split == "val")
            for key, value in want.items():
                assert torch.equal(batch[key], value) if torch.is_tensor(value) else batch[key] == value, key
        first = next(iter(loader))
        assert first["annotations"].shape[0] == 5 and first.keys() == batch.keys()


def test_a_pinned_read_of_the_cache_gives_the_rows_numpy_reads(tmp_path, encoder, monkeypatch):
    """Where the trainer runs on CUDA, a batch's rows are read by torch straight into memory asked for pinned
    (`Inputs.rows`): the same rows, in the same order, as numpy's indexed read; repeated and unsorted rows too. Checked
    on a CPU with the pinning itself left out (it needs a CUDA driver): the allocation is asked for pinned, and is the
    tensor returned."""
    module = ShapesDataModule(str(tmp_path), 12, 6, 4, batch_size=5, num_workers=0)
    module.set_encoder(encoder)
    module.setup("fit")
    inputs = module.train_dataloader().dataset.inputs
    asked, empty = [], torch.empty

    def unpinned(*args, pin_memory=False, **kwargs):
        asked.append(pin_memory)
        asked.append(empty(*args, **kwargs))
        return asked[-1]

    monkeypatch.setattr(torch, "empty", unpinned)
    assert not inputs.pin  # the trainer runs on the CPU (here: no trainer)
    for indices in ([3, 0, 7, 7, 11], [5], list(range(12))):
        inputs.pin = True  # as under a trainer on CUDA
        pinned = inputs.rows(indices)
        assert asked[-2] is True and pinned is asked[-1]
        inputs.pin = False
        want = inputs.rows(indices)
        assert want.dtype == pinned.dtype == torch.float16 and torch.equal(pinned, want)
        assert torch.equal(want, torch.from_numpy(np.stack([np.asarray(inputs.array()[i]) for i in indices])))


@pytest.mark.parametrize("mode", ["all", "random", "grouped"])
@pytest.mark.parametrize("cut_short", [False, True], ids=["whole epochs", "epochs cut short"])
def test_prefetched_batches_are_the_batches_read_when_asked(tmp_path, encoder, mode, cut_short):
    """The loader of cached features reads batches ahead in a thread (`prefetch`): for one seed, the same batches in
    the same order as reading each when asked (prefetch=0), the random caption draws included, epoch after epoch, also
    when each epoch is cut short after two batches (`limit_train_batches`) while its thread reads ahead; and the global
    generators end where they would."""
    import random

    from captioner.data.prefetch import _Prefetcher

    def epochs(prefetch: int) -> tuple[list[dict], list]:
        options = {"batch_size": 5, "num_workers": 0, "train_captions": mode, "captions_per_image": 2}
        module = ShapesDataModule(str(tmp_path), 24, 6, 4, **options)  # grouped: 2 of each image's captions drawn
        module.prefetch = prefetch
        module.set_encoder(encoder)
        module.setup("fit")
        loader = module.train_dataloader()
        torch.manual_seed(0), random.seed(0)
        batches = []
        for _ in range(3):
            iterator = iter(loader)
            assert isinstance(iterator, _Prefetcher) == (prefetch > 0) and len(iterator) == len(loader)
            if cut_short:
                batches += [next(iterator), next(iterator)]
                time.sleep(0.2)  # its thread reads the next batches meanwhile, as a step's time lets it
            else:
                batches += list(iterator)
        assert len(batches) == 3 * (2 if cut_short else len(loader)) and len(loader) > 2
        return batches, [torch.rand(1), random.random()]

    (plain, plain_after), (ahead, ahead_after) = epochs(0), epochs(2)
    for want, got in zip(plain, ahead, strict=True):
        assert want.keys() == got.keys()
        for key in want:
            assert key == "captions_per_image" or torch.equal(want[key], got[key]), key
    assert plain_after == ahead_after


def test_a_prefetching_thread_ends_when_its_epoch_is_cut_short_and_passes_errors_on(tmp_path, encoder):
    """An iterator dropped after a few batches (limit_train_batches) lets its thread end, rather than leave one thread
    per epoch holding batches; an error in reading a batch is raised in the reader's thread, once."""
    import gc
    import threading

    module = ShapesDataModule(str(tmp_path), 24, 6, 4, batch_size=2, num_workers=0)
    module.set_encoder(encoder)
    module.setup("fit")
    loader = module.train_dataloader()
    before = threading.active_count()
    iterator = iter(loader)
    next(iterator), next(iterator)
    assert threading.active_count() == before + 1
    del iterator
    gc.collect()
    for _ in range(50):
        if threading.active_count() == before:
            break
        time.sleep(0.05)
    assert threading.active_count() == before

    dataset = loader.dataset
    rows, calls = dataset.inputs.rows, []

    def failing(indices):
        calls.append(indices)
        if len(calls) == 3:
            raise OSError("Input/output error")
        return rows(indices)

    dataset.inputs.rows = failing
    iterator = iter(loader)
    next(iterator), next(iterator)
    with pytest.raises(OSError, match="Input/output error"):
        next(iterator)
    with pytest.raises(StopIteration):
        next(iterator)
    assert threading.active_count() == before


EXIT_MID_READ = """
import threading, torch
from captioner.data.prefetch import PrefetchingLoader

inside = threading.Event()

class Slow(torch.utils.data.Dataset):  # the reads after the first batch's run in the read-ahead thread
    def __len__(self):
        return 8

    def __getitem__(self, index):
        if index >= 2:
            inside.set()
            a = torch.randn(1200, 1200)
            for _ in range(4):  # about a second inside torch's C++, the GIL released
                a = a @ a / 1200
            return a[0, :4]
        return torch.zeros(4)

iterator = iter(PrefetchingLoader(Slow(), batch_size=2, prefetch=2))
next(iterator)
inside.wait()
print("done", flush=True)
"""


def test_a_process_that_ends_while_its_read_ahead_thread_is_inside_torch_exits_cleanly():
    """A run that ends while the thread reads a batch (a cut-short epoch: `captioner fit` with limit_train_batches)
    exits with status 0: without waiting for the thread at exit, the interpreter's finalization ends it inside torch's
    C++ and the process aborts ("terminate called without an active exception", status 134)."""
    result = subprocess.run([sys.executable, "-c", EXIT_MID_READ], capture_output=True, text=True, timeout=120)
    assert result.stdout == "done\n"
    assert result.returncode == 0 and "terminate" not in result.stderr, (result.returncode, result.stderr[-2000:])


def test_a_new_epoch_stops_the_read_ahead_of_an_epoch_cut_short_before_it_begins():
    """An epoch cut short (`limit_train_batches`) leaves its thread reading ahead; the next epoch's iterator stops it
    and waits for it, so that nothing of the old epoch reads, or draws captions (`train_captions: random`, `grouped`),
    while the new one draws: the draws would otherwise depend on timing."""
    import random

    from torch.utils.data import Dataset

    from captioner.data.prefetch import PrefetchingLoader

    class SlowDraws(Dataset):
        def __init__(self):
            self.draws: list[float] = []

        def __len__(self):
            return 20

        def __getitems__(self, indices):
            time.sleep(0.05)
            self.draws.append(random.random())
            return torch.tensor(indices)

    dataset = SlowDraws()
    loader = PrefetchingLoader(dataset, batch_size=1, prefetch=2, collate_fn=lambda batch: batch)
    first = iter(loader)
    next(first)  # its thread reads ahead
    second = iter(loader)  # the next epoch begins
    drawn = len(dataset.draws)
    time.sleep(0.4)
    assert len(dataset.draws) == drawn  # nothing reads for the old epoch any more
    assert len(next(second)) == 1 and len(dataset.draws) == drawn + 1


def test_a_run_on_the_cpu_pins_nothing_where_cuda_is(tmp_path, encoder, monkeypatch):
    """Batches are pinned where the trainer runs on CUDA, not wherever CUDA is: a CPU run on a GPU machine neither
    initialises CUDA nor pins."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    module = ShapesDataModule(str(tmp_path), 8, 4, 4, canvas_size=64, num_workers=0)
    module.set_encoder(encoder)
    module.setup("fit")
    loader = module.train_dataloader()
    assert loader.pin_memory is False and loader.dataset.inputs.pin is False


@pytest.mark.parametrize("mode", ["random", "grouped"])
def test_worker_processes_kept_from_epoch_to_epoch_draw_each_epoch_s_captions_as_the_loader_s_own_process(
    tmp_path, encoder, mode
):
    """Where the loader reads images in worker processes and its dataset draws captions, the workers are kept from
    epoch to epoch (persistent_workers, not made anew each epoch to be given the new epoch's seed), and each
    image's captions in each epoch are what reading in the loader's own process draws for it (the order of the
    images is the sampler's, which draws differently with workers), also after an epoch cut short."""
    import random

    def epochs(workers: int) -> list[dict]:
        options = {"batch_size": 4, "num_workers": workers, "train_captions": mode, "captions_per_image": 2}
        module = ShapesDataModule(str(tmp_path), 16, 4, 4, feature_cache=False, **options)
        module.set_encoder(encoder)
        module.setup("fit")
        loader = module.train_dataloader()
        assert loader.num_workers == workers and loader.persistent_workers == (workers > 0)
        torch.manual_seed(0), random.seed(0)
        drawn = []  # per epoch: image -> its captions' ids
        for epoch in range(3):
            iterator = iter(loader)
            batches = [next(iterator), next(iterator)] if epoch == 1 else list(iterator)  # the second cut short
            captions = {}
            for batch in batches:
                k = batch.get("captions_per_image", 1)
                for row, image in enumerate(batch["index"].tolist()):
                    rows = batch["captions"][row * k : (row + 1) * k]
                    captions.setdefault(image, []).append([[t for t in c.tolist() if t] for c in rows])
            drawn.append(captions)
        return drawn

    plain, kept = epochs(0), epochs(2)
    for epoch, (want, got) in enumerate(zip(plain, kept, strict=True)):
        shared = want.keys() & got.keys()  # every image of a whole epoch; those both read of the one cut short
        assert shared and (epoch == 1 or shared == want.keys() == got.keys())
        assert all(want[image] == got[image] for image in shared)
    assert plain[0] != plain[2]  # each epoch draws anew
