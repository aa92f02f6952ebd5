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
    """Two ranks: this one, and another that can use the cache where `other` is true, and did not fail. (`shared`
    asks whether any rank failed with all=False, and whether every rank can use the cache with all=True.)"""

    def __init__(self, other: bool):
        self.other, self.root_device, self.barriers = other, torch.device("cpu"), []

    def barrier(self, name=None):
        self.barriers.append(name)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return (decision and self.other) if all else decision


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


RANK = """
import datetime, os, sys, time
import torch.distributed as dist
from captioner.data import disk_cache
from captioner.data.datamodules import ShapesDataModule
from captioner.data.features import FeatureCache
from captioner.errors import CaptionerError
from captioner.models.encoder import Encoder

rank, port, root, mode, timeout = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])
dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=timeout)
)

class Strategy:  # what `shared` asks of Lightning's strategy, through the process group (gloo)
    def barrier(self, name=None):
        dist.barrier()

    def reduce_boolean_decision(self, decision, all=True):
        import torch
        value = torch.tensor(int(bool(decision)))
        dist.all_reduce(value, op=dist.ReduceOp.MIN if all else dist.ReduceOp.MAX)
        return bool(value)

class Trainer:
    world_size, local_rank, strategy = 2, rank, Strategy()

original = write = FeatureCache.write
if mode == "fail" and rank == 0:
    def write(self, **options):
        raise CaptionerError("the encoder gives non-finite annotations")  # not an OSError
elif mode == "slow" and rank == 0:
    def write(self, **options):
        time.sleep(2 * timeout)  # longer than the process group's timeout
        return original(self, **options)
elif mode == "read-only":
    def refuse(path):
        raise PermissionError(13, "Read-only file system", str(path))
    disk_cache.build_lock = refuse  # no lock file can be made: the folder cannot be written
    os.mkdir = refuse
FeatureCache.write = write

source = ShapesDataModule(root, train_size=4, val_size=4, test_size=4, canvas_size=64).split("val")
cache = FeatureCache(f"{root}/features", Encoder("efficientnet_lite0").eval(), source)
start = time.monotonic()
try:
    print(f"usable={disk_cache.shared(cache, Trainer(), 'files instead')}", flush=True)
except CaptionerError as err:
    print(f"error: {err}", flush=True)
print(f"seconds={time.monotonic() - start:.1f}", flush=True)
dist.destroy_process_group()  # as PyTorch asks: a gloo group left to the exit may abort the process
"""


def two_ranks(tmp_path, mode: str, timeout: float) -> list[dict[str, str]]:
    """`shared` in two processes of a gloo process group (local ranks 0 and 1 of one node), each its lines' values."""
    import socket
    import subprocess
    import sys

    from tests.conftest import REPO

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-c", RANK]
    ranks = [
        subprocess.Popen(
            [*command, str(rank), str(port), str(tmp_path), mode, str(timeout)],
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for rank in (0, 1)
    ]
    said = []
    for process in ranks:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-3000:]
        said.append(dict(line.split("=", 1) if "=" in line else ("error", line) for line in out.splitlines()))
    return said


@pytest.mark.ci
def test_two_ranks_a_failed_build_reaches_both_at_once(tmp_path):
    """Rank 0's build fails with an error that is not an OSError: both ranks raise, at once, not when the process
    group's timeout ends the wait."""
    said = two_ranks(tmp_path, "fail", timeout=60)
    assert said[0]["error"] == "error: the encoder gives non-finite annotations"
    assert (
        said[1]["error"].startswith("error: ")
        and "another process failed to build the feature cache" in said[1]["error"]
    )
    assert all(float(rank["seconds"]) < 30 for rank in said), said


@pytest.mark.ci
def test_two_ranks_wait_for_a_build_longer_than_the_process_group_s_timeout(tmp_path):
    """Rank 0's build takes twice the process group's timeout: rank 1 waits on the cache's lock file, not in a
    collective, and both use the cache."""
    said = two_ranks(tmp_path, "slow", timeout=5)
    assert [rank.get("usable") for rank in said] == ["True", "True"], said


@pytest.mark.ci
def test_two_ranks_use_a_whole_cache_in_a_folder_they_cannot_write(tmp_path):
    """A whole cache where no lock file can be made (a read-only dataset folder): both ranks use it."""
    built("feature", tmp_path, Encoder("efficientnet_lite0").eval())
    said = two_ranks(tmp_path, "read-only", timeout=60)
    assert [rank.get("usable") for rank in said] == ["True", "True"], said
