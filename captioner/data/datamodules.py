"""LightningDataModules: shared batching and feature caching, plus the built-in shapes set."""

from __future__ import annotations

import hashlib
import json
import logging
import random
import warnings
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, Protocol

import lightning as L
import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset

from captioner.data.coco import CaptionSet, EncodedSplit, clean, read_coco, read_custom, read_karpathy_splits
from captioner.data.features import FeatureCache, ImageSource
from captioner.data.image_cache import ImageCache
from captioner.data.images import ImageError
from captioner.data.prefetch import PrefetchingLoader
from captioner.data.shapes import ShapesDataset
from captioner.data.vocab import TOKENIZER_VERSION, Vocabulary, tokenize
from captioner.errors import ConfigError
from captioner.files import build_lock
from captioner.models.encoder import Encoder

log = logging.getLogger(__name__)


class CaptionSource(ImageSource, Protocol):
    """A dataset split: images plus reference captions."""

    def captions(self, index: int) -> list[str]: ...


class _Inputs:
    """The model input of image i: its cached annotations (P,E) or its preprocessed image (3,H,W), read from its file
    or from the image cache (`images`).

    An image that cannot be read gives None (the batch goes on without it) and one warning naming the file.
    """

    def __init__(
        self, source: CaptionSource, features: FeatureCache | None, transform, images: ImageCache | None = None
    ):
        self.source, self.transform, self.images = source, transform, images
        self.cache: FeatureCache | np.ndarray | None = features
        self.bad = features.bad_indices() if features is not None else set(images.bad) if images is not None else set()
        self.key = "images" if features is None else "annotations"
        self._tensor: torch.Tensor | None = None  # the cache as a tensor (`_table`), made at the first pinned read

    def __call__(self, index: int) -> torch.Tensor | None:
        if index in self.bad:
            return None
        if self.cache is None:
            try:
                image = self.source.load_image(index) if self.images is None else self.images.read(index)
                return self.transform(image)
            except ImageError as err:
                log.warning("skipping %s", err)
                self.bad.add(index)
                return None
        return torch.from_numpy(np.array(self._array()[index]))  # (P,E) float16

    def rows(self, indices: list[int], pin: bool | None = None) -> torch.Tensor:
        """The cached annotations (B,P,E) of images `indices` (none of them bad), in one indexed read of the cache.

        `pin` (by default where CUDA is, as the loaders pin their batches): the rows are copied by torch's threads
        straight into page-locked memory from torch's caching host allocator, which hands the blocks of earlier
        batches back once their copies to the GPU are done. One copy, into memory that is already mapped; the
        loader's pinning finds the batch pinned, and the copy to the GPU does not wait. (At the paper's sizes a batch
        is 51 MiB: numpy's copy into a new array, faulting its pages in, then the loader's copy of it into pinned
        memory.) Otherwise numpy copies the rows into a new array, which the tensor owns."""
        if torch.cuda.is_available() if pin is None else pin:
            table = self._table()
            out = torch.empty((len(indices), *table.shape[1:]), dtype=table.dtype, pin_memory=True)
            return torch.index_select(table, 0, torch.as_tensor(indices, dtype=torch.long), out=out)
        return torch.from_numpy(self._array()[np.asarray(indices)])

    def _array(self) -> np.ndarray:
        if isinstance(self.cache, FeatureCache):  # opened lazily, so that each DataLoader worker maps its own view
            self.cache = self.cache.load()
        return self.cache

    def _table(self) -> torch.Tensor:
        """The cache as a tensor over the same read-only memory map (torch warns that it could write to it: nothing
        does)."""
        if self._tensor is None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
                self._tensor = torch.from_numpy(self._array())
        return self._tensor


