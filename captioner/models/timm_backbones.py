"""Any timm model as a backbone (`timm.list_models()`), through timm's feature API whatever its family: a CNN's
stages, EfficientNet-style blocks, a hierarchical transformer's channels-last maps, a plain transformer's patch
tokens (docs/usage.md's table of the kinds tested). Its weights from the Hugging Face hub, its cache, or a file."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import torch
from torch import nn

from captioner.errors import ConfigError, WeightsUnavailableError
from captioner.models.backbones import Backbone, Preprocessing


def _sized(size: int | None) -> dict:
    """At another input size than the model's own: a model that takes its size at build time (a ViT) resamples its
    position embeddings at each call (timm's dynamic_img_size), so that its weights keep their shapes: a file trained
    at one size starts or loads a model at another."""
    return {"dynamic_img_size": True} if size else {}


def is_timm_model(name: str) -> bool:
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


def timm_backbone(
    name: str, pretrained: bool, stride: int, weights: str | None = None, size: int | None = None
) -> Backbone:
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
