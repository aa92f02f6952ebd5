"""The CNN encoder: an ImageNet backbone whose last feature map becomes the annotation vectors a_i (paper §3.1.1).

Each backbone carries its own preprocessing, so datasets and the caption command resize and normalise images
exactly as the backbone was trained.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from captioner.errors import ConfigError
from captioner.models.backbones import BACKBONES, LITE_SIZES, Preprocessing, load_efficientnet_lite
from captioner.models.compiling import compile_function
from captioner.models.timm_backbones import is_timm_model, timm_backbone

__all__ = ["BACKBONES", "LITE_SIZES", "STRIDES", "Encoder", "Preprocessing", "fold_batchnorm", "load_efficientnet_lite"]

STRIDES = (32, 16)  # a backbone's last feature map, or its last one at 1/16 of the input (the paper's 14x14 at 224)


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
            a CNN's last feature map, or a vision transformer's patch tokens as a grid (`timm_backbone`).
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
        elif is_timm_model(backbone):
            spec = timm_backbone(backbone, pretrained, feature_stride, backbone_weights, image_size)
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
