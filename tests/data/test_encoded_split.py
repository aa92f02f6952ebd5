"""The encoded split (captioner.data.coco.EncodedSplit): each split of a real dataset read, cleaned and tokenized once,
kept under data_dir/splits/, and read back by later runs as the same split."""

import logging
import os

import numpy as np
import pytest

import captioner.data.datamodules as datamodules
from captioner.data.datamodules import CocoDataModule
from captioner.data.splits import SplitFiles
from tests.datasets import write_coco, write_custom, write_karpathy

WRITERS = {"karpathy": write_karpathy, "coco": write_coco, "custom": write_custom}


def module(root, fmt: str, **options) -> CocoDataModule:
    extra = {"val_fraction": 0.25, "test_fraction": 0.25} if fmt == "custom" else {}
    return CocoDataModule(str(root), format=fmt, min_word_count=1, num_workers=0, **extra, **options)


def the_same(a, b) -> None:
    """Two datamodules' datasets hold the same split: images, ids, texts, tokens, encoded captions, items."""
    assert a.datasets.keys() <= b.datasets.keys()
    for split, dataset in a.datasets.items():
        other = b.datasets[split]
        x, y = dataset.source, other.source
        assert (x.identity, x.summary, len(x)) == (y.identity, y.summary, len(y)), split
        for i in range(len(x)):
            assert (x.image(i), x.image_id(i), x.captions(i), x.tokens(i)) == (
                y.image(i),
                y.image_id(i),
                y.captions(i),
                y.tokens(i),
            )
            assert list(dataset.references[i]) == list(other.references[i])
        for name in ("tokens", "lengths", "counts", "first", "starts"):
            assert np.array_equal(getattr(dataset.captions, name), getattr(other.captions, name)), (split, name)
        assert dataset.items == other.items and len(dataset) == len(other)


@pytest.mark.parametrize("fmt", ["karpathy", "coco", "custom"])
def test_a_later_setup_reads_the_encoded_split_and_gets_what_reading_the_dataset_gave(tmp_path, fmt, monkeypatch):
    """The first setup reads the dataset's file and writes each split's file (a Karpathy file's three at once); a
    second reads those files and never the dataset's, and gets the same splits, word for word, as a setup that
    encodes each caption with the vocabulary one by one (`Vocabulary.encode`)."""
    WRITERS[fmt](tmp_path)
    first = module(tmp_path, fmt)
    first.setup("fit")
    made = sorted(path.name.split("-")[-2] for path in (tmp_path / "splits").glob("*.npz"))
    assert made == (["test", "train", "val"] if fmt == "karpathy" else ["train", "val"])

    def unread(*args, **kwargs):
        raise AssertionError("the dataset's file was read again")

    with monkeypatch.context() as patch:
        patch.setattr(SplitFiles, "read_split", unread)
        again = module(tmp_path, fmt)
        again.setup("fit")
        if fmt == "karpathy":
            again.setup("test")  # the test split too, and the vocabulary's file found without the training split
    the_same(first, again)

    for split, dataset in first.datasets.items():  # each caption as Vocabulary.encode gives it, one by one
        read = first.split_files.read_split(split)
        want = [first.vocab.encode(tokens) for i in range(len(read)) for tokens in read.tokens(i)]
        table = dataset.captions
        got = [table.tokens[s : s + n].tolist() for s, n in zip(table.starts, table.lengths, strict=True)]
        assert got == want and read.identity == dataset.source.identity


def test_a_changed_dataset_file_or_option_is_a_new_encoded_split(tmp_path):
    write_karpathy(tmp_path)
    first = module(tmp_path, "karpathy")
    first.setup("fit")
    source = tmp_path / "dataset_coco.json"
    source.write_text(source.read_text().replace("an orange cat", "a ginger cat"))
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 10**9))
    changed = module(tmp_path, "karpathy")
    changed.setup("fit")
    words = {w for i in range(len(changed.split("train"))) for c in changed.split("train").tokens(i) for w in c}
    assert "ginger" in words and "orange" not in words
    shorter = module(tmp_path, "karpathy", max_train_caption_len=9)
    shorter.setup("fit")
    assert len(list((tmp_path / "splits").glob("*-train-*.npz"))) == 3
    assert shorter.split("train").identity != changed.split("train").identity


def test_a_split_kept_from_a_relative_data_dir_is_not_read_from_elsewhere(tmp_path, monkeypatch):
    """A relative data_dir's split keeps its images' paths relative to the working directory it was made in: a run
    from another directory, or one that spells the same folder absolutely, makes its own, whose images load."""
    write_karpathy(tmp_path / "project" / "data")
    monkeypatch.chdir(tmp_path / "project")
    relative = module("data", "karpathy")
    relative.setup("fit")
    assert not relative.split("train").image(0).is_absolute()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    absolute = module(tmp_path / "project" / "data", "karpathy")
    absolute.setup("fit")
    split = absolute.split("train")
    assert split.image(0).is_absolute() and split.load_image(0).size
    assert len(list((tmp_path / "project" / "data" / "splits").glob("*-train-*.npz"))) == 2


