import subprocess
import sys

import pytest
import torch

from captioner import Captioner
from captioner.data.images import ImageError
from captioner.errors import CaptionerError
from tests.images import photo, write_bad_files


def test_import_captioner_pulls_in_no_cli_logger_or_plotting():
    heavy = ("matplotlib", "captioner.cli", "lightning", "tensorboard")
    code = f"import sys, captioner; print([m for m in {heavy} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_caption_paths_and_pil_images(tiny_model, tmp_path):
    path = tmp_path / "coffee.jpg"
    photo("coffee").save(path)
    captioner = Captioner.load(tiny_model)
    results = captioner.caption([str(path), photo("astronaut")], beam_size=3)
    assert [r.source for r in results] == [str(path), "<image>"]
    for r in results:
        assert r.text == " ".join(r.tokens) and r.tokens
        assert r.alphas.shape == (len(r.tokens), captioner.model.encoder.num_pixels)
        assert torch.allclose(r.alphas.sum(-1), torch.ones(len(r.tokens)), atol=1e-4)
        assert r.score < 0


def test_exported_file_and_checkpoint_give_the_same_captions(tiny_model, tiny_checkpoint):
    from_export = Captioner.load(tiny_model).caption(photo("chelsea"), beam_size=2)[0]
    from_ckpt = Captioner.load(tiny_checkpoint).caption(photo("chelsea"), beam_size=2)[0]
    assert from_export.tokens == from_ckpt.tokens and from_export.score == pytest.approx(from_ckpt.score, abs=1e-4)


def test_export_leaves_out_the_frozen_pretrained_encoder(tiny_model):
    state = torch.load(tiny_model, weights_only=True)
    assert not any(k.startswith("encoder.") for k in state["state_dict"])
    assert any(k.startswith("decoder.") for k in state["state_dict"])


def test_caption_raises_naming_the_bad_file(tiny_model, tmp_path):
    bad = next(iter(write_bad_files(tmp_path)))
    with pytest.raises(ImageError, match=str(bad)):
        Captioner.load(tiny_model).caption([bad])


def test_loading_a_foreign_file_is_a_clear_error(tmp_path):
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(2)}, other)
    with pytest.raises(CaptionerError, match="not a captioner checkpoint"):
        Captioner.load(other)
    with pytest.raises(CaptionerError, match="checkpoint not found"):
        Captioner.load(tmp_path / "nope.ckpt")


def test_an_export_killed_mid_write_leaves_the_previous_file_whole(tiny_checkpoint, tmp_path, monkeypatch):
    from captioner.checkpoints import export

    checkpoint = tiny_checkpoint
    output = export(checkpoint, tmp_path / "model.pt")
    before = output.read_bytes()

    def torn_save(state, file):  # half of a file, then the process dies
        file.write(before[: len(before) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(KeyboardInterrupt):
        export(checkpoint, output)
    assert output.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]
    monkeypatch.undo()
    assert Captioner.load(output).caption(photo("coffee"))[0].tokens
