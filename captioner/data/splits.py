"""COCO's split files: each split of a real dataset read once from the dataset's own files (the COCO annotations, a
Karpathy file or a custom captions file), cleaned and tokenized, and kept beside the data as an `EncodedSplit`, so
that later runs, and the other processes of a DDP run, read it in a fraction of a second (COCO's training split: about
15 s to read and tokenize)."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from captioner.data.coco import CaptionSet, clean, read_coco, read_custom, read_karpathy_splits
from captioner.data.images import load_image
from captioner.data.vocab import TOKENIZER_VERSION
from captioner.errors import ConfigError
from captioner.files import build_lock, replace_atomically

log = logging.getLogger(__name__)


class EncodedSplit:
    """One split of a real dataset in arrays, as `CaptionSet` gives it (same identity, summary, images, captions and
    tokens), kept in one file so that later runs read it in a fraction of a second instead of reading, cleaning and
    tokenizing the dataset's file again (COCO's: about 15 s). Each caption's tokens are ids into the split's own word
    list; `encode` maps them to a vocabulary's ids at once. The file is written by `save` and read by `load`, which
    raises ValueError for a file that is not one (a torn or foreign file)."""

    FORMAT = 1

    def __init__(self, meta: dict, arrays: dict[str, np.ndarray]):
        self.name, self.identity, self.summary = meta["name"], meta["identity"], meta["summary"]
        self._image_ids: list = meta["image_ids"]
        self._paths: list[str] = meta["images"]
        self._words: list[str] = meta["words"]
        self._raw: list[list[str]] | None = None  # the captions' texts, read when first asked for
        self._raw_blob = arrays.get("raw")
        self.tokens_flat, self.caption_lengths, self.counts = arrays["tokens"], arrays["lengths"], arrays["counts"]
        self.first = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)  # image -> its first caption
        self.starts = np.concatenate([[0], np.cumsum(self.caption_lengths)[:-1]]).astype(np.int64)  # caption -> token
        if not (len(self._paths) == len(self._image_ids) == len(self.counts) and len(self.counts) > 0):
            raise ValueError("its image lists disagree")
        if int(self.counts.sum()) != len(self.caption_lengths) or int(self.caption_lengths.sum()) != len(
            self.tokens_flat
        ):
            raise ValueError("its caption arrays disagree")
        if len(self.tokens_flat) and int(self.tokens_flat.max()) >= len(self._words):
            raise ValueError("a token beyond its word list")

    @property
    def captions_identity(self) -> str:
        """`identity` with a hash of the captions' tokens, which a vocabulary is counted from: `identity` names the
        images (the caches' key), this their captions too, so that captions edited with the images and their counts
        unchanged make a new vocabulary."""
        digest = hashlib.sha256(json.dumps(self._words).encode())
        for array in (self.tokens_flat, self.caption_lengths, self.counts):
            digest.update(np.ascontiguousarray(array).tobytes())
        return f"{self.identity}-t{digest.hexdigest()[:10]}"

    @classmethod
    def from_caption_set(cls, split: CaptionSet, name: str) -> EncodedSplit:
        captions = [split.tokens(i) for i in range(len(split))]  # each image's captions' tokens
        words = [word for tokens in captions for caption in tokens for word in caption]  # every word, in order
        index = {word: i for i, word in enumerate(dict.fromkeys(words))}  # the split's word list, first seen first
        meta = {
            "name": name,
            "identity": split.identity,
            "summary": split.summary,
            "image_ids": [split.image_id(i) for i in range(len(split))],
            "images": [str(record.image) for record in split.records],
            "words": list(index),
        }
        raw = [split.captions(i) for i in range(len(split))]
        arrays = {
            "tokens": np.fromiter(map(index.__getitem__, words), dtype=np.int32, count=len(words)),
            "lengths": np.array([len(caption) for tokens in captions for caption in tokens], dtype=np.int32),
            "counts": np.array([len(tokens) for tokens in captions], dtype=np.int32),
            "raw": np.frombuffer(json.dumps(raw).encode(), dtype=np.uint8),
        }
        return cls(meta, arrays)

    def save(self, path: str | Path) -> None:
        """Write the split to `path` (numpy's .npz, no pickles), whole or not at all."""
        meta = {
            "format": self.FORMAT,
            "name": self.name,
            "identity": self.identity,
            "summary": self.summary,
            "image_ids": self._image_ids,
            "images": self._paths,
            "words": self._words,
        }
        arrays = {"tokens": self.tokens_flat, "lengths": self.caption_lengths, "counts": self.counts}
        arrays["raw"] = self._raw_blob if self._raw_blob is not None else np.frombuffer(b"null", dtype=np.uint8)
        buffer = io.BytesIO()
        np.savez(buffer, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
        replace_atomically(path, lambda file: file.write(buffer.getvalue()))

    @classmethod
    def load(cls, path: str | Path) -> EncodedSplit:
        try:
            with np.load(path) as stored:
                meta = json.loads(stored["meta"].tobytes())
                if meta.get("format") != cls.FORMAT:
                    raise ValueError(f"format {meta.get('format')}, not {cls.FORMAT}")
                arrays = {name: stored[name] for name in ("tokens", "lengths", "counts", "raw")}
        except (OSError, KeyError, EOFError, zipfile.BadZipFile, json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(str(err) or type(err).__name__) from err
        return cls(meta, arrays)

    def __len__(self) -> int:
        return len(self.counts)

    def image(self, index: int) -> Path:
        return Path(self._paths[index])

    def load_image(self, index: int) -> Image.Image:
        return load_image(self.image(index))

    def captions(self, index: int) -> list[str]:
        if self._raw is None:
            self._raw = json.loads(self._raw_blob.tobytes())
        return self._raw[index]

    def tokens(self, index: int) -> list[list[str]]:
        """The tokens of each of image `index`'s captions, as `tokenize` gave them."""
        words, first = self._words, int(self.first[index])
        out = []
        for caption in range(first, first + int(self.counts[index])):
            start, length = int(self.starts[caption]), int(self.caption_lengths[caption])
            out.append([words[t] for t in self.tokens_flat[start : start + length].tolist()])
        return out

    def image_id(self, index: int) -> int | str:
        return self._image_ids[index]

    def word_counts(self) -> dict[str, int]:
        """How many times each of the split's words occurs in its captions (what a vocabulary is built from)."""
        counts = np.bincount(self.tokens_flat, minlength=len(self._words))
        return dict(zip(self._words, counts.tolist(), strict=True))

    def encode(self, vocabulary) -> tuple[np.ndarray, np.ndarray]:
        """Every caption as `vocabulary.encode` gives it, at once: the ids of all captions end to end (each
        <start> w1 ... wn <end>), and each caption's length in ids (n + 2)."""
        table = np.array([vocabulary.stoi.get(word, vocabulary.unk_index) for word in self._words], dtype=np.int64)
        lengths = self.caption_lengths.astype(np.int64) + 2
        ends = np.cumsum(lengths)
        ids = np.empty(int(ends[-1]) if len(ends) else 0, dtype=np.int64)
        ids[ends - lengths] = vocabulary.start_index
        ids[ends - 1] = vocabulary.end_index
        caption_of_token = np.repeat(np.arange(len(lengths)), self.caption_lengths)  # each word's caption
        ids[np.arange(len(self.tokens_flat)) + 2 * caption_of_token + 1] = table[self.tokens_flat]
        return ids, lengths


class SplitTokens(Sequence):
    """Each image's captions' tokens (`EncodedSplit.tokens`), made when an image's are read."""

    def __init__(self, split: EncodedSplit):
        self.split = split

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, index: int) -> list[list[str]]:
        if not 0 <= index < len(self.split):
            raise IndexError(index)
        return self.split.tokens(index)


@dataclass
class SplitFiles:
    """A real dataset's splits, each read once from the dataset's files and kept under the cache folder's splits/
    (`split`). The fields are the DataModule's options of those names (`captioner.data.datamodules.CocoDataModule`
    says the layouts)."""

    data_dir: Path
    format: str = "karpathy"
    year: int = 2014
    split_file: str = "dataset_coco.json"
    image_root: str = "."
    captions_file: str = "captions.jsonl"
    image_dir: str = "images"
    val_fraction: float = 0.1
    test_fraction: float = 0.1
    max_train_caption_len: int = 50
    cache_dir: Path | None = None  # where the splits are kept (under splits/); None: data_dir
    read_before: list[Path] = field(default_factory=list)  # where kept splits are looked for first (read only)
    _karpathy: dict[str, list] | None = field(default=None, init=False, repr=False)  # every split's, once read

    def split(self, split: str) -> EncodedSplit:
        """The split as `read_split` reads it, kept in a file under data_dir/splits/ named by the dataset's file
        (its path, size and modification time) and the options that shape the split: later runs, and the other
        processes of a DDP run, read that file instead (one process builds it, the others wait for it). A damaged file
        is said in one warning and made again; a folder that cannot be written costs one warning, and the reading
        in every run. A later run does not look for the image files again: one deleted since is reported when the
        feature cache or a batch reads it."""
        name, path = self._split_file(split)
        if path is None:  # the dataset's file is missing: read_split names it
            return EncodedSplit.from_caption_set(self.read_split(split), name)
        existed = path.exists()
        for kept_at in (*(root / "splits" / path.name for root in self.read_before), path):
            kept = self._load(kept_at)  # first, without the lock: a folder that cannot be written is read all the same
            if kept is not None:
                return kept
        encoded = None
        try:
            with build_lock(path):
                kept = None if existed else self._load(path)  # made by another process while this one waited
                if kept is not None:
                    return kept
                encoded = EncodedSplit.from_caption_set(self.read_split(split), name)
                encoded.save(path)
        except OSError as err:  # the folder, the lock or the file cannot be written
            log.warning("%s: cannot be written (%s); the split is read again in every run", path, err.strerror or err)
            return encoded if encoded is not None else EncodedSplit.from_caption_set(self.read_split(split), name)
        if self.format == "karpathy":  # its file holds every split, read now: keep the others too
            self._keep_others(split)
        return encoded

    @staticmethod
    def _load(path: Path) -> EncodedSplit | None:
        """The split kept at `path`; None where there is none, or it is damaged (said in one warning)."""
        if not path.exists():
            return None
        try:
            return EncodedSplit.load(path)
        except ValueError as err:
            log.warning("%s: unreadable (%s); reading the split again", path, err)
            return None

    def _keep_others(self, split: str) -> None:
        """The Karpathy file's other splits, read with this one, kept too; one that cannot be written is said in one
        warning naming its own file (this split is kept whatever happens to them)."""
        for other in ("train", "val", "test"):
            other_name, other_path = self._split_file(other)
            if other == split or other_path is None or other_path.exists():
                continue
            try:
                with build_lock(other_path):
                    if not other_path.exists():
                        EncodedSplit.from_caption_set(self.read_split(other), other_name).save(other_path)
            except ConfigError:  # a split with no usable image: said if and when it is used
                pass
            except OSError as err:
                log.warning("%s: cannot be written (%s); it is read when it is used", other_path, err.strerror or err)

    def _split_file(self, split: str) -> tuple[str, Path | None]:
        """The split's name, and the file that keeps it, named by the dataset's file (its path, size and modification
        time) and the options that shape the split; None if the dataset's file is missing."""
        name = f"{self.data_dir.name}-{self.format}-{split}"
        source = self._source_file(split)
        try:
            stat = source.stat()
        except OSError:
            return name, None
        options = [str(source.resolve()), stat.st_size, stat.st_mtime_ns, self.format, split, TOKENIZER_VERSION]
        # The image folder as spelled too: the split keeps its images' paths as the data_dir gives them (relative to
        # the working directory for a relative one), and its identity (the caches' and the vocabulary's key) with them
        images = self._images()
        options += [str(images), str(images.resolve()), self.max_train_caption_len if split == "train" else None]
        options += [self.year, self.val_fraction, self.test_fraction] if self.format != "karpathy" else []
        key = hashlib.sha256(json.dumps(options).encode()).hexdigest()[:16]
        return name, (self.cache_dir or self.data_dir) / "splits" / f"{name}-{key}.npz"

    def _source_file(self, split: str) -> Path:
        """The file that `split` is read from: its annotations, the Karpathy file or the captions file."""
        if self.format == "coco":
            return self.data_dir / "annotations" / f"captions_{'train' if split == 'train' else 'val'}{self.year}.json"
        return self.data_dir / (self.split_file if self.format == "karpathy" else self.captions_file)

    def _images(self) -> Path:
        if self.format == "coco":
            return self.data_dir
        return self.data_dir / (self.image_root if self.format == "karpathy" else self.image_dir)

    def read_split(self, split: str) -> CaptionSet:
        """The split read from the dataset's files and cleaned (`clean`): what `split` keeps."""
        root = self.data_dir
        if self.format == "coco":
            part = "train" if split == "train" else "val"
            records = read_coco(root / "annotations" / f"captions_{part}{self.year}.json", root / f"{part}{self.year}")
        elif self.format == "karpathy":  # the file is read once, for every split
            if self._karpathy is None:
                self._karpathy = read_karpathy_splits(root / self.split_file, root / self.image_root)
            records = self._karpathy[split]
        else:
            records = [
                r
                for r in read_custom(root / self.captions_file, root / self.image_dir)
                if self.custom_split(str(r.image_id)) == split
            ]
        name = f"{root.name}-{self.format}-{split}"
        max_words = self.max_train_caption_len if split == "train" else None
        return CaptionSet(name, *clean(records, max_words, name))

    def custom_split(self, image: str) -> str:
        """The split of a custom-format image, by a hash of its path: test, val or train, at the fractions asked."""
        u = zlib.crc32(image.encode()) / 2**32  # stable across runs and machines
        return "test" if u < self.test_fraction else "val" if u < self.test_fraction + self.val_fraction else "train"
