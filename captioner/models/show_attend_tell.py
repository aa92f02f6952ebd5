"""ShowAttendTell: the encoder and the attention decoder assembled into one plain nn.Module."""

from __future__ import annotations

import torch
from torch import nn

from captioner.decoding import Generation, beam_search, greedy_search
from captioner.models.decoder import AttentionDecoder
from captioner.models.encoder import Encoder


class ShowAttendTell(nn.Module):
    """Image -> caption with soft attention (Xu et al. 2015).

    Args:
        vocab_size: V, including the special tokens.
        backbone, pretrained, grid_size, image_size: see `Encoder`.
        embed_dim, decoder_dim, attention_dim, attention, dropout, gate, position_embedding: see `AttentionDecoder`.
        pad_index, start_index, end_index: special token ids (see `Vocabulary`).
    """

    def __init__(
        self,
        vocab_size: int,
        backbone: str = "efficientnet_lite0",
        pretrained: bool = True,
        grid_size: int | None = None,
        image_size: int | None = None,
        embed_dim: int = 512,
        decoder_dim: int = 512,
        attention_dim: int = 512,
        attention: str = "additive",
        dropout: float = 0.5,
        gate: str = "scalar",
        position_embedding: bool = False,
        pad_index: int = 0,
        start_index: int = 1,
        end_index: int = 2,
    ):
        super().__init__()
        self.encoder = Encoder(backbone, pretrained=pretrained, grid_size=grid_size, image_size=image_size)
        self.decoder = AttentionDecoder(
            vocab_size,
            self.encoder.out_dim,
            embed_dim=embed_dim,
            decoder_dim=decoder_dim,
            attention_dim=attention_dim,
            attention=attention,
            dropout=dropout,
            gate=gate,
            num_pixels=self.encoder.num_pixels,
            position_embedding=position_embedding,
            pad_index=pad_index,
        )
        self.pad_index, self.start_index, self.end_index = pad_index, start_index, end_index

    def annotate(self, images: torch.Tensor | None = None, annotations: torch.Tensor | None = None) -> torch.Tensor:
        """Annotations (B,P,E): given directly (e.g. from the feature cache), or encoded from images (B,3,H,W)."""
        if (images is None) == (annotations is None):
            raise ValueError("pass exactly one of images or annotations")
        return self.encoder(images) if annotations is None else annotations.float()

    def forward(
        self,
        captions: torch.Tensor,
        lengths: torch.Tensor,
        images: torch.Tensor | None = None,
        annotations: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher forcing: captions (B,T), lengths (B,) -> logits (B,T-1,V), alphas (B,T-1,P)."""
        return self.decoder(self.annotate(images, annotations), captions, lengths)

    @torch.no_grad()
    def generate(
        self,
        images: torch.Tensor | None = None,
        annotations: torch.Tensor | None = None,
        beam_size: int = 1,
        max_len: int = 30,
        length_penalty: float = 0.0,
    ) -> Generation:
        """Caption a batch: greedy when beam_size is 1, else batched beam search (see `captioner.decoding`).

        Returns tokens (B,T), lengths (B,), scores (B,) and the per-word alphas (B,T,P).
        """
        annotations = self.annotate(images, annotations)
        special = {"start_index": self.start_index, "end_index": self.end_index, "pad_index": self.pad_index}
        if beam_size == 1:
            return greedy_search(self.decoder, annotations, max_len=max_len, **special)
        return beam_search(
            self.decoder, annotations, beam_size=beam_size, max_len=max_len, length_penalty=length_penalty, **special
        )
