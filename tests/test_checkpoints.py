"""Model files (captioner.checkpoints): an encoder's weights are left out of a file exactly when they are its
pretrained source's, whatever the run's options, and every file loads with the weights it was trained with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from captioner.api import Captioner
from captioner.checkpoints import (
    ANNOTATION_FINGERPRINT,
    EXPORT_FORMAT,
    FINGERPRINT,
    Fingerprint,
    build_model,
    encoder_left_out,
    export,
    load_initial_weights,
    model_file,
)
from captioner.cli import run_lightning_cli
from captioner.data.features import FeatureCache
from captioner.data.shapes import ShapesDataset
from captioner.errors import CaptionerError
from captioner.models.encoder import Encoder
from captioner.models.show_attend_tell import ShowAttendTell
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
    """Fine-tune, then start a frozen run from that checkpoint (init_from): its
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
        assert not file.has_encoder and file.fingerprint == Fingerprint(lite0.fingerprint())
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


def test_a_file_that_left_out_its_encoder_starts_a_model_of_another_image_size_or_grid(tiny_checkpoint, lite0):
    """Its record is of the weights alone: 256-pixel images (an 8x8 grid) or the 14x14 grid of the same pretrained
    weights are the weights it left out."""
    from captioner.models.show_attend_tell import ShowAttendTell

    file = model_file(tiny_checkpoint)
    assert not file.has_encoder and file.fingerprint is not None
    sizes = {k: file.hparams[k] for k in ("embed_dim", "decoder_dim", "attention_dim")}
    for options in ({"image_size": 256}, {"grid_size": 14}):
        model = ShowAttendTell(len(file.vocab), **sizes, **options)
        assert model.encoder.grid_hw != (7, 7)
        load_initial_weights(model, tiny_checkpoint, file.vocab)
        assert all(torch.equal(v, lite0.state_dict()[k]) for k, v in model.encoder.state_dict().items())
        decoder = {k: v for k, v in file.weights.items() if k.startswith("decoder.")}
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in decoder.items())


def test_a_file_written_before_the_weights_record_is_checked_as_it_was_written(tiny_checkpoint, tmp_path, lite0):
    """Older files recorded the encoder's annotation fingerprint (weights, preprocessing and grid): they load as
    before, also into a model of another image size or grid, and one whose weights are not those here is still a
    one-line error."""
    state = torch.load(tiny_checkpoint, map_location="cpu", weights_only=True)
    del state[FINGERPRINT]
    for value, name in ((lite0.annotation_fingerprint(), "old.ckpt"), ("0" * 64, "other.ckpt")):
        torch.save({**state, ANNOTATION_FINGERPRINT: value}, tmp_path / name)
    assert model_file(tmp_path / "old.ckpt").fingerprint == Fingerprint(lite0.annotation_fingerprint(), True)
    want = [r.tokens for r in Captioner.load(tiny_checkpoint).caption(IMAGES)]
    assert [r.tokens for r in Captioner.load(tmp_path / "old.ckpt").caption(IMAGES)] == want
    exported = model_file(export(tmp_path / "old.ckpt", tmp_path / "old.pt"))  # an export keeps the old record
    assert not exported.has_encoder and exported.fingerprint == Fingerprint(lite0.annotation_fingerprint(), True)
    with pytest.raises(CaptionerError, match=r"other\.ckpt: it left out its efficientnet_lite0 weights"):
        Captioner.load(tmp_path / "other.ckpt")
    # Started at another image size, or another grid, the same weights are the weights it left out: its record is
    # checked under its own preprocessing and grid (before, refused as "not those it was trained with")
    from captioner.models.show_attend_tell import ShowAttendTell

    file = model_file(tmp_path / "old.ckpt")
    sizes = {k: file.hparams[k] for k in ("embed_dim", "decoder_dim", "attention_dim")}
    for options in ({"image_size": 256}, {"grid_size": 14}):
        model = ShowAttendTell(len(file.vocab), **sizes, **options)
        load_initial_weights(model, tmp_path / "old.ckpt", file.vocab)
        assert all(torch.equal(v, lite0.state_dict()[k]) for k, v in model.encoder.state_dict().items())
    with pytest.raises(CaptionerError, match=r"other\.ckpt: it left out its efficientnet_lite0 weights"):
        load_initial_weights(
            ShowAttendTell(len(file.vocab), **sizes, image_size=256), tmp_path / "other.ckpt", file.vocab
        )