def test_a_damaged_encoded_split_is_said_once_and_read_again_and_an_unwritable_folder_costs_one_warning(
    tmp_path, caplog
):
    write_karpathy(tmp_path)
    first = module(tmp_path, "karpathy")
    first.setup("fit")
    (train,) = (tmp_path / "splits").glob("*-train-*.npz")
    train.write_bytes(train.read_bytes()[:200])  # torn
    with caplog.at_level(logging.WARNING, logger=datamodules.__name__):
        again = module(tmp_path, "karpathy")
        again.setup("fit")
    said = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert len(said) == 1 and str(train) in said[0] and "reading the split again" in said[0]
    the_same(first, again)
    assert module(tmp_path, "karpathy").split("train").identity == first.split("train").identity  # rewritten whole

    caplog.clear()
    for path in (tmp_path / "splits").iterdir():
        path.unlink()
    (tmp_path / "splits").rmdir()
    (tmp_path / "splits").write_text("")  # a file where the folder should be
    with caplog.at_level(logging.WARNING, logger=datamodules.__name__):
        blocked = module(tmp_path, "karpathy")
        blocked.setup("fit")
    said = [r.getMessage() for r in caplog.records if "cannot be written" in r.getMessage()]
    assert len(said) == 2 and all("the split is read again in every run" in line for line in said)  # train, val
    the_same(first, blocked)


def test_a_first_setup_neither_stats_each_image_nor_rebuilds_each_caption_s_tokens(tmp_path, monkeypatch):
    """What made COCO's first `setup("fit")` slow beyond reading its file and tokenizing once (docs/benchmarks.md):
    a stat of every image file (one listing of each folder instead), and the vocabulary counted from every caption's
    tokens rebuilt as strings (from the split's word ids at once instead). The same splits and vocabulary come out
    (test above)."""
    from pathlib import Path

    from captioner.data.splits import EncodedSplit

    write_karpathy(tmp_path)
    stats, rebuilt = [], []
    is_file, tokens = Path.is_file, EncodedSplit.tokens
    monkeypatch.setattr(Path, "is_file", lambda self: stats.append(self) or is_file(self))
    monkeypatch.setattr(EncodedSplit, "tokens", lambda self, i: rebuilt.append(i) or tokens(self, i))
    data = module(tmp_path, "karpathy")
    data.setup("fit")
    images = len(data.split("train")) + len(data.split("val"))
    assert images >= 4 and len(stats) <= 2  # the dataset's file (and none per image)
    assert rebuilt == []


def test_a_karpathy_split_kept_while_another_cannot_be_written_is_said_by_its_own_file(tmp_path, caplog, monkeypatch):
    """The Karpathy file is read once for every split: this split is kept, and another split whose file cannot be
    written is one warning naming that file."""
    import captioner.data.splits as splits

    write_karpathy(tmp_path)
    lock, reads = splits.build_lock, []
    read_split = SplitFiles.read_split

    def unwritable_val(path):
        if "-val-" in str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return lock(path)

    def counted(self, split):
        reads.append(split)
        return read_split(self, split)

    monkeypatch.setattr(splits, "build_lock", unwritable_val)
    monkeypatch.setattr(SplitFiles, "read_split", counted)
    files = module(tmp_path, "karpathy").split_files
    with caplog.at_level(logging.WARNING, logger=splits.__name__):
        train = files.split("train")
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    (val_path,) = [files._split_file("val")[1]]
    assert said == [f"{val_path}: cannot be written (Permission denied); it is read when it is used"], said
    assert reads == ["train", "test"] and len(train) > 0  # train read once, and kept; val's lock could not be made
    assert files._split_file("train")[1].exists() and files._split_file("test")[1].exists()


def test_captions_edited_with_the_same_images_and_counts_make_a_new_vocabulary_and_keep_the_caches_key(tmp_path):
    """The vocabulary is counted from the captions: edit one (the same images, the same number of captions each) and
    a new one is made, with the new word; the split's identity, the feature and image caches' key, names the images
    and stays."""
    import json

    write_karpathy(tmp_path)
    options = {"data_dir": str(tmp_path), "min_word_count": 1}
    before = CocoDataModule(**options)
    assert "zebra" not in before.vocab.stoi
    path = tmp_path / "dataset_coco.json"
    data = json.loads(path.read_text())
    data["images"][0]["sentences"][0]["raw"] = "a zebra in a white suit stands before a flag"
    path.write_text(json.dumps(data))
    after = CocoDataModule(**options)
    assert "zebra" in after.vocab.stoi
    assert after.split("train").identity == before.split("train").identity
