"""Attention over the annotation vectors a_i (paper §3.1.2, eq. 4-6).

A scorer rates every annotation against the decoder's state h_{t-1}; the weights alpha are their softmax, and the
context is the alpha-weighted sum of the annotations. The scorer's projection of the annotations does not depend on
the step, so it is computed once per batch:
    keys = scorer.project(annotations)          # (B,P,E) -> (B,P,K), once per batch
    e = scorer(keys, h)                         # (B,P,K), (B,G,D) -> (B,G,P), at every step
    context, alpha = attend(e, annotations)     # -> (B,G,E), (B,G,P)
In beam search h has G hypotheses per image (G = 1 otherwise): the G hypotheses of an image attend over the same
(P,E) annotations, which are not copied G times.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

from captioner.errors import check_choice

CHUNK = 2**20  # elements of W a + U h built at a time when decoding: 4 MiB of float32, which stays in cache


class AdditiveAttention(nn.Module):
    """Bahdanau scoring, the paper's: e_ti = v . tanh(W a_i + U h_{t-1}) + b.

    It is computed through the identity tanh(x) = 2 sigmoid(2x) - 1, as e_ti = 2v . sigmoid(2 W a_i + 2 U h_{t-1}) +
    b - sum(v): the same function, with one pass of sigmoid over the largest tensor of a step, (B,G,P,A), instead of
    one of tanh, whose CPU kernel in torch can be several times slower (docs/benchmarks.md). So the keys are 2 W a_i.
    """

    def __init__(self, encoder_dim: int, decoder_dim: int, attention_dim: int):
        super().__init__()
        self.W = nn.Linear(encoder_dim, attention_dim)
        self.U = nn.Linear(decoder_dim, attention_dim, bias=False)  # W carries the bias
        self.v = nn.Linear(attention_dim, 1)
        self.chunked = True  # decoding builds W a + U h a few images at a time (`forward`); an export sets False

    def project(self, annotations: torch.Tensor) -> torch.Tensor:
        return 2 * self.W(annotations)  # 2 W a_i: (B,P,A)

    def forward(self, keys: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        _, P, A = keys.shape
        uh = 2 * self.U(h)  # 2 U h: (B,G,A)
        w, b = 2 * self.v.weight.squeeze(0), self.v.bias - self.v.weight.sum()  # (A,), (1,)
        # 2 W a + 2 U h is (B,G,P,A), the largest tensor of a step. Decoding builds it a few images at a time, so
        # that each piece is used while it is in cache; training builds it whole, as autograd keeps it anyway, and so
        # does an exported graph (captioner.onnx_export sets `chunked` False), whose batch is a dynamic axis rather
        # than the example's.
        if torch.is_grad_enabled() or not self.chunked:
            return (keys.unsqueeze(1) + uh.unsqueeze(2)).sigmoid_() @ w + b  # (B,G,P,A) -> (B,G,P)
        n = max(1, CHUNK // (uh.size(1) * P * A))
        pieces = [
            (k.unsqueeze(1) + u.unsqueeze(2)).sigmoid_() @ w  # (n,G,P,A) -> (n,G,P)
            for k, u in zip(keys.split(n), uh.split(n), strict=True)
        ]
        return torch.cat(pieces) + b  # (B,G,P)


class GeneralAttention(nn.Module):
    """Luong's general scoring: e_ti = h . (W a_i)."""

    def __init__(self, encoder_dim: int, decoder_dim: int, attention_dim: int = 0):
        super().__init__()
        self.W = nn.Linear(encoder_dim, decoder_dim, bias=False)

    def project(self, annotations: torch.Tensor) -> torch.Tensor:
        return self.W(annotations)  # (B,P,D)

    def forward(self, keys: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.bmm(h, keys.transpose(1, 2))  # (B,G,D) @ (B,D,P) -> (B,G,P)


class DotAttention(GeneralAttention):
    """Luong's dot scoring: e_ti = h . a_i. When E != D the annotations are first projected to D by a learned map,
    which makes it general scoring."""

    def __init__(self, encoder_dim: int, decoder_dim: int, attention_dim: int = 0):
        super().__init__(encoder_dim, decoder_dim)
        if encoder_dim == decoder_dim:
            self.W = nn.Identity()


Scorer = Literal["additive", "dot", "general"]  # a type: LightningCLI refuses other values and lists these in --help
SCORERS = dict(zip(get_args(Scorer), (AdditiveAttention, DotAttention, GeneralAttention), strict=True))


def build_scorer(kind: str, encoder_dim: int, decoder_dim: int, attention_dim: int) -> nn.Module:
    check_choice("attention", kind, SCORERS)
    return SCORERS[kind](encoder_dim, decoder_dim, attention_dim)


def attend(e: torch.Tensor, annotations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft attention (eq. 5-6): scores e (B,G,P) -> context sum_i alpha_i a_i (B,G,E) and alpha (B,G,P)."""
    alpha = F.softmax(e, dim=-1)  # (B,G,P)
    return torch.bmm(alpha, annotations), alpha  # (B,G,P) @ (B,P,E)