def test_the_weights_fingerprint_takes_any_dtype_and_ignores_the_image_size(lite0):
    """bfloat16 weights (`--trainer.precision=bf16-true`) are hashed byte for byte; numpy has no bfloat16."""
    assert Encoder("efficientnet_lite0", image_size=256).fingerprint() == lite0.fingerprint()
    assert Encoder("efficientnet_lite0", image_size=256).annotation_fingerprint() != lite0.annotation_fingerprint()
    bf16 = Encoder("efficientnet_lite0").to(torch.bfloat16).fingerprint()
    fp16 = Encoder("efficientnet_lite0").to(torch.float16).fingerprint()
    assert len({bf16, fp16, lite0.fingerprint()}) == 3


def test_a_frozen_encoder_is_hashed_once_per_set_of_weights(monkeypatch):
    """Every checkpoint save asks whether the encoder can be left out; a frozen encoder's weights are hashed again
    only once they have changed (loaded, or cast), a trainable one's at every ask."""
    from captioner.models import encoder as module

    encoder = Encoder("efficientnet_lite0")  # hashed once here: its pretrained source's fingerprint
    digest, hashed = module._digest, []
    monkeypatch.setattr(module, "_digest", lambda header, tensors: hashed.append(header) or digest(header, tensors))
    assert encoder_left_out(encoder) == encoder_left_out(encoder) == encoder.source_fingerprint and not hashed
    changed = {k: v + 1 if v.is_floating_point() else v for k, v in encoder.state_dict().items()}
    encoder.load_state_dict(changed)
    assert encoder_left_out(encoder) is None and encoder_left_out(encoder) is None and len(hashed) == 1
    encoder.to(torch.float64)
    assert encoder.fingerprint() == encoder.fingerprint() and len(hashed) == 2
    encoder.fine_tune(1)  # trainable: an optimizer step changes its weights in place
    encoder.fingerprint(), encoder.fingerprint()
    assert len(hashed) == 4


def test_export_builds_no_pretrained_encoder_for_a_file_that_holds_its_own(tiny_checkpoint, tmp_path, monkeypatch):
    """Building one costs its weights' load (a download, for torchvision's), and a file with its encoder needs none."""
    from captioner import checkpoints

    full = export(tiny_checkpoint, tmp_path / "full.pt", include_encoder=True)  # rebuilt from the source: needed here
    monkeypatch.setattr(checkpoints, "_source_encoder", lambda file: pytest.fail("a pretrained encoder was built"))
    again = model_file(export(full, tmp_path / "again.pt"))
    assert again.has_encoder and again.fingerprint is None
    assert all(torch.equal(v, model_file(full).weights[k]) for k, v in again.weights.items())


def test_a_file_written_before_the_renames_keeps_its_options_and_old_names_are_refused_in_one_line(
    tmp_path, capfd, tiny_checkpoint
):
    """Options renamed since a file could be written (`RENAMED`): the file's values under the old names are read
    under the new ones, not dropped, by `Captioner.load` and by Lightning's `load_from_checkpoint`; on the command
    line and in a config file the old name is refused in one line that names the new one. The bundled model is such
    a file (written with `entropy_weight`, at its default); the test's own file has non-default values of both."""
    from captioner.api import Captioner
    from captioner.checkpoints import RENAMED, model_file
    from captioner.lit_module import CaptioningModule
    from tests.conftest import run_main

    bundled_path = Path(__file__).parent.parent / "captioner" / "assets" / "shapes.pt"
    raw = torch.load(bundled_path, map_location="cpu", weights_only=True)["hparams"]  # as written, before any rename
    assert "entropy_weight" in raw and "reinforce_entropy_weight" not in raw
    bundled = model_file(bundled_path)  # read under the current names
    assert (
        not RENAMED.keys() & bundled.hparams.keys()
        and bundled.hparams["reinforce_entropy_weight"] == raw["entropy_weight"]
    )

    state = torch.load(tiny_checkpoint, map_location="cpu", weights_only=False)  # a `captioner fit` checkpoint
    old = {"entropy_weight": 0.05, "attention_entropy_weight": 0.7}  # as a file written before the renames held them
    for new in RENAMED.values():
        state["hyper_parameters"].pop(new, None)
    state["hyper_parameters"] |= old
    torch.save(state, tmp_path / "old.ckpt")
    model = Captioner.load(tmp_path / "old.ckpt").model
    assert (model.reinforce_entropy_weight, model.attention_entropy_penalty) == (0.05, 0.7)
    restored = CaptioningModule.load_from_checkpoint(tmp_path / "old.ckpt", map_location="cpu").model
    assert (restored.reinforce_entropy_weight, restored.attention_entropy_penalty) == (0.05, 0.7)

    ran = run_main(capfd, "fit", "--config", "configs/debug.yaml", "--model.entropy_weight=0.1")
    assert ran.status == 2 and ran.err.splitlines() == [
        "error: --model.entropy_weight is now --model.reinforce_entropy_weight"
    ]
    config = tmp_path / "old.yaml"
    config.write_text("model:\n  attention_entropy_weight: 0.5\n")
    ran = run_main(capfd, "fit", "--config", "configs/debug.yaml", "--config", str(config))
    assert ran.status == 2 and ran.err.splitlines() == [
        f"error: {config}: model.attention_entropy_weight is now model.attention_entropy_penalty"
    ]


