"""A split's captions and inputs as a Dataset, and its batches: what the loaders of every DataModule share."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset

from captioner.data.disk_cache import ImageSource
from captioner.data.inputs import Inputs
from captioner.data.vocab import Vocabulary


class CaptionSource(ImageSource, Protocol):
    """A dataset split: images plus reference captions."""

    def captions(self, index: int) -> list[str]: ...


@dataclass
class CaptionTable:
    """Every caption of a split as vocabulary ids, in one array, image by image: image i has `counts[i]` captions,
    its caption j is row `first[i] + j`, and that row's ids (<start> w1 ... wn <end>) are
    `tokens[starts[row] : starts[row] + lengths[row]]`. A batch's captions are gathered from it at once (`padded`)."""

    tokens: np.ndarray  # (ids,) every caption's ids, end to end
    lengths: np.ndarray  # (captions,) each caption's number of ids
    counts: np.ndarray  # (images,) each image's number of captions
    first: np.ndarray = field(init=False)  # (images,) each image's first caption
    starts: np.ndarray = field(init=False)  # (captions,) each caption's first id

    def __post_init__(self) -> None:
        self.tokens, self.lengths, self.counts = (x.astype(np.int64) for x in (self.tokens, self.lengths, self.counts))
        self.first = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)

    @classmethod
    def from_lists(cls, captions: list[list[list[int]]]) -> CaptionTable:
        """From each image's captions as lists of ids."""
        counts = np.array([len(caps) for caps in captions], dtype=np.int64)
        lengths = np.array([len(c) for caps in captions for c in caps], dtype=np.int64)
        tokens = np.array([token for caps in captions for c in caps for token in c], dtype=np.int64)
        return cls(tokens, lengths, counts)

    def __len__(self) -> int:
        return len(self.counts)

    def ids(self, image: int, caption: int) -> np.ndarray:
        """Caption `caption` of image `image`, as ids (a view into `tokens`)."""
        row = int(self.first[image]) + caption
        start = int(self.starts[row])
        return self.tokens[start : start + int(self.lengths[row])]

    def padded(self, pairs: list[tuple[int, int]]) -> dict:
        """The captions of (image, caption) `pairs`, gathered at once and padded with <pad>: captions (B,T) and their
        lengths (B,)."""
        rows = self.first[[image for image, _ in pairs]] + np.array([caption for _, caption in pairs], dtype=np.int64)
        starts, lengths = self.starts[rows], self.lengths[rows]
        columns = np.arange(lengths.max())
        real = columns < lengths[:, None]  # (B,T)
        captions = np.full(real.shape, Vocabulary.pad_index, dtype=np.int64)
        captions[real] = self.tokens[(starts[:, None] + columns)[real]]
        return {"captions": torch.from_numpy(captions), "lengths": torch.from_numpy(lengths)}


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
        captions: CaptionTable,
        references: Sequence[list[list[str]]],
        mode: str,
        objects: list | None = None,
        captions_per_image: int = 5,
    ):
        """`captions`: the split's captions as vocabulary ids. `references`: each image's captions' tokens (a list, or
        one that makes an image's when they are read). `captions_per_image`: k of the "grouped" mode."""
        self.source, self.captions, self.references, self.mode = source, captions, references, mode
        self.captions_per_image = captions_per_image
        self.objects = objects  # ground-truth objects per image (shapes only), for attention correctness
        self.inputs: Inputs | None = None  # given by the datamodule when its loader is made
        counts = captions.counts.tolist()
        self.items = [(i, j) for i, n in enumerate(counts) for j in range(n)] if mode == "all" else None
        # The seed of this epoch's caption draws (`new_epoch`), in shared memory: persistent worker processes read
        # each epoch's from it, as the loader's own process writes it
        self._epoch_seed = torch.zeros((), dtype=torch.int64).share_memory_()

    @property
    def draws_captions(self) -> bool:
        """Whether its items draw captions at random ("random" and "grouped")."""
        return self.mode in ("random", "grouped")

    def new_epoch(self, seed: int) -> None:
        """Called by the loader as an epoch's iterator is made, in the training loop's thread, with a seed drawn there
        from Python's generator (`PrefetchingLoader`). Each image's caption draws are a function of that seed and the
        image alone (`_generator`), not of a shared generator's history: they are the same whichever thread or worker
        makes them, however far it reads ahead, and an epoch cut short (`limit_train_batches`) leaves nothing
        behind that the next epoch, or a resumed run, would draw differently. The seed is kept in shared memory, so
        that worker processes kept from epoch to epoch (`persistent_workers`) read it too: the loader gives them the
        new epoch's indices only after this call."""
        self._epoch_seed.fill_(seed)

    @property
    def epoch_seed(self) -> int:
        return int(self._epoch_seed)

    def _generator(self, image: int) -> random.Random:
        """Image `image`'s generator of this epoch's caption draws."""
        return random.Random(self.epoch_seed * 2**40 + image)

    def __len__(self) -> int:
        return len(self.items) if self.items is not None else len(self.captions)

    def _pair(self, index: int) -> tuple[int, int]:
        """Item `index`'s (image, caption); in "random" mode the caption is drawn here, one draw per item."""
        if self.items is not None:
            return self.items[index]
        return index, self._generator(index).randrange(int(self.captions.counts[index])) if self.mode == "random" else 0

    def _draw(self, image: int) -> list[int]:
        """The "grouped" mode's k captions of `image`: all of them, in order, when it has k; k of them drawn without
        replacement when it has more; all, then the rest drawn with replacement, when it has fewer."""
        count, k = int(self.captions.counts[image]), self.captions_per_image
        if count == k:
            return list(range(count))
        generator = self._generator(image)
        if count > k:
            return generator.sample(range(count), k)
        return list(range(count)) + generator.choices(range(count), k=k - count)

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
        item = {"index": image, "input": inputs, "caption": torch.from_numpy(self.captions.ids(image, caption).copy())}
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
        batch = {"annotations": self.inputs.rows(images)} | self.captions.padded(pairs)
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
        batch = {self.inputs.key: inputs} | self.captions.padded(pairs)
        return batch | {
            "index": torch.tensor([image for image, _ in kept]),
            "captions_per_image": self.captions_per_image,
        }


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
