"""`train_captions: grouped`: batches of images, each read (or encoded) once with k of its captions, whose loss is
the loss of the same (image, caption) pairs batched one caption per row."""

import random

import pytest
import torch

from captioner.data.datamodules import ShapesDataModule
from captioner.models.encoder import Encoder
from captioner.models.show_attend_tell import ShowAttendTell
from captioner.objectives import TeacherForcing


@pytest.fixture(scope="module")
def encoder() -> Encoder:
    return Encoder("efficientnet_lite0").eval()


def grouped_module(data_dir, encoder, k: int, **options) -> ShapesDataModule:
    options = {"num_workers": 0, "batch_size": 4, "train_captions": "grouped", "captions_per_image": k} | options
    module = ShapesDataModule(str(data_dir), train_size=10, val_size=4, test_size=4, canvas_size=96, **options)
    module.set_encoder(encoder)
    module.setup("fit")
    return module


@pytest.mark.parametrize("feature_cache", [True, False])
def test_a_grouped_batch_holds_each_image_once_and_k_of_its_captions(tmp_path, encoder, feature_cache):
    """Each image of the batch once (its cached row, or its image), then its k captions in a row: all of them in
    order when it has k; k different ones when it has more; all, then repeats, when it has fewer. Every image of
    the split once an epoch."""
    for k in (1, 3, 5, 9):  # shapes images have 5 captions
        module = grouped_module(tmp_path / str(k), encoder, k, feature_cache=feature_cache)
        dataset = module.datasets["train"]
        key = "annotations" if feature_cache else "images"
        random.seed(0)
        batches = list(module.train_dataloader())
        assert sorted(i for batch in batches for i in batch["index"].tolist()) == list(range(10))
        for batch in batches:
            images = batch["index"].tolist()
            assert batch["captions_per_image"] == k and batch[key].shape[0] == len(images)
            assert batch["captions"].shape[0] == batch["lengths"].shape[0] == k * len(images)
            for row, image in enumerate(images):
                assert torch.equal(batch[key][row], dataset.inputs(image))  # its cached row, or its image
                mine = batch["captions"][k * row : k * row + k]
                lengths = batch["lengths"][k * row : k * row + k].tolist()
                got = [tuple(c[:n].tolist()) for c, n in zip(mine, lengths, strict=True)]
                count = int(dataset.captions.counts[image])
                every = [caption(dataset, image, j) for j in range(count)]
                assert set(got) <= set(every)
                if count == k:
                    assert got == every
                elif count > k:
                    assert len(set(got)) == k
                else:
                    assert got[:count] == every


def caption(dataset, image: int, j: int) -> tuple[int, ...]:
    return tuple(dataset.captions.ids(image, j).tolist())


def test_the_loss_of_a_grouped_batch_is_that_of_its_pairs_one_per_row(tmp_path, encoder):
    """The model repeats each image's annotations for its k captions: the same loss, to the bit, as the same pairs
    with each row's annotations given; and, from images, the same encoder gradients to rounding."""
    module = grouped_module(tmp_path, encoder, 3, feature_cache=False)
    batch = next(iter(module.train_dataloader()))
    model = ShowAttendTell(len(module.vocab), embed_dim=16, decoder_dim=16, attention_dim=16, dropout=0.0)
    model.encoder.fine_tune(1)
    grouped = TeacherForcing()(model, batch)[0]
    grouped.backward()
    want_grads = [p.grad.clone() for p in model.encoder.parameters() if p.requires_grad]
    model.zero_grad()
    rows = batch["images"].repeat_interleave(3, dim=0)
    pairs = {"images": rows, "captions": batch["captions"], "lengths": batch["lengths"]}
    plain = TeacherForcing()(model, pairs)[0]
    plain.backward()
    assert torch.equal(grouped, plain)
    grads = [p.grad for p in model.encoder.parameters() if p.requires_grad]
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(grads, want_grads, strict=True))