class CaptionDataset(Dataset):
    """Training: one item per (image, caption) pair ("all"), one per image with a random caption each time
    ("random"), or one per image with `captions_per_image` of its captions ("grouped"). Evaluation: one item per
    image, carrying all its references (each image is decoded once), and for shapes its objects and canvas (attention
    correctness). Training items carry neither: no training step reads them (SCST reads the split's `references` by
    image index).

    A DataLoader gets its batches from `__getitems__`: from the feature cache, all the batch's rows in one read. A
    "grouped" batch holds each of its images (or their annotations) once, and their captions image by image, k each:
    `captions_per_image` in the batch says k, and the model repeats each image's annotations k times
    (`ShowAttendTell.forward`), so that the encoder runs (or the cache is read) once per image, not once per caption,
    as self-critical.pytorch's `seq_per_img` does. The paper's minibatches are of captions; this is the same data
    per epoch (every image once, with k captions), in batches of `batch_size` images, so k times the captions."""

    def __init__(
        self,
        source: CaptionSource,
        captions: list[list[list[int]]] | tuple[np.ndarray, np.ndarray],
        references: Sequence[list[list[str]]],
        mode: str,
        objects: list | None = None,
        captions_per_image: int = 5,
    ):
        """`captions`: each image's captions as vocabulary ids; or, for a `source` that is an `EncodedSplit`, every
        caption's ids end to end and each caption's length (`EncodedSplit.encode`), image by image, `source.counts[i]`
        captions for image i. `references`: each image's captions' tokens (a list, or `_SplitTokens`, which makes an
        image's when they are read). `captions_per_image`: k of the "grouped" mode."""
        self.source, self.references, self.mode = source, references, mode
        self.captions_per_image = captions_per_image
        self.objects = objects  # ground-truth objects per image (shapes only), for attention correctness
        self.inputs: _Inputs | None = None  # given by the datamodule when its loader is made (`_loader`)
        # Every caption's tokens in one array, for the batches: caption j of image i starts at starts[first[i] + j]
        if isinstance(captions, tuple):
            self._tokens, self._lengths = captions
            self._counts = source.counts.astype(np.int64)
        else:
            self._counts = np.array([len(caps) for caps in captions], dtype=np.int64)
            self._lengths = np.array([len(c) for caps in captions for c in caps], dtype=np.int64)
            self._tokens = np.array([token for caps in captions for c in caps for token in c], dtype=np.int64)
        self._first = np.concatenate([[0], np.cumsum(self._counts)[:-1]]).astype(np.int64)
        self._starts = np.concatenate([[0], np.cumsum(self._lengths)[:-1]]).astype(np.int64)
        counts = self._counts.tolist()
        self.items = [(i, j) for i, n in enumerate(counts) for j in range(n)] if mode == "all" else None

    def __len__(self) -> int:
        return len(self.items) if self.items is not None else len(self._counts)

    def _pair(self, index: int) -> tuple[int, int]:
        """Item `index`'s (image, caption); in "random" mode the caption is drawn here, one draw per item."""
        if self.items is not None:
            return self.items[index]
        return index, random.randrange(int(self._counts[index])) if self.mode == "random" else 0

    def _draw(self, image: int) -> list[int]:
        """The "grouped" mode's k captions of `image`: all of them, in order, when it has k; k of them drawn without
        replacement when it has more; all, then the rest drawn with replacement, when it has fewer."""
        count, k = int(self._counts[image]), self.captions_per_image
        if count > k:
            return random.sample(range(count), k)
        return list(range(count)) + random.choices(range(count), k=k - count)

    def _about(self, image: int) -> dict:
        """What evaluation reads of an image besides its input and caption; nothing for training."""
        if self.mode != "first":
            return {}
        objects = self.objects[image] if self.objects is not None else None
        return {
            "references": self.references[image],
            "objects": objects,
            "canvas": getattr(self.source, "image_size", None),
        }

    def __getitem__(self, index: int) -> dict | None:
        """Item `index`; in "grouped" mode, the batch of that one image (`__getitems__`)."""
        if self.mode == "grouped":
            return self.__getitems__([index])
        image, caption = self._pair(index)
        inputs = self.inputs(image)
        if inputs is None:
            return None
        start = int(self._starts[self._first[image] + caption])
        ids = self._tokens[start : start + int(self._lengths[self._first[image] + caption])]
        item = {"index": image, "input": inputs, "caption": torch.from_numpy(ids.copy())}
        return item | self._about(image) | {"key": self.inputs.key}

    def __getitems__(self, indices: list[int]) -> dict:
        """The batch of items `indices` (what a DataLoader asks for, batch by batch), collated. From the feature
        cache, the batch's rows are read in one indexed read, straight into the batch, rather than copied out row by
        row and stacked; images are loaded and collated one by one. Items whose image is bad are left out."""
        if self.mode == "grouped":
            return self._grouped(indices)
        if self.inputs.key != "annotations":
            return collate([self[index] for index in indices])
        pairs = [pair for pair in map(self._pair, indices) if pair[0] not in self.inputs.bad]  # every draw made
        if not pairs:
            return {}
        images = [image for image, _ in pairs]
        batch = {"annotations": self.inputs.rows(images)} | self._padded_captions(pairs)
        batch["index"] = torch.tensor(images)
        if self.mode == "first":
            about = [self._about(image) for image in images]
            batch |= {key: [a[key] for a in about] for key in ("references", "objects", "canvas")}
        return batch

    def _grouped(self, images: list[int]) -> dict:
        """A "grouped" batch: images `images` (those that can be read) once each, their k captions each, in order."""
        draws = [(image, self._draw(image)) for image in images]  # every draw made, an unreadable image's too
        if self.inputs.key == "annotations":
            kept = [(image, captions) for image, captions in draws if image not in self.inputs.bad]
            inputs = self.inputs.rows([image for image, _ in kept]) if kept else None
        else:
            read = [(image, captions, self.inputs(image)) for image, captions in draws]
            kept = [(image, captions) for image, captions, x in read if x is not None]
            inputs = stack([x for _, _, x in read if x is not None]) if kept else None
        if not kept:
            return {}
        pairs = [(image, caption) for image, captions in kept for caption in captions]
        batch = {self.inputs.key: inputs} | self._padded_captions(pairs)
        return batch | {
            "index": torch.tensor([image for image, _ in kept]),
            "captions_per_image": self.captions_per_image,
        }

    def _padded_captions(self, pairs: list[tuple[int, int]]) -> dict:
        """`_padded` of the captions (image, caption) `pairs`, gathered from the token array at once."""
        ids = self._first[[image for image, _ in pairs]] + np.array([caption for _, caption in pairs], dtype=np.int64)
        starts, lengths = self._starts[ids], self._lengths[ids]
        columns = np.arange(lengths.max())
        real = columns < lengths[:, None]  # (B,T)
        captions = np.full(real.shape, Vocabulary.pad_index, dtype=np.int64)
        captions[real] = self._tokens[(starts[:, None] + columns)[real]]
        return {"captions": torch.from_numpy(captions), "lengths": torch.from_numpy(lengths)}


