"""LightningDataModules: the vocabulary, the inputs (the caches, built once, shared under DDP) and the loaders of
every dataset, and the two kinds there are: the built-in shapes set and real captions (COCO, Flickr, your own)."""

from __future__ import annotations

import hashlib
import logging
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

from captioner.data.dataset import CaptionDataset, CaptionSource, CaptionTable, collate
from captioner.data.disk_cache import DiskCache, shared
from captioner.data.features import FeatureCache
from captioner.data.image_cache import ImageCache
from captioner.data.inputs import Inputs
from captioner.data.prefetch import PrefetchingLoader
from captioner.data.shapes import ShapesDataset
from captioner.data.splits import EncodedSplit, SplitFiles, SplitTokens
from captioner.data.vocab import TOKENIZER_VERSION, Vocabulary, tokenize
from captioner.errors import ConfigError
from captioner.files import build_lock, writable
from captioner.models.encoder import Encoder

log = logging.getLogger(__name__)


def user_cache() -> Path:
    """This user's cache folder for captioner ($XDG_CACHE_HOME/captioner, or ~/.cache/captioner)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "captioner"


def _path_digest(folder: Path) -> str:
    """A short hash of a folder's absolute path: its cache folder's name in the user's cache."""
    return hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:8]


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
        data_dir: where the data is. It is only read, unless `download` fetches what is missing, or it is the cache
            folder (below).
        cache_dir: where what captioner derives from the data goes: its splits, vocabulary, feature and image caches,
            CIDEr tables. Default: the data folder itself, or, where that cannot be written (a lab's shared, read-only
            copy of COCO), a folder of this user's cache ($XDG_CACHE_HOME or ~/.cache, captioner/<data folder>-<hash
            of its path>), said in one line.
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
        cache_dir: str | None = None,
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
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self._cache: Path | None = None  # the cache folder, once decided (`cache`)
        self.batch_size, self.num_workers, self.prefetch = batch_size, num_workers, prefetch
        self.feature_cache, self.image_cache, self.train_captions = feature_cache, image_cache, train_captions
        self.min_word_count, self.max_vocab_size = min_word_count, max_vocab_size
        self.encoder: Encoder | None = None
        self.datasets: dict[str, CaptionDataset] = {}
        self._vocab: Vocabulary | None = None
        self._splits: dict[str, CaptionSource] = {}

    def make_split(self, split: str) -> CaptionSource:
        raise NotImplementedError

    @property
    def cache(self) -> Path:
        """The folder for what captioner derives from the data (`cache_dir`), decided when first needed."""
        if self._cache is None:
            self._cache = self.cache_dir or self.data_dir
            if self.cache_dir is None and not writable(self.data_dir):
                self._cache = user_cache() / f"{self.data_dir.resolve().name}-{_path_digest(self.data_dir)}"
                rank_zero_info(
                    f"{self.data_dir}: cannot be written; what captioner derives from it (splits, vocabulary, caches) "
                    f"goes to {self._cache} (--data.init_args.cache_dir chooses another folder)"
                )
        return self._cache

    @property
    def derived_before(self) -> list[Path]:
        """Where whole derived files (splits, vocabulary, caches) are looked for before `cache`: the data folder, when
        what captioner derives goes elsewhere because the data folder cannot be written (a lab's shared copy, whose
        derived files whoever could write it built once): they are used where they are, not made again."""
        return [self.data_dir] if self.cache_dir is None and self.cache != self.data_dir else []

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
            name = f"vocab-{getattr(train, 'captions_identity', train.identity)}-{limits}.json"  # shapes: its seed
            path = self.cache / name
            made = next((p for p in (*(f / name for f in self.derived_before), path) if p.exists()), None)
            if made is not None:  # read first, without the lock: a folder that cannot be written is read all the same
                self._vocab = Vocabulary.load(made)
                return self._vocab
            with build_lock(path):
                if path.exists():  # made by another process while this one waited
                    self._vocab = Vocabulary.load(path)
                else:
                    if isinstance(train, EncodedSplit):  # its word ids counted at once
                        counts = train.word_counts()
                    else:
                        counts = Counter(
                            word for i in range(len(train)) for tokens in _tokens(train, i) for word in tokens
                        )
                    self._vocab = Vocabulary.from_counts(counts, self.min_word_count, self.max_vocab_size)
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
            references = SplitTokens(source)
            captions = CaptionTable(*source.encode(self.vocab), source.counts)
        else:
            references = [_tokens(source, i) for i in range(len(source))]  # each caption tokenized once
            captions = CaptionTable.from_lists([[self.vocab.encode(tokens) for tokens in caps] for caps in references])
        objects = [source.objects(i) for i in range(len(source))] if hasattr(source, "objects") else None
        return CaptionDataset(source, captions, references, mode, objects, self.captions_per_image)

    def _inputs(self, split: str) -> Inputs:
        """What the model reads of the split's images: the frozen encoder's cached annotations (the cache built first
        if missing), or else the preprocessed images, from the image cache (`image_cache`) or their files. Said in one
        line (from the first process), so that a run's log says which path fed it."""
        source, encoder = self.split(split), self._model_encoder()
        augment = self.augment and split == "train"
        features = images = None
        if self.feature_cache and encoder.frozen and not augment:
            cache = self._whole(lambda root: FeatureCache(root / "features", encoder, source))
            instead = "the encoder will run at every step instead" + (
                " (on the image cache)" if self.image_cache else ""
            )
            options = {"batch_size": self.batch_size, "num_workers": self.num_workers, "device": self._device()}
            features = cache if shared(cache, self.trainer, instead, **options) else None
        if features is None and self.image_cache:
            cache = self._whole(lambda root: ImageCache(root / "image_cache", encoder.preprocessing, source))
            instead = "images are read from their files instead"
            images = cache if shared(cache, self.trainer, instead, num_workers=self.num_workers) else None
        # Images leave the loader as uint8, and the encoder normalises them on its device (4x fewer bytes to copy);
        # augmentation's colour jitter works on floats, so augmented images leave normalised.
        transform = encoder.preprocessing.transforms(augment, normalize=augment)
        inputs = Inputs(source, transform, features, images, pin=self._pinned())
        rank_zero_info(f"{split} split: the model reads {inputs.where()}")
        return inputs

    def _whole(self, make: Callable[[Path], DiskCache]) -> DiskCache:
        """The cache `make(root)` gives: where it is whole under `derived_before`, else under `cache`."""
        for root in self.derived_before:
            cache = make(root)
            if cache.open():
                return cache
        return make(self.cache)

    def _device(self) -> torch.device:
        """Where the trainer runs (the CPU without one): where the feature cache's build runs the encoder."""
        return self.trainer.strategy.root_device if self.trainer is not None else torch.device("cpu")

    def _pinned(self) -> bool:
        """Batches in page-locked memory, whose copy to the device does not wait: where the trainer runs on CUDA, not
        wherever CUDA is (a CPU run on a GPU machine would initialise CUDA to pin)."""
        return self._device().type == "cuda"

    def setup(self, stage: str) -> None:
        wanted = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("test",)}[stage]
        for split in wanted:
            if split not in self.datasets:
                self.datasets[split] = dataset = self._dataset(
                    split, self.train_captions if split == "train" else "first"
                )
                table = dataset.captions  # said first, so that a wrong split or folder is seen at once
                rank_zero_info(
                    f"{split} split: {len(table):,} images, {int(table.counts.sum()):,} captions "
                    f"({dataset.source.identity})"
                )

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
            # kept from epoch to epoch: they read each epoch's seed of caption draws from shared memory (`new_epoch`)
            persistent_workers=workers > 0,
            collate_fn=collate,
            pin_memory=dataset.inputs.pin,
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
        split_file: Karpathy split JSON (or Flickr8k's own `Flickr8k.token.txt`, its lists beside it), relative to
            data_dir or absolute.
        image_root: Karpathy image folder, relative to data_dir or absolute: images found there are not downloaded.
        captions_file: custom captions file (.jsonl or .csv), relative to data_dir.
        image_dir: custom image folder, relative to data_dir.
        val_fraction, test_fraction: custom format only.
        max_train_caption_len: training captions with more words are skipped (counted in the summary line); val and
            test keep every reference, as the coco-caption scorers expect. Not the model's `max_caption_len`, the
            longest caption it generates.
        download: let prepare_data download what is missing, small files first: the split file (COCO, Flickr8k and
            Flickr30k's, from the first of its sources that answers with the split's known counts) or COCO's
            annotations, then the image archives not found under image_root (`captioner.data.download.prepare`).
        urls: source name -> URL overrides for the downloads (a mirror), see `captioner.data.sources.SOURCES`.
        checksums: source name -> SHA-256 of a download; a mismatch deletes the file and stops with an error.
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
        self.split_files = SplitFiles(
            self.data_dir,
            format,
            year,
            split_file,
            image_root,
            captions_file,
            image_dir,
            val_fraction,
            test_fraction,
            max_train_caption_len,
        )

    def prepare_data(self) -> None:
        """Download what is missing (only with download: true); writes to disk, builds nothing in memory."""
        if not self.download:
            return
        from captioner.data.download import prepare

        prepare(self.data_dir, self.format, self.year, self.split_file, self.image_root, self.urls, self.checksums)

    def make_split(self, split: str) -> EncodedSplit:
        """The split, read once from the dataset's files and kept under the cache folder's splits/
        (`SplitFiles.split`)."""
        # The vocabulary (and so the model) is built when the CLI starts, before Lightning calls prepare_data:
        # download here first. It is idempotent, so Lightning's own call later costs nothing.
        if self.download:
            self.prepare_data()
        self.split_files.cache_dir, self.split_files.read_before = self.cache, self.derived_before
        return self.split_files.split(split)