class _RunsCode:
    """An object whose unpickling calls a function: here it touches a file, where a hostile file would run anything."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def test_a_checkpoint_whose_pickle_would_run_code_is_refused_in_one_line_by_every_reader(
    tmp_path, capfd, tiny_checkpoint
):
    """A fit checkpoint with one hostile object beside its weights: every way to read a model file refuses it in one
    line naming it, and never unpickles the object (the marker file it would touch stays absent):
    `CaptioningModule.load_from_checkpoint`, and through it `captioner evaluate`, included."""
    from captioner.lit_module import CaptioningModule
    from tests.conftest import run_main

    marker = tmp_path / "ran"
    state = torch.load(tiny_checkpoint, map_location="cpu", weights_only=True)
    state["hyper_parameters"]["entropy_weight"] = 0.01  # an old name too: the renames' path reads the file first
    state["payload"] = _RunsCode(marker)
    hostile = tmp_path / "hostile.ckpt"
    torch.save(state, hostile)
    refusal = f"{hostile}: refused: it holds pickled objects besides weights"

    for load in (
        lambda: Captioner.load(hostile),
        lambda: export(hostile, tmp_path / "out.pt"),
        lambda: CaptioningModule.load_from_checkpoint(hostile),
        lambda: CaptioningModule.load_from_checkpoint(str(hostile), map_location="cpu"),
    ):
        with pytest.raises(CaptionerError) as refused:
            load()
        assert str(refused.value).startswith(refusal), str(refused.value)
    del state["hyper_parameters"]["entropy_weight"]
    torch.save(state, hostile)  # without an old name, Lightning's own reader is the first to read it
    with pytest.raises(CaptionerError, match="refused: it holds pickled objects"):
        CaptioningModule.load_from_checkpoint(hostile)

    commands = [
        ["caption", "docs/images/shapes_test_0.png", "--ckpt_path", str(hostile)],
        ["evaluate", "--ckpt_path", str(hostile), "--output", str(tmp_path / "eval")],
        ["export", "--ckpt_path", str(hostile), "--output", str(tmp_path / "out.pt")],
        ["demo", "--ckpt_path", str(hostile), "--samples", "0"],
        ["fit", *tiny_fit_args(tmp_path / "init", f"--model.init_from={hostile}")],
        ["fit", *tiny_fit_args(tmp_path / "resume", "--trainer.max_epochs=2"), "--ckpt_path", str(hostile)],
        ["test", *tiny_fit_args(tmp_path / "test"), "--ckpt_path", str(hostile)],
    ]
    for command in commands:
        ran = run_main(capfd, *command)
        errors = [line for line in ran.err.splitlines() if line.startswith("error:")]
        assert ran.status == 2 and errors and "refused: it holds pickled objects" in errors[0], (command[0], ran.err)
        assert str(hostile) in errors[0] or "init_from" in errors[0]
    assert not marker.exists()


def test_a_checkpoint_at_an_fsspec_url_loads_through_lightning_s_reader(tiny_checkpoint):
    """`CaptioningModule.load_from_checkpoint` leaves a URL to Lightning's reader (fsspec), weights only, rather than
    open every path itself, where a URL is not found."""
    import fsspec

    from captioner.lit_module import CaptioningModule

    url = "memory://checkpoints/best.ckpt"
    with fsspec.open(url, "wb") as remote, open(tiny_checkpoint, "rb") as local:
        remote.write(local.read())
    try:
        restored = CaptioningModule.load_from_checkpoint(url, map_location="cpu")
    finally:
        fsspec.filesystem("memory").rm(url)
    original = CaptioningModule.load_from_checkpoint(tiny_checkpoint, map_location="cpu")
    assert restored.vocab.to_list() == original.vocab.to_list()
    for name, weight in original.state_dict().items():
        assert torch.equal(restored.state_dict()[name], weight), name


def test_a_file_that_left_out_an_encoder_whose_weights_are_not_here_says_how_to_export_one_that_holds_them(
    tmp_path, monkeypatch
):
    """An exported ResNet model leaves out its pretrained encoder, which loading rebuilds from torchvision's weights:
    where they cannot be had (offline, none cached), one line names the file and `--include-encoder`, not "set
    pretrained: false", which cannot apply to a file."""
    import captioner.models.backbones as encoder_module
    from captioner.errors import WeightsUnavailableError

    def unavailable(weights, name):
        raise WeightsUnavailableError(f"cannot download {name} weights (offline)")

    model = ShowAttendTell(30, backbone="resnet50", pretrained=False, embed_dim=8, decoder_dim=8, attention_dim=8)
    weights = {k: v for k, v in model.state_dict().items() if not k.startswith("encoder.")}
    hparams = {"backbone": "resnet50", "embed_dim": 8, "decoder_dim": 8, "attention_dim": 8}
    path = tmp_path / "resnet.pt"
    state = {"format": EXPORT_FORMAT, "hparams": hparams, "vocab": [f"w{i}" for i in range(30)], "state_dict": weights}
    torch.save(state | {FINGERPRINT: "0" * 16}, path)
    monkeypatch.setattr(encoder_module, "_torchvision_state_dict", unavailable)
    with pytest.raises(WeightsUnavailableError) as refused:
        Captioner.load(path)
    assert str(refused.value) == (
        f"{path}: it left out its resnet50 encoder, to be rebuilt from the pretrained weights, which are not on this "
        "machine (cannot download resnet50 weights (offline)); where they are, `captioner export --include-encoder` "
        "writes a file that holds them"
    )


