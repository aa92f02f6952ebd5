"""The training objectives, one concept: each takes the model and a batch and returns the loss and what to log.

- `TeacherForcing`: the paper's objective (eq. 14), -log p(y|x) + lambda * sum_i (1 - sum_t alpha_ti)^2, on the
  reference captions; with hard attention (§4.1) its REINFORCE terms and moving-average baseline too. The arithmetic
  is the model's own (`ShowAttendTell.forward`, `caption_loss`, `hard_attention_terms`), so that a model computes its
  loss in a notebook with no Trainer, and the compiled step compiles it whole.
- `SelfCritical`: self-critical sequence training (Rennie et al. 2017; Luo 2020). For each image the model draws K
  captions; each one's reward is its CIDEr-D against the image's references, with document frequencies from the whole
  training split (`captioner.cider.CiderD`); its baseline is the mean reward of the image's other K-1 captions (Luo),
  or the reward of the image's greedy caption (Rennie); the loss is `self_critical_loss`. A run starts from a
  cross-entropy checkpoint's weights (`init_from`), with a fresh optimizer and schedule: not a resume.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal, get_args

import torch

from captioner.cider import CiderD
from captioner.data.vocab import Vocabulary
from captioner.errors import ConfigError, check_choice
from captioner.models.show_attend_tell import ShowAttendTell

Objective = Literal["xe", "scst"]  # a type: LightningCLI refuses other values and lists these in --help
Baseline = Literal["others", "greedy"]
OBJECTIVES, BASELINES = get_args(Objective), get_args(Baseline)
Logged = dict[str, torch.Tensor]  # name (logged under train/) -> value


def check_options(objective: str, samples: int, baseline: str, attention_mode: str) -> None:
    check_choice("objective", objective, OBJECTIVES)
    check_choice("scst_baseline", baseline, BASELINES)
    if objective == "scst" and samples < (2 if baseline == "others" else 1):
        raise ConfigError(f"scst_samples must be at least 2 for the {baseline!r} baseline, got {samples}")
    if objective == "scst" and attention_mode != "soft":
        raise ConfigError("objective scst needs soft attention: hard attention's own REINFORCE is not combined with it")


class TeacherForcing:
    """The paper's loss on a batch's reference captions (soft or hard attention, as the model attends)."""

    def __call__(self, model: ShowAttendTell, batch: dict) -> tuple[torch.Tensor, Logged]:
        images, annotations = batch.get("images"), batch.get("annotations")
        k = batch.get("captions_per_image", 1)  # a "grouped" batch's images have k captions each
        loss = model(batch["captions"], batch["lengths"], images=images, annotations=annotations, captions_per_image=k)
        parts = {"nll_per_word": loss.nll_per_word, "doubly_stochastic": loss.doubly_stochastic}
        return loss.loss, parts | {"attention_entropy": loss.attention_entropy}


def self_critical_loss(
    log_probs: torch.Tensor, mask: torch.Tensor, rewards: torch.Tensor, baselines: torch.Tensor
) -> torch.Tensor:
    """Self-critical sequence training's objective (Rennie et al. 2017), averaged over the images:

        - 1/K sum_k (r_k - b_k) sum_t log p(w^k_t | w^k_<t, I)

    Its gradient is REINFORCE's with the baseline b: (r - b) is held constant.

    Args:
        log_probs: (B,K,T) log-probability of each drawn word (`Samples.log_probs`).
        mask: (B,K,T) the real words, <end> included.
        rewards: (B,K) r_k, the CIDEr-D of each sampled caption.
        baselines: (B,K) b_k: the mean reward of the image's other samples (Luo 2020), or its greedy caption's.
    """
    advantage = (rewards - baselines).detach()  # (B,K)
    return -(advantage * (log_probs * mask).sum(-1)).mean()


class SelfCritical:
    """SCST on one training split.

    Args:
        references: each training image's references, tokenized (the split's `CaptionDataset.references`).
        vocab: the model's vocabulary, to read its samples.
        samples: K, the captions drawn per image.
        baseline: "others" (the mean reward of the image's other samples) or "greedy" (its greedy caption's reward).
        max_len: the longest caption drawn, in words.
        cache_dir: where CIDEr-D's document frequencies of the split are kept for later runs (`CiderD`).
    """

    def __init__(
        self,
        references: Sequence[Sequence[Sequence[str]]],
        vocab: Vocabulary | None = None,
        samples: int = 5,
        baseline: str = "others",
        max_len: int = 30,
        cache_dir: str | Path | None = None,
    ):
        self.cider, self.vocab, self.baseline = CiderD(references, cache_dir), vocab, baseline
        self.samples, self.max_len = samples, max_len

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

    def __call__(self, model: ShowAttendTell, batch: dict) -> tuple[torch.Tensor, Logged]:
        annotations = model.annotate(batch.get("images"), batch.get("annotations"))  # (B,P,E)
        samples = model.sample(annotations, self.samples, self.max_len)  # (B,K,T) each
        images = batch["index"].tolist()
        drawn = [[self.vocab.decode_tokens(tokens) for tokens in image] for image in samples.tokens.tolist()]
        rewards = self.rewards(drawn, images).to(annotations.device)  # (B,K)
        greedy = None
        if self.baseline == "greedy":  # the image's caption at test time: greedy, without dropout
            model.eval()
            try:
                generation = model.generate(annotations=annotations.detach(), max_len=self.max_len)
            finally:
                model.train()
            words = [[self.vocab.decode_tokens(tokens)] for tokens in generation.tokens.tolist()]
            greedy = self.rewards(words, images)[:, 0].to(annotations.device)  # (B,)
        baselines = self.baselines(rewards, greedy)  # (B,K)
        loss = self_critical_loss(samples.log_probs, samples.mask, rewards, baselines)
        beat = (rewards > baselines).float().mean()
        return loss, {"reward": rewards.mean(), "baseline": baselines.mean(), "beat_baseline": beat}