def stack(inputs: list[torch.Tensor]) -> torch.Tensor:
    """`torch.stack` of a batch's inputs. Images made from PIL images (uint8, `ToImage`) are views (3,H,W) of pixels
    stored channel last: they are stacked as they are stored, one copy of each, into a (B,3,H,W) batch in
    channels-last memory, which is the layout the encoder runs in (`torch.stack` would transpose each: 1.6x the time
    for 64 448x448 images on the machine of docs/benchmarks.md)."""
    if inputs[0].dim() == 3 and all(x.permute(1, 2, 0).is_contiguous() for x in inputs):
        return torch.stack([x.permute(1, 2, 0) for x in inputs]).permute(0, 3, 1, 2)
    return torch.stack(inputs)


def _padded(captions: list[torch.Tensor]) -> dict:
    return {
        "captions": pad_sequence(captions, batch_first=True, padding_value=Vocabulary.pad_index),  # (B,T)
        "lengths": torch.tensor([len(c) for c in captions]),  # (B,)
    }


def collate(items: list[dict | None] | dict) -> dict:
    """Stack inputs, pad captions with <pad> (0); items whose image could not be read (None) are left out. A batch
    that `CaptionDataset.__getitems__` collated already is passed on as it is.

    A batch with no readable image is an empty dict, which every step skips. Not None: Lightning would skip a None
    training batch before `training_step`, and under DDP a process that skips a step leaves the others waiting for it
    in the gradient all-reduce, for ever.
    """
    if isinstance(items, dict):
        return items
    items = [item for item in items if item is not None]
    if not items:
        return {}
    batch = {items[0]["key"]: stack([item["input"] for item in items])}
    batch |= _padded([item["caption"] for item in items])
    for key in ("references", "objects", "canvas"):  # evaluation's items only
        if key in items[0]:
            batch[key] = [item[key] for item in items]
    batch["index"] = torch.tensor([item["index"] for item in items])
    return batch


