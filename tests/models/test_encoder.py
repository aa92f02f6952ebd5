import copy
import io
import time
import warnings
from unittest import mock

import pytest
import torch
from skimage import data as skdata

from captioner.errors import ConfigError, WeightsUnavailableError
from captioner.models.encoder import BACKBONES, Encoder, batchnorm_folded, load_efficientnet_lite0


@pytest.mark.parametrize(
    ("backbone", "channels"),
    [("efficientnet_lite0", 1280), ("resnet50", 2048), ("resnet101", 2048), ("resnet152", 2048)],
)
def test_annotation_shapes_for_every_backbone(backbone, channels):
    assert backbone in BACKBONES
    encoder = Encoder(backbone, pretrained=False, image_size=64).eval()
    with torch.no_grad():
        a = encoder(torch.randn(2, 3, 64, 64))
    assert a.shape == (2, 4, channels)  # 64 / 32 = 2x2 grid
    assert encoder.num_pixels == 4 and encoder.out_dim == channels
    assert torch.isfinite(a).all()


def test_adaptive_pool_to_a_configured_grid():
    encoder = Encoder("resnet50", pretrained=False, grid_size=3, image_size=128).eval()
    with torch.no_grad():
        a = encoder(torch.randn(1, 3, 128, 128))
    assert a.shape == (1, 9, 2048) and encoder.grid_hw == (3, 3)


def test_lite0_native_grid_at_224(lite0):
    with torch.no_grad():
        a = lite0.eval()(torch.randn(1, 3, 224, 224))
    assert a.shape == (1, 49, 1280) and lite0.grid_hw == (7, 7)


def test_lite0_weights_are_really_loaded():
    """ImageNet class 967 is 'espresso'; it must be in the top-5 for scikit-image's coffee photo."""
    model = load_efficientnet_lite0(pretrained=True).eval()
    transform = Encoder("efficientnet_lite0").preprocessing.transforms()
    from PIL import Image

    x = transform(Image.fromarray(skdata.coffee())).unsqueeze(0)
    with torch.no_grad():
        top5 = model(x).topk(5).indices[0].tolist()
    assert 967 in top5


def test_encoder_features_match_the_classifier_backbone(lite0):
    model = load_efficientnet_lite0(pretrained=True).eval()
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        expected = model.forward_features(x).flatten(2).transpose(1, 2)
        assert torch.allclose(lite0.eval()(x), expected, atol=1e-4)


def test_frozen_by_default_and_fine_tune_unfreezes_last_stages():
    encoder = Encoder("resnet50", pretrained=False)
    assert encoder.frozen
    encoder.fine_tune(1)
    trainable = {n.split(".")[1] for n, p in encoder.named_parameters() if p.requires_grad}
    assert trainable == {"7"}  # features.7 is layer4
    encoder.fine_tune(0)
    assert encoder.frozen


