"""Self-critical sequence training (Rennie et al. 2017; Luo 2020): what the objective needs beside the model.

For each image the model draws K captions (`ShowAttendTell.sample`); each one's reward is its CIDEr-D against the
image's references, with document frequencies from the whole training split (`captioner.cider.CiderD`); its baseline
is the mean reward of the image's other K-1 captions (Luo 2020), or the reward of the image's greedy caption (Rennie
2017); the loss is `self_critical_loss`. A run starts from a cross-entropy checkpoint's weights (`init_from`), with a
fresh optimizer and schedule: not a resume.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from captioner.cider import CiderD
from captioner.errors import ConfigError

OBJECTIVES = ("xe", "scst")
BASELINES = ("others", "greedy")


class SelfCritical:
    """The rewards and baselines of one training split.

    Args:
        references: each training image's references, tokenized (the split's `CaptionDataset.references`).
        baseline: "others" (the mean reward of the image's other samples) or "greedy" (its greedy caption's reward).
    """

    def __init__(self, references: Sequence[Sequence[Sequence[str]]], baseline: str = "others"):
        self.cider, self.baseline = CiderD(references), baseline

    def rewards(self, captions: Sequence[Sequence[Sequence[str]]], images: Sequence[int]) -> torch.Tensor:
        """(B,K) CIDEr-D of each image's K captions (lists of words) against that image's references."""
        pairs = zip(captions, images, strict=True)
        return torch.tensor([[self.cider(words, image) for words in drawn] for drawn, image in pairs])

    def baselines(self, rewards: torch.Tensor, greedy: torch.Tensor | None = None) -> torch.Tensor:
        """(B,K) b_k: with "others", (sum_j r_j - r_k) / (K - 1); with "greedy", each image's greedy reward (B,)."""
        if self.baseline == "greedy":
            return greedy.unsqueeze(1).expand_as(rewards)
        K = rewards.size(1)
        return (rewards.sum(dim=1, keepdim=True) - rewards) / (K - 1)


def check_options(objective: str, samples: int, baseline: str, attention_mode: str) -> None:
    if objective not in OBJECTIVES:
        raise ConfigError(f"unknown objective {objective!r}; choose one of {', '.join(OBJECTIVES)}")
    if baseline not in BASELINES:
        raise ConfigError(f"unknown scst_baseline {baseline!r}; choose one of {', '.join(BASELINES)}")
    if objective == "scst" and samples < (2 if baseline == "others" else 1):
        raise ConfigError(f"scst_samples must be at least 2 for the {baseline!r} baseline, got {samples}")
    if objective == "scst" and attention_mode != "soft":
        raise ConfigError("objective scst needs soft attention: hard attention's own REINFORCE is not combined with it")
