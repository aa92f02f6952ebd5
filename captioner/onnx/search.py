"""Greedy and beam search in numpy over a decoder step that ONNX Runtime runs: the torch searches'
(`captioner.models.decoding`) rules, batched the same way, in the same float32 arithmetic.

- A word is never <pad> or <start>. Greedy search takes the most probable word until <end> or `max_len` words; a
  caption that has ended leaves the batch.
- Beam search keeps each image's K best hypotheses, ranked by score / length**length_penalty; a finished hypothesis
  stays in its beam with its final score, extended by <pad> at no cost, and an image whose K hypotheses have all
  finished leaves the batch. Each image gets its best finished hypothesis, or, if none finished within `max_len`
  words, its best unfinished one.

`step(tokens (A,G), h, c (A,G,D), annotations (A,P,E), keys (A,P,K')) -> log_probs (A,G,V), h, c, alpha (A,G,P)` is
the exported `step.onnx` (`captioner.onnx_export.StepGraph`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

Step = Callable[..., tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]


class SearchError(ValueError):
    """A search option out of range (a beam wider than the vocabulary, no words at all)."""


@dataclass
class Generation:
    """Each image's caption: its word ids (<end> included when it ended), its score (the sum of its words'
    log-probabilities) and each word's attention (len(ids), P), float32."""

    ids: list[list[int]]
    scores: list[float]
    alphas: list[np.ndarray]


def greedy_search(
    step: Step,
    annotations: np.ndarray,
    keys: np.ndarray,
    h: np.ndarray,
    c: np.ndarray,
    start: int,
    end: int,
    pad: int = 0,
    max_len: int = 30,
) -> Generation:
    """The most probable word at each step; the batch shrinks as captions end (`captioner.models.decoding.
    greedy_search`'s CPU form)."""
    if max_len < 1:
        raise SearchError(f"max_len must be >= 1, got {max_len}")
    B = annotations.shape[0]
    rows = np.arange(B)  # the images still being captioned
    tokens = np.full((B, 1), start, dtype=np.int64)
    h, c = h[:, None], c[:, None]  # one hypothesis per image
    ids: list[list[int]] = [[] for _ in range(B)]
    alphas: list[list[np.ndarray]] = [[] for _ in range(B)]
    scores = np.zeros(B, dtype=np.float32)
    for _ in range(max_len):
        log_probs, h, c, alpha = step(tokens, h, c, annotations, keys)
        log_probs = log_probs[:, 0]  # (A,V)
        log_probs[:, [pad, start]] = -np.inf  # never generated
        words = log_probs.argmax(axis=1)
        scores[rows] += log_probs[np.arange(len(rows)), words]
        for i, row in enumerate(rows):
            ids[row].append(int(words[i]))
            alphas[row].append(alpha[i, 0])
        going = words != end
        if not going.all():  # the ended captions leave the batch
            if not going.any():
                break
            rows, words, h, c, annotations, keys = (x[going] for x in (rows, words, h, c, annotations, keys))
        tokens = words[:, None]
    return Generation(ids, [float(s) for s in scores], [np.stack(a) for a in alphas])


