"""Caption generation from annotations: greedy search, batched over images, in pure torch."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from captioner.models.decoder import AttentionDecoder


@dataclass
class Generation:
    """Generated captions for a batch.

    tokens: (B,T) word ids after <start>, up to and including <end> when it was produced, then <pad> (0).
    lengths: (B,) number of real tokens in each row, <end> included.
    scores: (B,) sum of the log-probabilities of the real tokens.
    alphas: (B,T,P) attention of each generated token, zero after the end.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    scores: torch.Tensor
    alphas: torch.Tensor


def greedy_search(
    decoder: AttentionDecoder,
    annotations: torch.Tensor,
    start_index: int,
    end_index: int,
    max_len: int = 30,
    pad_index: int = 0,
) -> Generation:
    """Pick the most probable word at every step until every caption has produced <end> or max_len words."""
    B = annotations.size(0)
    annotations, keys = decoder.prepare(annotations)  # (B,P,E), (B,P,K)
    state = decoder.init_state(annotations)
    tokens = annotations.new_full((B,), start_index, dtype=torch.long)
    finished = torch.zeros(B, dtype=torch.bool, device=annotations.device)
    scores = annotations.new_zeros(B)
    lengths = torch.zeros(B, dtype=torch.long, device=annotations.device)
    out_tokens, out_alphas = [], []
    for _ in range(max_len):
        logits, state, alpha = decoder.step(tokens, state, annotations, keys)  # (B,V), _, (B,P)
        log_probs = F.log_softmax(logits.float(), dim=-1)
        log_probs[:, [pad_index, start_index]] = float("-inf")  # never generated
        best, tokens = log_probs.max(dim=-1)  # (B,), (B,)
        scores = scores + best.masked_fill(finished, 0.0)
        out_tokens.append(tokens.masked_fill(finished, pad_index))
        out_alphas.append(alpha.masked_fill(finished.unsqueeze(1), 0.0))
        lengths = lengths + (~finished).long()
        finished = finished | (tokens == end_index)
        if bool(finished.all()):
            break
    tokens = torch.stack(out_tokens, dim=1)  # (B,T)
    return Generation(tokens, lengths, scores, torch.stack(out_alphas, dim=1))