class _SplitTokens(Sequence):
    """Each image's captions' tokens (`EncodedSplit.tokens`), made when an image's are read."""

    def __init__(self, split: EncodedSplit):
        self.split = split

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, index: int) -> list[list[str]]:
        if not 0 <= index < len(self.split):
            raise IndexError(index)
        return self.split.tokens(index)


def _tokens(source: CaptionSource, index: int) -> list[list[str]]:
    """The tokens of image `index`'s captions: the split's own (`CaptionSet.tokens`, made once), or tokenized here."""
    if hasattr(source, "tokens"):
        return source.tokens(index)
    return [tokenize(caption) for caption in source.captions(index)]


class CaptionDataModule(L.LightningDataModule):
    """Base class: subclasses say how to make each split (`make_split`); this class builds the vocabulary from the
    training split, the feature cache (when the model's encoder is frozen) and the loaders.

    The encoder is the model's own: under a Trainer it is taken from the LightningModule when the loaders are made
    (after the model's own setup and any checkpoint restore: the cache holds what the model's encoder gives); without
    a Trainer, pass it to `set_encoder` first.

    Args:
        data_dir: where the data, its vocabulary and the feature cache live.
        batch_size: images (or caption pairs) per batch.
        num_workers: DataLoader workers for image loading (cached features are read in the main process, one read of
            its rows per batch: the random caption draws and the resume stay in this process).
        prefetch: batches of cached features read ahead by a background thread while the step runs (0: each batch is
            read when the step asks for it). The same batches either way (`captioner.data.prefetch`).
        feature_cache: cache the annotations of a frozen encoder on disk.
        image_cache: where the encoder runs on images (no feature cache: fine-tuning, augmentation, a cache that does
            not fit on the disk), read them from a cache of the images resized to the encoder's input, as JPEG, rather
            than decode and resize each original file at every epoch (`captioner.data.image_cache`).
        train_captions: "all" (one item per caption), "random" (one item per image, random caption each epoch), or
            "grouped" (one item per image with `captions_per_image` of its captions: batches of `batch_size` images,
            each encoded or read once for its k captions; `CaptionDataset`).
        captions_per_image: k, the captions of each image in a "grouped" batch.
        min_word_count: words seen fewer times in the training captions become <unk>.
        max_vocab_size: largest vocabulary, special tokens included.
        augment: random crop and brightness/contrast jitter on training images. The training split then skips the
            feature cache (cached annotations cannot be augmented), so the encoder runs every step.
    """

    def __init__(
        self,
        data_dir: str = "data",
        batch_size: int = 64,
        num_workers: int = 2,
        prefetch: int = 2,
        feature_cache: bool = True,
        image_cache: bool = False,
        train_captions: Literal["all", "random", "grouped"] = "all",
        captions_per_image: int = 5,
        min_word_count: int = 1,
        max_vocab_size: int = 10000,
        augment: bool = False,
    ):
        super().__init__()
        self.augment = augment
        if train_captions not in ("all", "random", "grouped"):
            raise ConfigError(f"train_captions must be 'all', 'random' or 'grouped', got {train_captions!r}")
        if captions_per_image < 1:
            raise ConfigError(f"captions_per_image must be positive, got {captions_per_image}")
        self.captions_per_image = captions_per_image
        if batch_size < 1:
            raise ConfigError(f"batch_size must be positive, got {batch_size}")
        if prefetch < 0 or num_workers < 0:
            raise ConfigError(f"num_workers and prefetch cannot be negative, got {num_workers} and {prefetch}")
        self.data_dir = Path(data_dir)
        self.batch_size, self.num_workers, self.prefetch = batch_size, num_workers, prefetch
        self.feature_cache, self.image_cache, self.train_captions = feature_cache, image_cache, train_captions
        self.min_word_count, self.max_vocab_size = min_word_count, max_vocab_size
        self.encoder: Encoder | None = None
        self.datasets: dict[str, CaptionDataset] = {}
        self._vocab: Vocabulary | None = None
        self._splits: dict[str, CaptionSource] = {}

    def make_split(self, split: str) -> CaptionSource:
        raise NotImplementedError

    def split(self, split: str) -> CaptionSource:
        if split not in self._splits:
            self._splits[split] = self.make_split(split)
        return self._splits[split]

    @property
    def vocab(self) -> Vocabulary:
        """Built from the training captions only, and saved beside the data. Two processes that need it at once
        (two runs on one data_dir) take turns through its lock file: one builds it, the other reads it."""
        if self._vocab is None:
            train = self.split("train")
            limits = f"tok{TOKENIZER_VERSION}-min{self.min_word_count}-max{self.max_vocab_size}"
            path = self.data_dir / f"vocab-{train.identity}-{limits}.json"
            with build_lock(path):
                if path.exists():
                    self._vocab = Vocabulary.load(path)
                else:
                    captions = (tokens for i in range(len(train)) for tokens in _tokens(train, i))
                    self._vocab = Vocabulary.build(captions, self.min_word_count, self.max_vocab_size)
                    self._vocab.save(path)
        return self._vocab

    @property
    def vocab_tokens(self) -> list[str]:
        """The vocabulary as a plain list, for the model (and so for every checkpoint)."""
        return self.vocab.to_list()

    def set_encoder(self, encoder: Encoder) -> None:
        self.encoder = encoder

    def _model_encoder(self) -> Encoder:
        if self.encoder is None and self.trainer is not None:
            self.encoder = self.trainer.lightning_module.model.encoder
        if self.encoder is None:
            raise RuntimeError("no encoder: run under a Trainer, or call set_encoder(encoder) before making a loader")
        return self.encoder

    def _dataset(self, split: str, mode: str) -> CaptionDataset:
        source = self.split(split)
        if getattr(source, "summary", None):  # what was skipped, said once, by the split that is used
            log.warning(source.summary)
        if isinstance(source, EncodedSplit):  # encoded at once; each image's tokens made when read (SCST, evaluation)
            references, captions = _SplitTokens(source), source.encode(self.vocab)
        else:
            references = [_tokens(source, i) for i in range(len(source))]  # each caption tokenized once
            captions = [[self.vocab.encode(tokens) for tokens in caps] for caps in references]
        objects = [source.objects(i) for i in range(len(source))] if hasattr(source, "objects") else None
        return CaptionDataset(source, captions, references, mode, objects, self.captions_per_image)

    def _inputs(self, split: str) -> _Inputs:
        """What the model reads of the split's images: the frozen encoder's cached annotations (the cache built first
        if missing), or else the preprocessed images, from the image cache (`image_cache`) or their files."""
        source, encoder = self.split(split), self._model_encoder()
        augment = self.augment and split == "train"
        features = images = None
        if self.feature_cache and encoder.frozen and not augment:
            features = self._shared(FeatureCache(self.data_dir / "features", encoder, source), "feature cache")
        if features is None and self.image_cache:
            images = self._shared(
                ImageCache(self.data_dir / "image_cache", encoder.preprocessing, source), "image cache"
            )
        # Images leave the loader as uint8, and the encoder normalises them on its device (4x fewer bytes to copy);
        # augmentation's colour jitter works on floats, so augmented images leave normalised.
        transform = encoder.preprocessing.transforms(augment, normalize=augment)
        return _Inputs(source, features, transform, images)

    def _shared(self, cache: FeatureCache | ImageCache, name: str) -> FeatureCache | ImageCache | None:
        """A cache of the split (`name`: the feature or the image cache), built first if it is missing or damaged; None
        if it cannot be written.

        Under DDP, local rank 0 builds it while the other ranks wait at a barrier, then they read it. Two processes
        that need the same cache and do not share a Trainer (two runs on one data_dir, or two nodes on one shared
        disk) take turns through the cache's lock file: one builds, the other then finds it built.
        """
        trainer = self.trainer
        distributed = trainer is not None and trainer.world_size > 1
        usable = True
        if not distributed or trainer.local_rank == 0:
            usable = self._ensure(cache, name)
        if distributed:
            trainer.strategy.barrier(name)
            if trainer.local_rank != 0:
                usable = self._ensure(cache, name)
        return cache if usable else None

    def _ensure(self, cache: FeatureCache | ImageCache, name: str) -> bool:
        try:
            if isinstance(cache, FeatureCache):
                device = self.trainer.strategy.root_device if self.trainer is not None else "cpu"
                cache.ensure(self.batch_size, self.num_workers, device)
            else:
                cache.ensure(self.num_workers)
            return True
        except OSError as err:  # a full disk, a folder that cannot be made: train on, without the cache
            if isinstance(cache, FeatureCache):
                then = "the encoder will run at every step instead" + (
                    " (on the image cache)" if self.image_cache else ""
                )
            else:
                then = "images are read from their files instead"
            log.warning("%s: cannot write the %s (%s); %s", err.filename or cache.dir, name, err.strerror or err, then)
            return False

    def setup(self, stage: str) -> None:
        wanted = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("test",)}[stage]
        for split in wanted:
            if split not in self.datasets:
                self.datasets[split] = self._dataset(split, self.train_captions if split == "train" else "first")

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        dataset = self.datasets[split]
        if dataset.inputs is None:
            # Here, not in setup: Lightning sets the datamodule up before the model, whose setup loads `init_from`'s
            # weights, and before a resumed run's checkpoint is restored. The cache holds the annotations of the
            # encoder that is trained and saved: the one the model has now.
            dataset.inputs = self._inputs(split)
        cached = dataset.inputs.key == "annotations"
        workers = 0 if cached else self.num_workers
        return PrefetchingLoader(
            dataset,
            # Cached rows only: images read in this process would draw augmentation's crops from the global generator
            # in the thread, racing the step's dropout draws (worker processes have generators of their own).
            prefetch=self.prefetch if cached else 0,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=workers,
            persistent_workers=workers > 0,
            collate_fn=collate,
            pin_memory=torch.cuda.is_available(),
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)