def test_frozen_batchnorm_stays_in_eval_mode():
    encoder = Encoder("resnet50", pretrained=False, image_size=64)
    encoder.fine_tune(1)
    encoder.train()
    bns = [m for m in encoder.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    frozen = [m for m in bns if not m.weight.requires_grad]
    assert frozen and all(not m.training for m in frozen)
    assert any(m.training for m in bns if m.weight.requires_grad)
    before = frozen[0].running_mean.clone()
    encoder(torch.randn(2, 3, 64, 64))
    assert torch.equal(before, frozen[0].running_mean)


def test_unknown_backbone_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown backbone 'vgg99'"):
        Encoder("vgg99")


def test_missing_torchvision_weights_fail_fast_offline(tmp_path, monkeypatch):
    """An empty torch hub cache and no reachable network: a clear error within seconds, not a hang."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    for var in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")  # discard port: connection refused at once
    start = time.monotonic()
    with pytest.raises(WeightsUnavailableError, match="pretrained: false"):
        Encoder("resnet50", pretrained=True)
    assert time.monotonic() - start < 30


def test_training_augmentation_keeps_the_shape_and_varies():
    from tests.images import photo

    preprocessing = Encoder("resnet50", pretrained=False).preprocessing
    image = photo("astronaut")
    plain = preprocessing.transforms()(image)
    augmented = [preprocessing.transforms(augment=True)(image) for _ in range(2)]
    assert plain.shape == augmented[0].shape == (3, 224, 224)
    assert not torch.equal(augmented[0], augmented[1])
    assert torch.equal(plain, preprocessing.transforms()(image))  # evaluation preprocessing is deterministic


def _batchnorms(encoder: Encoder) -> list[torch.nn.BatchNorm2d]:
    return [m for m in encoder.features.modules() if isinstance(m, torch.nn.BatchNorm2d)]


def _randomise_batchnorms(encoder: Encoder) -> None:
    """Statistics and affine parameters far from the identity, so that folding them changes the weights."""
    with torch.no_grad():
        for bn in _batchnorms(encoder):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-1, 1)


def _forward_counting_batchnorms(encoder: Encoder, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The encoder's output and how many BatchNorms ran (not by module hooks: a hook turns the folding off)."""
    with mock.patch.object(torch.nn.functional, "batch_norm", wraps=torch.nn.functional.batch_norm) as batch_norm:
        return encoder(x), batch_norm.call_count


@pytest.mark.parametrize("backbone", ["efficientnet_lite0", "resnet50"])
def test_inference_folds_every_batchnorm_into_its_convolution_with_the_same_features(backbone, monkeypatch):
    encoder = Encoder(backbone, pretrained=False, image_size=64).eval()
    _randomise_batchnorms(encoder)
    keys = set(encoder.state_dict())
    x = torch.randn(2, 3, 64, 64)
    assert batchnorm_folded(encoder.features)[1] == len(_batchnorms(encoder)) > 40  # every one of them
    with torch.no_grad():
        state = torch.get_rng_state()
        encoder(x)  # makes the folded copy, and checks it by running both once
        assert torch.equal(torch.get_rng_state(), state)  # the check's random input leaves training's randomness alone
        folded, calls = _forward_counting_batchnorms(encoder, x)
        assert calls == 0  # the folded copy ran, not the backbone
        monkeypatch.setattr(Encoder, "fold_batchnorm", False)
        expected, calls = _forward_counting_batchnorms(encoder, x)
        assert calls == len(_batchnorms(encoder))
    scale = expected.abs().max()
    assert (folded - expected).abs().max() <= 1e-4 * scale
    assert set(encoder.state_dict()) == keys  # the copy is not part of the model's state
    assert all("_folded" not in name for name, _ in encoder.named_modules())


def test_pickling_or_copying_an_encoder_leaves_the_folded_copy_behind():
    encoder = Encoder("resnet50", pretrained=False, image_size=64).eval()
    _randomise_batchnorms(encoder)
    x = torch.randn(2, 3, 64, 64)

    def saved_bytes(module: torch.nn.Module) -> int:
        buffer = io.BytesIO()
        torch.save(module, buffer)
        return len(buffer.getvalue())

    unused = saved_bytes(encoder)
    with torch.no_grad():
        expected = encoder(x)  # makes the folded copy
    assert saved_bytes(encoder) == unused  # not a second set of weights in the file
    buffer = io.BytesIO()
    torch.save(encoder, buffer)
    buffer.seek(0)
    for clone in (copy.deepcopy(encoder), torch.load(buffer, weights_only=False)):
        assert "_folded" not in clone.__dict__
        with torch.no_grad():
            clone(x)  # the clone folds its own weights on first use, and checks the copy against its backbone
            out, calls = _forward_counting_batchnorms(clone, x)
        assert calls == 0 and torch.equal(out, expected)


def test_a_hook_on_the_backbone_sees_its_own_modules_run():
    encoder = Encoder("resnet50", pretrained=False, image_size=64).eval()
    _randomise_batchnorms(encoder)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        encoder(x)  # folded from now on
        seen = []
        hook = encoder.features[4][0].bn1.register_forward_hook(lambda module, inputs, output: seen.append(output))
        out, calls = _forward_counting_batchnorms(encoder, x)
        assert len(seen) == 1 and calls == len(_batchnorms(encoder))  # the backbone ran, and the hook saw it
        hook.remove()
        hook = torch.nn.modules.module.register_module_forward_hook(lambda module, inputs, output: None)
        try:
            _, calls = _forward_counting_batchnorms(encoder, x)  # a hook on every module
        finally:
            hook.remove()  # global: it must not outlive this test
        assert calls == len(_batchnorms(encoder))
        folded, calls = _forward_counting_batchnorms(encoder, x)
    assert calls == 0 and len(seen) == 1  # folded again once the hooks are gone
    assert (folded - out).abs().max() <= 1e-4 * out.abs().max()


def test_an_encoder_used_for_inference_can_still_be_traced_by_fx():
    encoder = Encoder("resnet50", pretrained=False, image_size=64).eval()
    _randomise_batchnorms(encoder)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = encoder(x)  # folded
        traced = torch.fx.symbolic_trace(encoder)  # records the backbone's own modules
        assert (traced(x) - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_training_a_fine_tuned_encoder_runs_the_backbone_and_evaluation_folds_its_current_weights(monkeypatch):
    encoder = Encoder("resnet50", pretrained=False, image_size=64)
    _randomise_batchnorms(encoder)
    encoder.fine_tune(1)
    x = torch.randn(2, 3, 64, 64)
    encoder.eval()
    with torch.no_grad():
        encoder(x)  # folds the weights as they are now
    encoder.train()
    out, calls = _forward_counting_batchnorms(encoder, x)
    assert calls == len(_batchnorms(encoder)) and out.requires_grad  # autograd through the backbone itself
    with torch.no_grad():  # an optimizer step on the last stage, and its statistics move
        for p in encoder.features[7].parameters():
            p.add_(0.05 * torch.randn_like(p))
    encoder.eval()
    with torch.no_grad():
        encoder(x)  # folds again
        folded, calls = _forward_counting_batchnorms(encoder, x)
        monkeypatch.setattr(Encoder, "fold_batchnorm", False)
        expected = encoder(x)
    assert calls == 0
    assert (folded - expected).abs().max() <= 1e-4 * expected.abs().max()  # from the new weights, not the old


def test_batchnorms_in_training_mode_run_even_without_autograd():
    """A fine-tuned stage's BatchNorms update their statistics in training mode, which a folded copy would skip."""
    encoder = Encoder("resnet50", pretrained=False, image_size=64)
    encoder.fine_tune(1)
    encoder.train()
    with torch.no_grad():
        _, calls = _forward_counting_batchnorms(encoder, torch.randn(2, 3, 64, 64))
    assert calls == len(_batchnorms(encoder))


def test_gradients_through_a_fine_tuned_encoder_in_eval_mode_reach_its_weights():
    """Eval mode fixes the BatchNorm statistics, but the unfrozen weights still get gradients: no folded copy."""
    encoder = Encoder("resnet50", pretrained=False, image_size=64)
    encoder.fine_tune(1)
    encoder.eval()
    encoder(torch.randn(2, 3, 64, 64)).sum().backward()
    assert all(p.grad is not None for p in encoder.parameters() if p.requires_grad)


class _NormalisesBeforeConvolving(torch.nn.Module):
    """A conv registered just before a BatchNorm, but applied after it: folding would be wrong."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 3, 1)
        self.bn = torch.nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.bn(x))


def test_a_fold_that_changes_the_features_is_not_used():
    encoder = Encoder("resnet50", pretrained=False, image_size=64)
    encoder.features = _NormalisesBeforeConvolving()
    encoder.eval()
    _randomise_batchnorms(encoder)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        with pytest.warns(UserWarning, match="folding BatchNorm into the convolutions changed the features"):
            encoder(x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # checked once, not at every call
            out, calls = _forward_counting_batchnorms(encoder, x)
        expected = encoder.features(x.contiguous(memory_format=torch.channels_last))  # the backbone as it is
        assert calls == 1 and torch.equal(out, expected.flatten(2).transpose(1, 2))
