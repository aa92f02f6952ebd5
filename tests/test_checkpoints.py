"""Model files (captioner.checkpoints): an encoder's weights are left out of a file exactly when they are its
pretrained source's, whatever the run's options, and every file loads with the weights it was trained with."""

from __future__ import annotations

import pytest
import torch

from captioner.api import Captioner
from captioner.checkpoints import FINGERPRINT, build_model, encoder_left_out, export, model_file
from captioner.cli import run_lightning_cli
from captioner.data.features import FeatureCache
from captioner.data.shapes import ShapesDataset
from captioner.errors import CaptionerError
from captioner.models.encoder import Encoder
from tests.conftest import tiny_fit_args

IMAGES = [ShapesDataset("test", 3, seed=5).load_image(i) for i in range(3)]


def encoder_weights(path) -> dict[str, torch.Tensor]:
    """The encoder weights a file's model is loaded with (rebuilt from the source where the file left them out)."""
    model = build_model(model_file(path), str(path))
    return {k.removeprefix("encoder."): v for k, v in model.state_dict().items() if k.startswith("encoder.")}


def test_the_rule_compares_the_weights_with_their_pretrained_source(lite0):
    encoder = Encoder("efficientnet_lite0", pretrained=True)
    assert encoder_left_out(encoder) == encoder.source_fingerprint == lite0.fingerprint()  # frozen or not
    encoder.fine_tune(1)
    assert encoder_left_out(encoder) is not None  # unfrozen, but not yet changed: still the source's weights
    with torch.no_grad():
        next(encoder.parameters()).add_(1e-3)
    assert encoder_left_out(encoder) is None  # changed: written
    assert encoder_left_out(Encoder("efficientnet_lite0", pretrained=False)) is None  # no source to rebuild from


def test_a_frozen_run_started_from_a_fine_tuned_checkpoint_keeps_and_caches_that_encoder(tmp_path, lite0):
    """The reproduction of issue #52: fine-tune, then start a frozen run from that checkpoint (init_from). Its
    checkpoints and exports hold the fine-tuned encoder, load with it, and its feature cache was built from it."""
    sizes = ["--data.init_args.train_size=16", "--data.init_args.val_size=8", "--data.init_args.batch_size=8"]
    data = [f"--data.init_args.data_dir={tmp_path / 'data'}", *sizes]
    run_lightning_cli(["fit", *tiny_fit_args(tmp_path / "tuned", *data, "--model.fine_tune_blocks=1")])
    tuned = tmp_path / "tuned" / "checkpoints" / "best.ckpt"
    assert model_file(tuned).has_encoder and model_file(tuned).fingerprint is None
    tuned_encoder = encoder_weights(tuned)
    assert any(not torch.equal(v, lite0.state_dict()[k]) for k, v in tuned_encoder.items())

    run_lightning_cli(["fit", *tiny_fit_args(tmp_path / "frozen", *data, f"--model.init_from={tuned}")])
    for name in ("best.ckpt", "last.ckpt"):
        frozen = tmp_path / "frozen" / "checkpoints" / name
        assert model_file(frozen).has_encoder and FINGERPRINT not in torch.load(frozen, weights_only=True)
        weights = encoder_weights(frozen)
        assert all(torch.equal(weights[k], v) for k, v in tuned_encoder.items())  # frozen: the fine-tuned weights
    exported = export(tmp_path / "frozen" / "checkpoints" / "best.ckpt", tmp_path / "frozen.pt")
    assert model_file(exported).has_encoder
    weights = encoder_weights(exported)
    assert all(torch.equal(weights[k], v) for k, v in tuned_encoder.items())
    captions = [r.tokens for r in Captioner.load(exported).caption(IMAGES)]
    assert captions == [
        r.tokens for r in Captioner.load(tmp_path / "frozen" / "checkpoints" / "best.ckpt").caption(IMAGES)
    ]

    # The frozen run's cache holds the fine-tuned encoder's annotations: no cache of the pretrained encoder was built
    encoder = Encoder("efficientnet_lite0", pretrained=False)
    encoder.load_state_dict(tuned_encoder)
    splits = {split: ShapesDataset(split, size) for split, size in (("train", 16), ("val", 8))}
    expected = {FeatureCache(tmp_path / "data" / "features", encoder, source).dir for source in splits.values()}
    assert {path for path in (tmp_path / "data" / "features").iterdir() if path.is_dir()} == expected


def test_a_frozen_pretrained_run_leaves_its_encoder_out_of_checkpoints_and_exports_and_says_which(
    tiny_checkpoint, tiny_model, lite0, tmp_path
):
    checkpoint = model_file(tiny_checkpoint)
    exported = model_file(tiny_model)
    for file in (checkpoint, exported):
        assert not file.has_encoder and file.fingerprint == lite0.fingerprint()
    included = model_file(export(tiny_checkpoint, tmp_path / "full.pt", True))
    assert included.has_encoder and included.fingerprint is None
    assert all(torch.equal(v, lite0.state_dict()[k.removeprefix("encoder.")]) for k, v in included.weights.items()
               if k.startswith("encoder."))  # fmt: skip


def test_an_export_whose_left_out_encoder_is_not_the_one_here_is_one_line(tiny_model, tmp_path):
    state = torch.load(tiny_model, weights_only=True)
    state[FINGERPRINT] = "0" * 64  # trained with other pretrained weights than those installed here
    torch.save(state, tmp_path / "other.pt")
    with pytest.raises(CaptionerError, match=r"other\.pt: it left out its efficientnet_lite0 weights"):
        Captioner.load(tmp_path / "other.pt")