@pytest.mark.ci  # seven commands: about half a minute
def test_no_command_reads_a_file_with_weights_only_false(tiny_checkpoint, tiny_model, tmp_path, capfd, monkeypatch):
    """Every torch.load of every command (fit from a start and resumed, test, evaluate, export in both formats,
    caption, and loading in Python) reads weights only: none asks for weights_only=False, which unpickles code."""
    from tests.conftest import run_main

    asked = []
    real_load = torch.load

    def spy(*args, **kwargs):
        asked.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    image = tmp_path / "shape.png"
    ShapesDataset("test", 1).load_image(0).save(image)
    folder = tmp_path / "run"
    commands = [
        ["fit", *tiny_fit_args(folder, f"--model.init_from={tiny_checkpoint}")],
        ["fit", *tiny_fit_args(folder, "--trainer.max_epochs=2", "--ckpt_path=last")],
        ["test", *tiny_fit_args(folder, f"--ckpt_path={folder / 'checkpoints' / 'best.ckpt'}")],
        ["evaluate", "--ckpt_path", tiny_checkpoint, "--output", str(tmp_path / "evaluation"), "--split", "val"],
        ["export", "--ckpt_path", tiny_checkpoint, "--output", str(tmp_path / "model.pt")],
        ["caption", str(image), "--ckpt_path", tiny_model],
        ["caption", str(image), "--ckpt_path", "shapes"],
    ]
    for command in commands:
        ran = run_main(capfd, *command)
        assert ran.status == 0, (command[0], ran.err[-3000:])
    Captioner.load(tmp_path / "model.pt")
    assert asked and False not in asked, asked
