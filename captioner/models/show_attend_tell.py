"""ShowAttendTell: the encoder and the attention decoder as one plain nn.Module, with the paper's loss."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from captioner.errors import ConfigError
from captioner.models.decoder import AttentionDecoder
from captioner.models.decoding import Generation, beam_search, greedy_search
from captioner.models.encoder import Encoder


class Loss(NamedTuple):
    """The training objective and its parts, each averaged as logged."""

    loss: torch.Tensor  # -log P(y|x) per caption + alpha_c * doubly stochastic term
    nll_per_word: torch.Tensor
    doubly_stochastic: torch.Tensor  # sum_i (1 - sum_t alpha_ti)^2, per caption


def caption_loss(
    logits: torch.Tensor, targets: torch.Tensor, alphas: torch.Tensor, alpha_c: float = 1.0, pad_index: int = 0
) -> Loss:
    """The paper's objective (eq. 14), averaged over the batch:

        L = -log P(y | x) + alpha_c * sum_i (1 - sum_t alpha_ti)^2

    Args:
        logits: (B,T,V) predictions of `targets`.
        targets: (B,T) word ids, `pad_index` after each caption's <end>.
        alphas: (B,T,P) attention weights.
        alpha_c: lambda, the weight of the doubly stochastic term.

    Padded steps count in no part, whatever their logits or alphas hold.
    """
    mask = targets != pad_index  # (B,T)
    B = targets.size(0)
    nll = F.cross_entropy(logits[mask], targets[mask], reduction="sum")  # over real words only
    attention_total = (alphas * mask.unsqueeze(-1)).sum(dim=1)  # (B,P): sum_t alpha_ti over real steps
    doubly_stochastic = ((1.0 - attention_total) ** 2).sum(dim=1).mean()
    return Loss(nll / B + alpha_c * doubly_stochastic, nll / mask.sum(), doubly_stochastic)


class ShowAttendTell(nn.Module):
    """Image -> caption with soft attention (Xu et al. 2015).

    Args:
        vocab_size: V, the special tokens included.
        backbone: the encoder's CNN, a name in `captioner.models.encoder.BACKBONES`.
        pretrained: load the backbone's ImageNet weights.
        grid_size: pool the feature map to grid_size x grid_size annotations (None: the backbone's own grid).
        image_size: input side in pixels (None: the backbone's default).
        alpha_c: lambda, the weight of the doubly stochastic attention term in the loss (the paper uses 1).
        pad_index, start_index, end_index: the special token ids (see `Vocabulary`).
        **decoder_options: the decoder's sizes and choices, see `AttentionDecoder`.
    """

    def __init__(
        self,
        vocab_size: int,
        backbone: str = "efficientnet_lite0",
        pretrained: bool = True,
        grid_size: int | None = None,
        image_size: int | None = None,
        alpha_c: float = 1.0,
        pad_index: int = 0,
        start_index: int = 1,
        end_index: int = 2,
        **decoder_options,
    ):
        super().__init__()
        if alpha_c < 0:
            raise ConfigError(f"alpha_c (lambda) must be >= 0, got {alpha_c}")
        self.encoder = Encoder(backbone, pretrained=pretrained, grid_size=grid_size, image_size=image_size)
        self.decoder = AttentionDecoder(
            vocab_size, self.encoder.out_dim, self.encoder.num_pixels, pad_index=pad_index, **decoder_options
        )
        self.alpha_c = alpha_c
        self.pad_index, self.start_index, self.end_index = pad_index, start_index, end_index

    def annotate(self, images: torch.Tensor | None = None, annotations: torch.Tensor | None = None) -> torch.Tensor:
        """Annotations (B,P,E): given (from the feature cache, say), or encoded from images (B,3,H,W)."""
        if (images is None) == (annotations is None):
            raise ValueError("pass exactly one of images or annotations")
        return self.encoder(images) if annotations is None else annotations.float()

    def forward(
        self,
        captions: torch.Tensor,
        lengths: torch.Tensor,
        images: torch.Tensor | None = None,
        annotations: torch.Tensor | None = None,
    ) -> Loss:
        """Teacher forcing on captions (B,T) of lengths (B,), <start> and <end> included -> the loss."""
        logits, alphas = self.decoder(self.annotate(images, annotations), captions, lengths)  # (B,T-1,V), (B,T-1,P)
        targets = captions[:, 1 : 1 + logits.size(1)]  # (B,T-1)
        return caption_loss(logits, targets, alphas, self.alpha_c, self.pad_index)

    @torch.no_grad()
    def generate(
        self,
        images: torch.Tensor | None = None,
        annotations: torch.Tensor | None = None,
        beam_size: int = 1,
        max_len: int = 30,
        length_penalty: float = 0.0,
    ) -> Generation:
        """Caption a batch: greedy when beam_size is 1, else batched beam search (`captioner.models.decoding`).

        Returns tokens (B,T), lengths (B,), scores (B,) and the per-word alphas (B,T,P).
        """
        annotations = self.annotate(images, annotations)
        special = {"start_index": self.start_index, "end_index": self.end_index, "pad_index": self.pad_index}
        if beam_size == 1:
            return greedy_search(self.decoder, annotations, max_len=max_len, **special)
        return beam_search(
            self.decoder, annotations, beam_size=beam_size, max_len=max_len, length_penalty=length_penalty, **special
        )