def beam_search(
    step: Step,
    annotations: np.ndarray,
    keys: np.ndarray,
    h: np.ndarray,
    c: np.ndarray,
    start: int,
    end: int,
    pad: int = 0,
    beam_size: int = 3,
    max_len: int = 30,
    length_penalty: float = 1.0,
) -> Generation:
    """Beam search over all images and beams at once: each word is one step call on the K hypotheses of every image
    still searching (`captioner.models.decoding.beam_search`). The first word extends each image's one <start>
    hypothesis. Hypotheses are recorded by back-pointers, one (B,K) row of parents per word, read back at the end."""
    B, P = annotations.shape[0], annotations.shape[1]
    K = beam_size
    if K < 1 or max_len < 1:
        raise SearchError(f"beam_size and max_len must be >= 1, got {K} and {max_len}")
    alive = np.arange(B)  # the images still searching (A of them), G hypotheses each
    tokens = np.full((B, 1), start, dtype=np.int64)  # (A,G)
    h, c = h[:, None], c[:, None]  # (A,G,D)
    scores = np.zeros((B, 1), dtype=np.float32)
    lengths = np.zeros((B, 1), dtype=np.int64)
    finished = np.zeros((B, 1), dtype=bool)
    # each image's K final hypotheses, and per word the record of all B*K: its word, the hypothesis it extends and the
    # attention that chose it (an image that has left the batch goes on as <pad> rows pointing to themselves)
    final_scores = np.zeros((B, K), dtype=np.float32)
    final_lengths = np.zeros((B, K), dtype=np.int64)
    final_finished = np.zeros((B, K), dtype=bool)
    record_tokens, record_parents, record_alphas = [], [], []
    for t in range(max_len):
        A, G = tokens.shape
        log_probs, h, c, alpha = step(tokens, h, c, annotations, keys)  # (A,G,V), (A,G,D) x2, (A,G,P)
        V = log_probs.shape[2]
        if t == 0 and K > V - 2:  # never <pad> or <start> (`captioner.models.decoding.check_beam_size`)
            raise SearchError(f"beam size {K} is larger than the {V - 2} words this vocabulary can generate (of {V})")
        log_probs[:, :, [pad, start]] = -np.inf  # never generated
        log_probs[finished] = -np.inf  # a finished hypothesis's next word is <pad>, at no cost
        log_probs[finished, pad] = 0.0
        candidates = (scores[:, :, None] + log_probs).reshape(A, G * V)
        ranking = candidates
        if length_penalty:
            extended = np.maximum(lengths + ~finished, 1).astype(np.float32) ** np.float32(length_penalty)  # (A,G)
            ranking = (candidates.reshape(A, G, V) / extended[:, :, None]).reshape(A, G * V)
        best = top_k(ranking, K)  # (A,K) indices into G*V
        scores = np.take_along_axis(candidates, best, axis=1)
        parents, tokens = best // V, best % V  # (A,K) each
        was_finished = np.take_along_axis(finished, parents, axis=1)
        lengths = np.take_along_axis(lengths, parents, axis=1) + ~was_finished
        finished = was_finished | (tokens == end)
        h, c = (np.take_along_axis(x, parents[:, :, None], axis=1) for x in (h, c))
        chosen = np.take_along_axis(alpha, parents[:, :, None], axis=1)  # (A,K,P); read back up to each end only

        step_tokens = np.full((B, K), pad, dtype=np.int64)
        step_parents = np.broadcast_to(np.arange(K), (B, K)).copy()
        step_alphas = np.zeros((B, K, P), dtype=np.float32)
        step_tokens[alive], step_parents[alive], step_alphas[alive] = tokens, parents, chosen
        record_tokens.append(step_tokens)
        record_parents.append(step_parents)
        record_alphas.append(step_alphas)

        done = finished.all(axis=1)  # (A,)
        if t == max_len - 1 or done.all():
            break
        if done.any():  # these images can no longer change: record their result and leave the batch
            gone = alive[done]
            final_scores[gone], final_lengths[gone], final_finished[gone] = scores[done], lengths[done], True
            keep = ~done
            alive, annotations, keys = alive[keep], annotations[keep], keys[keep]
            tokens, h, c, scores, lengths, finished = (x[keep] for x in (tokens, h, c, scores, lengths, finished))
    final_scores[alive], final_lengths[alive], final_finished[alive] = scores, lengths, finished
    return _read_back(
        final_scores, final_lengths, final_finished, record_tokens, record_parents, record_alphas, length_penalty
    )


def top_k(ranking: np.ndarray, k: int) -> np.ndarray:
    """Each row's k largest entries' indices, largest first, equal values among them in index order. Which of several
    entries equal to the k-th largest are chosen is argpartition's choice, as it is torch.topk's kernel's in the
    torch search, which orders ties as it happens to: only exact ties, which a trained model's floats do not make,
    may go another way there."""
    if k < ranking.shape[1]:
        part = np.argpartition(-ranking, k - 1, axis=1)[:, :k]
    else:
        part = np.broadcast_to(np.arange(ranking.shape[1]), ranking.shape)
    values = np.take_along_axis(ranking, part, axis=1)
    order = np.lexsort((part, -values), axis=1)
    return np.take_along_axis(part, order, axis=1)


def _read_back(
    final_scores, final_lengths, final_finished, record_tokens, record_parents, record_alphas, length_penalty
) -> Generation:
    """Each image's best hypothesis (a finished one if any), read back along the back-pointers from its last word."""
    B = final_scores.shape[0]
    ranking = final_scores / np.maximum(final_lengths, 1).astype(np.float32) ** np.float32(length_penalty)
    ranking = np.where(final_finished.any(axis=1, keepdims=True) & ~final_finished, -np.inf, ranking)
    choice = ranking.argmax(axis=1)  # (B,)
    images = np.arange(B)
    steps = len(record_tokens)
    tokens = np.empty((B, steps), dtype=np.int64)
    alphas = np.empty((B, steps, record_alphas[0].shape[2]), dtype=np.float32)
    k = choice
    for t in reversed(range(steps)):  # follow the back-pointers from the last word to the first
        tokens[:, t] = record_tokens[t][images, k]
        alphas[:, t] = record_alphas[t][images, k]
        k = record_parents[t][images, k]
    lengths = final_lengths[images, choice]
    return Generation(
        [tokens[b, : lengths[b]].tolist() for b in range(B)],
        [float(s) for s in final_scores[images, choice]],
        [alphas[b, : lengths[b]] for b in range(B)],
    )
