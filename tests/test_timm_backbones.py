"""A timm backbone of each family through everything a user does with a model: `captioner fit` on the shipped debug
config, `captioner export` in both formats, `captioner caption` with each file, `Captioner.load`, and the per-word
overlays on the backbone's own grid. Tiny models, randomly initialised (`--model.pretrained=false`)."""

from __future__ import annotations

import pytest

from captioner.api import Captioner
from captioner.data.shapes import ShapesDataset
from tests.conftest import run_main, tiny_fit_args

IMAGE = "docs/images/shapes_test_0.png"


# One model of each kind of timm feature extractor (tests/models/test_encoder.py's FAMILIES, docs/usage.md's table)
BACKBONES = [("convnext_atto", (7, 7)), ("efficientnet_b0", (7, 7)), ("swin_tiny_patch4_window7_224", (7, 7))]
BACKBONES += [("vit_tiny_patch16_224", (14, 14)), ("deit_tiny_patch16_224", (14, 14))]


@pytest.mark.ci  # 15 s each
@pytest.mark.parametrize(("backbone", "grid"), BACKBONES)
def test_a_timm_backbone_fits_exports_in_both_formats_and_captions(backbone, grid, tmp_path, capfd):
    args = tiny_fit_args(tmp_path, f"--model.backbone={backbone}", "--model.pretrained=false")
    ran = run_main(capfd, "fit", *args)
    assert ran.status == 0, ran.err[-3000:]
    best = tmp_path / "checkpoints" / "best.ckpt"
    model, graphs = tmp_path / "model.pt", tmp_path / "onnx"
    for command in (["--output", str(model)], ["--format", "onnx", "--output", str(graphs)]):
        ran = run_main(capfd, "export", "--ckpt_path", str(best), *command)
        assert ran.status == 0 and ran.out.startswith("wrote"), ran.err[-3000:]
    images = [ShapesDataset("test", 2, seed=9).load_image(i) for i in range(2)]
    results = {
        name: Captioner.load(path).caption(images, beam_size=1)
        for name, path in (("checkpoint", best), ("export", model), ("onnx", graphs))
    }
    assert results["export"][0].grid_hw == results["onnx"][0].grid_hw == grid
    assert results["export"][0].alphas.shape == (len(results["export"][0].tokens), grid[0] * grid[1])
    for name in ("export", "onnx"):  # greedy: the same words from each form of the model
        assert [r.tokens for r in results[name]] == [r.tokens for r in results["checkpoint"]], name
    overlays = tmp_path / "overlays"
    for path in (model, graphs):
        ran = run_main(capfd, "caption", IMAGE, "--ckpt_path", str(path), "--overlays", str(overlays))
        assert ran.status == 0 and ran.out.count("\t") == 1, ran.err[-3000:]
    assert len(list(overlays.glob("*.png"))) == 1  # the second wrote over the first: the same name


@pytest.mark.ci  # two fits and every kind of load: about a minute
def test_a_model_trained_on_a_weights_file_loads_where_that_file_is_not(tmp_path, capfd):
    """`--model.backbone_weights FILE`: a path means nothing on another machine, so every file written keeps the
    encoder (it cannot be rebuilt elsewhere), and loading asks for no pretrained weights: with the weights file gone,
    the checkpoint and its export load, caption, export with --include-encoder, and evaluate; fine-tuned too."""
    import timm
    from safetensors.torch import save_file

    weights = tmp_path / "machine" / "atto.safetensors"
    weights.parent.mkdir()
    save_file(timm.create_model("convnext_atto", pretrained=False).state_dict(), weights)
    options = ["--model.backbone=convnext_atto", f"--model.backbone_weights={weights}"]
    for tuned in (0, 1):
        root = tmp_path / f"tuned{tuned}"
        ran = run_main(capfd, "fit", *tiny_fit_args(root, *options, f"--model.fine_tune_blocks={tuned}"))
        assert ran.status == 0, ran.err[-3000:]
        best = root / "checkpoints" / "best.ckpt"
        ran = run_main(capfd, "export", "--ckpt_path", str(best), "--output", str(root / "model.pt"))
        assert ran.status == 0, ran.err[-3000:]
    weights.unlink()  # another machine
    images = [ShapesDataset("test", 2, seed=9).load_image(i) for i in range(2)]
    for tuned in (0, 1):
        root = tmp_path / f"tuned{tuned}"
        best, model = root / "checkpoints" / "best.ckpt", root / "model.pt"
        assert Captioner.load(best).caption(images)[0].tokens == Captioner.load(model).caption(images)[0].tokens
        ran = run_main(
            capfd, "export", "--ckpt_path", str(best), "--output", str(root / "full.pt"), "--include-encoder"
        )
        assert ran.status == 0, ran.err[-3000:]
        ran = run_main(capfd, "caption", IMAGE, "--ckpt_path", str(root / "full.pt"))
        assert ran.status == 0 and ran.out.count("\t") == 1, ran.err[-3000:]
        ran = run_main(
            capfd, "evaluate", "--ckpt_path", str(best), "--output", str(root / "evaluation"), "--split", "val"
        )
        assert ran.status == 0, ran.err[-3000:]