class ShapesDataModule(CaptionDataModule):
    """The built-in synthetic set (see `captioner.data.shapes`); it needs no download.

    Args:
        train_size, val_size, test_size: images per split.
        seed: dataset seed (the same seed gives the same images and captions).
        canvas_size: side of the drawn images in pixels (the encoder then resizes them to its own input size).
        cache_images: also keep the drawn images as PNG under data_dir/images.
        **kwargs: see `CaptionDataModule`.
    """

    def __init__(
        self,
        data_dir: str = "data/shapes",
        train_size: int = 5000,
        val_size: int = 500,
        test_size: int = 500,
        seed: int = 0,
        canvas_size: int = 224,
        cache_images: bool = False,
        **kwargs,
    ):
        super().__init__(data_dir, **kwargs)
        self.save_hyperparameters()
        self.sizes = {"train": train_size, "val": val_size, "test": test_size}
        self.seed, self.canvas_size, self.cache_images = seed, canvas_size, cache_images

    def make_split(self, split: str) -> ShapesDataset:
        image_dir = str(self.data_dir / "images") if self.cache_images else None
        return ShapesDataset(split, self.sizes[split], self.seed, self.canvas_size, image_dir)


class CocoDataModule(CaptionDataModule):
    """Real captions: official COCO, Karpathy splits (COCO, Flickr8k, Flickr30k) or a custom folder.

    Layout under `data_dir` (see data/README.md):
        coco:      annotations/captions_{train,val}<year>.json and images in {train,val}<year>/.
                   The official test set has no public captions: val and test both use the val annotations.
        karpathy:  <split_file> (e.g. dataset_coco.json) and images under <image_root>/<filepath>/<filename>.
        custom:    <captions_file> (JSONL or CSV) and images under <image_dir>/; images are split into
                   train/val/test by a hash of their path (val_fraction, test_fraction).

    Args:
        data_dir: the dataset folder.
        format: "coco", "karpathy" or "custom".
        year: official COCO release, 2014 or 2017.
        split_file: Karpathy split JSON, relative to data_dir.
        image_root: Karpathy image folder, relative to data_dir.
        captions_file: custom captions file (.jsonl or .csv), relative to data_dir.
        image_dir: custom image folder, relative to data_dir.
        val_fraction, test_fraction: custom format only.
        max_train_caption_len: training captions with more words are skipped (counted in the summary line); val and
            test keep every reference, as the coco-caption scorers expect. Not the model's `max_caption_len`, the
            longest caption it generates.
        download: let prepare_data download what is missing (COCO images and annotations, Karpathy splits).
        urls: name -> URL overrides for the downloads (a mirror), see `captioner.data.download.COCO_URLS`.
        checksums: name -> SHA-256 of a download; a mismatch deletes the file and stops with an error.
        min_word_count: words seen fewer times in the training captions become <unk>.
        **kwargs: see `CaptionDataModule`.
    """

    def __init__(
        self,
        data_dir: str = "data/coco",
        format: Literal["coco", "karpathy", "custom"] = "karpathy",
        year: int = 2014,
        split_file: str = "dataset_coco.json",
        image_root: str = ".",
        captions_file: str = "captions.jsonl",
        image_dir: str = "images",
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        max_train_caption_len: int = 50,
        download: bool = False,
        urls: dict[str, str] | None = None,
        checksums: dict[str, str] | None = None,
        min_word_count: int = 5,
        **kwargs,
    ):
        super().__init__(data_dir, min_word_count=min_word_count, **kwargs)
        if format not in ("coco", "karpathy", "custom"):
            raise ConfigError(f"unknown dataset format {format!r}; choose coco, karpathy or custom")
        self.save_hyperparameters()
        self.format, self.year, self.split_file, self.image_root = format, year, split_file, image_root
        self.captions_file, self.image_dir = captions_file, image_dir
        self.val_fraction, self.test_fraction = val_fraction, test_fraction
        self.max_train_caption_len, self.download, self.urls = max_train_caption_len, download, urls or {}
        self.checksums = checksums or {}
        self._karpathy: dict[str, list] | None = None  # every split's records, once the Karpathy file is read

    def prepare_data(self) -> None:
        """Download what is missing (only with download: true); writes to disk, builds nothing in memory."""
        if not self.download:
            return
        from captioner.data.download import prepare_coco

        prepare_coco(self.data_dir, self.format, self.year, self.split_file, self.urls, self.checksums)

    def make_split(self, split: str) -> EncodedSplit:
        """The split as `read_split` reads it, kept in a file under data_dir/splits/ named by the dataset's file
        (its path, size and modification time) and the options that shape the split: later runs, and the other
        processes of a DDP run, read that file instead (one process builds it, the others wait for it). A damaged file
        is said in one warning and made again; a folder that cannot be written costs one warning, and the reading
        in every run. A later run does not look for the image files again: one deleted since is reported when the
        feature cache or a batch reads it."""
        # The vocabulary (and so the model) is built when the CLI starts, before Lightning calls prepare_data:
        # download here first. It is idempotent, so Lightning's own call later costs nothing.
        if self.download:
            self.prepare_data()
        name, path = self._split_file(split)
        if path is None:  # the dataset's file is missing: read_split names it
            return EncodedSplit.from_caption_set(self.read_split(split), name)
        try:
            with build_lock(path):
                if path.exists():
                    try:
                        return EncodedSplit.load(path)
                    except ValueError as err:
                        log.warning("%s: unreadable (%s); reading the split again", path, err)
                encoded = EncodedSplit.from_caption_set(self.read_split(split), name)
                encoded.save(path)
            if self.format == "karpathy":  # its file holds every split, read now: keep the others too
                for other in ("train", "val", "test"):
                    other_name, other_path = self._split_file(other)
                    if other not in self._splits and other_path is not None and not other_path.exists():
                        with build_lock(other_path):
                            try:
                                if not other_path.exists():
                                    EncodedSplit.from_caption_set(self.read_split(other), other_name).save(other_path)
                            except ConfigError:  # a split with no usable image: said if and when it is used
                                pass
            return encoded
        except OSError as err:  # the folder, the lock or the file cannot be written
            log.warning("%s: cannot be written (%s); the split is read again in every run", path, err.strerror or err)
            return EncodedSplit.from_caption_set(self.read_split(split), name)

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
        return name, self.data_dir / "splits" / f"{name}-{key}.npz"

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
        """The split read from the dataset's files and cleaned (`clean`): what `make_split` keeps."""
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
                if self._custom_split(str(r.image_id)) == split
            ]
        name = f"{root.name}-{self.format}-{split}"
        max_words = self.max_train_caption_len if split == "train" else None
        return CaptionSet(name, *clean(records, max_words, name))

    def _custom_split(self, image: str) -> str:
        u = zlib.crc32(image.encode()) / 2**32  # stable across runs and machines
        return "test" if u < self.test_fraction else "val" if u < self.test_fraction + self.val_fraction else "train"
