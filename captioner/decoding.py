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


def beam_search(
    decoder: AttentionDecoder,
    annotations: torch.Tensor,
    start_index: int,
    end_index: int,
    beam_size: int = 3,
    max_len: int = 30,
    length_penalty: float = 0.0,
    pad_index: int = 0,
) -> Generation:
    """Beam search over all images and beams at once: each step is one decoder call on (B*K) rows.

    A finished beam stays in the beam with its final score (it can only be extended by <pad> at no cost), so the
    whole search is a fixed-shape tensor program. At the end, each image gets its best finished hypothesis by
    score / length**length_penalty (0 = raw log-probability); if none finished within max_len, the best unfinished
    one. It never returns an empty caption.
    """
    B, P, _ = annotations.shape
    K = beam_size
    if K < 1:
        raise ValueError(f"beam_size must be >= 1, got {K}")
    device = annotations.device
    annotations, keys = decoder.prepare(annotations)  # (B,P,E), (B,P,K')
    h, c = decoder.init_state(annotations)  # (B,D)
    h, c = h.repeat_interleave(K, 0), c.repeat_interleave(K, 0)  # (B*K,D): the K beams of an image are adjacent
    # The annotations and keys stay (B,P,.): beams only ever move within their own image, and attention broadcasts
    # one image's memory over its K hypotheses (see captioner.models.attention).
    scores = torch.full((B, K), float("-inf"), device=device)
    scores[:, 0] = 0.0  # all beams start identical: expand only the first
    tokens = torch.full((B * K,), start_index, dtype=torch.long, device=device)
    finished = torch.zeros(B * K, dtype=torch.bool, device=device)
    lengths = torch.zeros(B * K, dtype=torch.long, device=device)
    history = torch.empty(B * K, 0, dtype=torch.long, device=device)  # (B*K,t)
    alpha_history = annotations.new_empty(B * K, 0, P)  # (B*K,t,P)
    offsets = torch.arange(B, device=device).unsqueeze(1) * K  # (B,1): first row of each image
    for _ in range(max_len):
        logits, (h, c), alpha = decoder.step(tokens, (h, c), annotations, keys)  # (B*K,V), _, (B*K,P)
        log_probs = F.log_softmax(logits.float(), dim=-1)
        V = log_probs.size(1)
        log_probs[:, [pad_index, start_index]] = float("-inf")
        log_probs[finished] = float("-inf")
        log_probs[finished, pad_index] = 0.0  # a finished beam carries on unchanged
        candidates = (scores.view(B * K, 1) + log_probs).view(B, K * V)
        scores, best = candidates.topk(K, dim=1)  # (B,K)
        rows = (best // V + offsets).view(-1)  # (B*K,) the beam each new hypothesis extends
        tokens = (best % V).view(-1)  # (B*K,)
        was_finished = finished[rows]
        h, c = h[rows], c[rows]
        history = torch.cat([history[rows], tokens.unsqueeze(1)], dim=1)
        step_alpha = alpha[rows].masked_fill(was_finished.unsqueeze(1), 0.0)
        alpha_history = torch.cat([alpha_history[rows], step_alpha.unsqueeze(1)], dim=1)
        lengths = lengths[rows] + (~was_finished).long()
        finished = was_finished | (tokens == end_index)
        if bool(finished.all()):
            break
    ranking = scores / lengths.view(B, K).clamp(min=1).float() ** length_penalty  # (B,K)
    any_finished = finished.view(B, K).any(dim=1, keepdim=True)  # (B,1)
    ranking = ranking.masked_fill(any_finished & ~finished.view(B, K), float("-inf"))
    choice = (ranking.argmax(dim=1) + offsets.squeeze(1)).view(-1)  # (B,)
    return Generation(history[choice], lengths[choice], scores.view(-1)[choice], alpha_history[choice])
