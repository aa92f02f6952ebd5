"""Beam search over all images and beams at once (`beam_search`), and its parts: the words a sync-free search runs
between two reads (`_beam_words`, which a compiled decoder compiles and the ONNX export writes as a graph), each
word's choice of extensions (`_best_extensions`), each image's winner (`_winners`) and the read-back along the
back-pointers (`_read_back`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from captioner.errors import ConfigError
from captioner.models.decoder import AttentionDecoder
from captioner.models.decoding import (
    LENGTH_PENALTY,
    Generation,
    _generation,
    _host,
    _words,
    check_interval,
    sync_free_default,
)
from captioner.models.search_host import BeamRecord


def beam_search(
    decoder: AttentionDecoder,
    annotations: torch.Tensor,
    start_index: int,
    end_index: int,
    beam_size: int = 3,
    max_len: int = 30,
    length_penalty: float = LENGTH_PENALTY,
    pad_index: int = 0,
    sync_free: bool | None = None,
    check_every: int | None = None,
) -> Generation:
    """Beam search over all images and beams at once: each step is one decoder call on the hypotheses of all the
    images still searching.

    - The first step runs once per image: its K beams are all the same <start> hypothesis until the first word.
    - A finished hypothesis stays in its beam with its final score (it can only be extended by <pad> at no cost).
    - Hypotheses are recorded by back-pointers and read back once at the end.

    Hypotheses are ranked by score / length**length_penalty (0: the raw log-probability), in the search as at its end:
    a finished hypothesis keeps its length, and a live one that reaches a better score per word can take its place.
    Each image gets its best finished hypothesis; if none finished within max_len, the best unfinished one. Its
    caption is empty when that hypothesis is <end> alone (tests/test_degenerate_captions.py).

    Two ways to the same captions (`sync_free`: by default on CUDA and compiled, see `sync_free_default`):
    - the batch shrinks (`_shrinking`): a finished hypothesis skips the LSTM and the output layer (only the
      attention, which works image by image, still includes it), and an image whose K hypotheses have all finished
      leaves the batch, its decoder state, annotations and keys with it. The host reads at every word what has
      finished, and keeps the record (`captioner.models.search_host.BeamRecord`, as the ONNX loop does): the CPU's
      way, 1.54x faster there at batch 64 (docs/benchmarks.md);
    - sync-free (`_sync_free`): every image and hypothesis runs every step, and what has finished is read once every
      `check_every` words (`check_interval`: 8 on a GPU and with a compiled decoder): the device never waits for the
      host in between, and the words between two reads are one call (`_beam_words`), one graph for a compiled
      decoder. When the images still searching fit in half the batch or less, the batch shrinks to the least power
      of two that holds them (ended images fill the rest): a compiled decoder meets a few fixed shapes (64, 32, ...
      1 images) rather than one per number of images still searching.
    """
    K = beam_size
    if K < 1 or max_len < 1:
        raise ConfigError(f"beam_size and max_len must be >= 1, got {K} and {max_len}")
    sync_free = sync_free_default(annotations, sync_free, decoder)
    check_every = check_interval(annotations, check_every, decoder)
    device = annotations.device
    h, c = decoder.init_state(annotations)  # (B,D): one hypothesis per image before the first word
    keys = decoder.prepare(annotations)  # (B,P,K')
    # The annotations and keys stay one row per image: beams only ever move within their own image, and attention
    # broadcasts one image's annotations over its hypotheses (see captioner.models.attention).
    never = torch.tensor([pad_index, start_index], device=device)  # words never generated
    # log-probabilities of a finished hypothesis: 0 for <pad>, -inf for every other word
    finished_log_probs = finished_extension(K, decoder.vocab_size, pad_index, device)
    options = (K, max_len, length_penalty, start_index, end_index, pad_index, never, finished_log_probs)
    if sync_free:
        return _sync_free(decoder, annotations, keys, h, c, *options, check_every)
    return _shrinking(decoder, annotations, keys, h, c, *options)


def _shrinking(
    decoder, annotations, keys, h, c, K, max_len, length_penalty, start_index, end_index, pad_index, never,
    finished_log_probs,
) -> Generation:  # fmt: skip
    """`beam_search`'s shrinking batch: a word a call, the host's part (what has finished, images leaving, the record
    and its read-back) `captioner.models.search_host.BeamRecord`'s, as the ONNX loop's. On CUDA each word's read waits
    for the device: the way of a CPU, where it waits for nothing."""
    B, P = annotations.shape[:2]
    device = annotations.device
    tokens = torch.full((B,), start_index, dtype=torch.long, device=device)  # (A*G,)
    scores = torch.zeros(B, 1, device=device)  # (A,G): G hypotheses an image, 1 before the first word
    finished = torch.zeros(B, dtype=torch.bool, device=device)  # (A*G,)
    lengths = torch.zeros(B, dtype=torch.long, device=device)  # (A*G,)
    record = BeamRecord(B, K, P, max_len, pad_index)
    while True:
        A, G = scores.shape
        live = (~finished).nonzero().squeeze(1)  # (L,) the hypotheses still being written
        if live.numel() == A * G:
            logits, (h, c), alpha = decoder.step(tokens, (h, c), annotations, keys)  # (A*G,V), _, (A*G,P)
        else:  # the attention works image by image, on all G rows; the rest of the step only on the live ones
            context, alpha = decoder.attend(h, annotations, keys)  # (A*G,E), (A*G,P)
            logits, (h_live, c_live) = decoder.update(tokens[live], context[live], (h[live], c[live]))  # (L,V)
            # A finished row keeps a stale state: only the attention reads it, and its alpha is discarded below.
            h, c = h.index_copy(0, live, h_live), c.index_copy(0, live, c_live)
        log_probs = F.log_softmax(logits.float(), dim=-1).index_fill_(1, never, float("-inf"))  # (L,V)
        if live.numel() < A * G:  # the live rows were run; the finished ones' next word is <pad>, at no cost
            log_probs = finished_log_probs.repeat(A * G, 1).index_copy_(0, live, log_probs)  # (A*G,V)
        scores, parents, tokens = _best_extensions(scores, log_probs, lengths, finished, K, length_penalty)
        was_finished, lengths, finished = _follow(parents, tokens, lengths, finished, end_index)
        h, c = h[parents], c[parents]
        alphas = alpha.float()[parents].masked_fill(was_finished.unsqueeze(1), 0.0)  # (A*K,P)
        within = parents.view(A, K) - torch.arange(A, device=device).unsqueeze(1) * G  # each parent within its image
        record.write(_host(tokens.view(1, A, K)), _host(within.unsqueeze(0)), _host(alphas.view(1, A, K, P)))
        best = tuple(_host(x) for x in _winners(scores, lengths, finished, length_penalty))  # (A,) each
        done = _host(finished.view(A, K).all(dim=1))  # (A,)
        if record.over(done):
            record.finish(*best)
            return _generation(record.arrays(), device)
        keep = record.leave(done, *best)
        if keep is not None:  # these images can no longer change: their winners are kept, and they leave the batch
            images = torch.from_numpy(keep).to(device)
            hypotheses = images.repeat_interleave(K)
            annotations, keys, scores = annotations[images], keys[images], scores[images]
            h, c, tokens, finished, lengths = (x[hypotheses] for x in (h, c, tokens, finished, lengths))


def _sync_free(
    decoder, annotations, keys, h, c, K, max_len, length_penalty, start_index, end_index, pad_index, never,
    finished_log_probs, check_every,
) -> Generation:  # fmt: skip
    """`beam_search`'s sync-free way: the record stays on the device and is read back there (`_read_back`), so that
    the host copies nothing between its reads of what has finished, once every `check_every` words (the host's
    record, `captioner.models.search_host.BeamRecord`, would copy every call's words to the host)."""
    B, P = annotations.shape[:2]
    device = annotations.device
    # The images still searching (A of them, G hypotheses each, rows grouped by image) ...
    alive = torch.arange(B, device=device)  # (A,)
    tokens = torch.full((B,), start_index, dtype=torch.long, device=device)  # (A*G,)
    scores = torch.zeros(B, 1, device=device)  # (A,G)
    finished = torch.zeros(B, dtype=torch.bool, device=device)  # (A*G,)
    lengths = torch.zeros(B, dtype=torch.long, device=device)  # (A*G,)
    # ... and the record of every hypothesis, row b*K + k: final score and length, and per step its word, the
    # attention that chose it and the row it extends. Images that have left the batch go on as <pad> rows pointing
    # to themselves.
    final_scores = torch.zeros(B, K, device=device)
    final_lengths = torch.zeros(B * K, dtype=torch.long, device=device)
    final_finished = torch.zeros(B * K, dtype=torch.bool, device=device)
    record_tokens, record_alphas, record_parents = [], [], []  # (n,B*K), (n,B*K,P), (n,B*K) for n words at a time
    identity = torch.arange(B * K, device=device)
    rows = identity  # (A*K,) record rows of the hypotheses in the batch
    words, fixed = _words(decoder, _beam_words), (annotations, keys, finished_log_probs, never)
    t = 0
    while t < max_len:
        A = scores.size(0)
        n = min(check_every, max_len - t)  # check_every words a call, every row run; a finished one's next: <pad>
        (tokens, h, c, scores, lengths, finished), parents, step_tokens, step_alphas = words(
            decoder, (tokens, h, c, scores, lengths, finished), fixed, n, K, length_penalty, end_index
        )  # (n,A*K), (n,A*K), (n,A*K,P)
        step_parents = rows[parents]  # (n,A*K) record rows
        if t == 0:  # the first word extends each image's one <start> hypothesis, record row b*K
            step_parents[0] = parents[0] * K
        if A < B:  # some images have left: they stay in the record as <pad> rows pointing to themselves
            step_tokens = torch.full((n, B * K), pad_index, device=device).index_copy_(1, rows, step_tokens)
            step_parents = identity.repeat(n, 1).index_copy_(1, rows, step_parents)
            step_alphas = step_alphas.new_zeros(n, B * K, P).index_copy_(1, rows, step_alphas)
        record_tokens.append(step_tokens)
        record_parents.append(step_parents)
        record_alphas.append(step_alphas)
        t += n
        if t == max_len:
            break

        done = finished.view(A, K).all(dim=1)  # (A,): the one host sync, every check_every words
        n_done = int(done.sum())
        if n_done == A:
            break
        # images leave only when the rest fit a power of two: few shapes (a compiled step's graphs)
        size = 1 << (A - n_done - 1).bit_length()  # the least power of two >= the images still searching
        if size >= A:
            continue
        done[done.nonzero().squeeze(1)[: size - (A - n_done)]] = False  # ended images that stay, to make size
        done_rows = done.repeat_interleave(K)  # these images can no longer change: their result is recorded
        final_scores[alive[done]] = scores[done]
        final_lengths[rows[done_rows]] = lengths[done_rows]
        final_finished[rows[done_rows]] = True
        keep, keep_rows = ~done, ~done_rows
        alive, annotations, keys, scores = alive[keep], annotations[keep], keys[keep], scores[keep]
        fixed = (annotations, keys, finished_log_probs, never)
        h, c, tokens, finished, lengths = (x[keep_rows] for x in (h, c, tokens, finished, lengths))
        rows = rows[keep_rows]
    final_scores[alive] = scores
    final_lengths[rows] = lengths
    final_finished[rows] = finished

    return _read_back(
        final_scores, final_lengths, final_finished, record_tokens, record_alphas, record_parents, length_penalty
    )


def _beam_word(
    decoder: AttentionDecoder,
    state: tuple[torch.Tensor, ...],
    fixed: tuple[torch.Tensor, ...],
    K: int,
    length_penalty: float,
    end: int,
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
    """One word of the sync-free beam search, every image and hypothesis at once (a finished one is extended by <pad>
    at no cost). From the search's state (the A*G hypotheses' last words, h and c, and lengths and finished flags;
    their scores (A,G)) and what stays fixed (annotations, keys, a finished hypothesis's log-probabilities, the words
    never generated): the state of each image's K best extensions (the state reordered to them), the rows (A*K,)
    they extend, and the attention (A*K,P) that chose each word (zero where the hypothesis had finished). Fixed
    shapes, no host read: a compiled decoder runs it as one graph (`AttentionDecoder.compiled_function`)."""
    tokens, h, c, scores, lengths, finished = state
    annotations, keys, finished_log_probs, never = fixed
    logits, (h, c), alpha = type(decoder).step(decoder, tokens, (h, c), annotations, keys)  # the uncompiled step
    log_probs = F.log_softmax(logits.float(), dim=-1).index_fill_(1, never, float("-inf"))  # (A*G,V)
    log_probs = torch.where(finished.unsqueeze(1), finished_log_probs, log_probs)
    scores, parents, tokens = _best_extensions(scores, log_probs, lengths, finished, K, length_penalty)
    was_finished, lengths, finished = _follow(parents, tokens, lengths, finished, end)
    alpha = alpha.float()[parents].masked_fill(was_finished.unsqueeze(1), 0.0)
    return (tokens, h[parents], c[parents], scores, lengths, finished), parents, alpha


def _beam_words(
    decoder: AttentionDecoder,
    state: tuple[torch.Tensor, ...],
    fixed: tuple[torch.Tensor, ...],
    words: int,
    K: int,
    length_penalty: float | torch.Tensor,
    end: int,
    winners: bool = False,
) -> tuple:
    """`words` words of the sync-free beam search (`_beam_word`): the state after them, and per word the rows each
    hypothesis extends (words,A*K), its word (words,A*K) and the attention that chose it (words,A*K,P). With
    `winners`, also each image's winner after each word (`_winners`: its hypothesis, score and length, (words,A) each),
    from which a search cut short within these words reads its result (the exported graph's). Fixed shapes, no host
    read: a compiled decoder runs it as one graph, and `captioner export --format onnx` writes it as one."""
    parents, tokens, alphas, best = [], [], [], []
    for _ in range(words):
        state, parent, alpha = _beam_word(decoder, state, fixed, K, length_penalty, end)
        parents.append(parent)
        tokens.append(state[0])
        alphas.append(alpha)
        if winners:
            best.append(_winners(state[3], state[4], state[5], length_penalty))
    out = state, torch.stack(parents), torch.stack(tokens), torch.stack(alphas)
    return (*out, *(torch.stack(x) for x in zip(*best, strict=True))) if winners else out


def check_beam_size(K: int, V: int) -> None:
    """A beam can hold at most the V - 2 words a search can choose (never <pad> or <start>): a wider one would keep
    hypotheses of probability 0 ending in <pad> or <start>, fed back as the next words, and which of them it keeps
    depends on how top-k orders ties."""
    if K > V - 2:
        raise ConfigError(f"beam size {K} is larger than the {V - 2} words this vocabulary can generate (of {V})")


def finished_extension(K: int, V: int, pad_index: int, device: torch.device) -> torch.Tensor:
    """The log-probabilities (V,) of a finished hypothesis's next word: 0 for <pad>, -inf for every other word. Also
    where the vocabulary's size is first known, so where a beam wider than the words it can choose is refused."""
    check_beam_size(K, V)
    finished_log_probs = torch.full((V,), float("-inf"), device=device)
    finished_log_probs[pad_index] = 0.0
    return finished_log_probs


def _best_extensions(
    scores: torch.Tensor,
    log_probs: torch.Tensor,
    lengths: torch.Tensor,
    finished: torch.Tensor,
    K: int,
    length_penalty: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One beam step's choice: from the scores (A,G) of A images' G hypotheses and the log-probabilities (A*G,V) of
    their next words, the K best extensions of each image, ranked by score / length**length_penalty (a finished
    hypothesis keeps its length). Returns their scores (A,K), the rows (A*K,) they extend and their words (A*K,).
    A tensor `length_penalty` (an exported graph's input) always divides: by length**0 == 1, exactly the raw sum's
    ranking."""
    A, G = scores.shape
    V = log_probs.size(1)
    candidates = (scores.view(A * G, 1) + log_probs).view(A, G * V)
    if isinstance(length_penalty, torch.Tensor) or length_penalty:
        extended = (lengths + (~finished).long()).clamp(min=1).float() ** length_penalty  # (A*G,)
        best = (candidates.view(A * G, V) / extended.unsqueeze(1)).view(A, G * V).topk(K, dim=1).indices
        scores = candidates.gather(1, best)  # (A,K)
    else:
        scores, best = candidates.topk(K, dim=1)  # (A,K)
    parents = (best // V + torch.arange(A, device=scores.device).unsqueeze(1) * G).view(-1)  # (A*K,)
    tokens = best.view(-1) % V  # (A*K,); not a view, which would give torch.compile one more graph
    return scores, parents, tokens


def _follow(
    parents: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor, finished: torch.Tensor, end: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chosen extensions' rows (A*K,): whether their parent had finished, their lengths and finished flags."""
    was_finished = finished[parents]
    return was_finished, lengths[parents] + (~was_finished).long(), was_finished | (tokens == end)


def _winners(
    scores: torch.Tensor, lengths: torch.Tensor, finished: torch.Tensor, length_penalty: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each image's result if its search ended here: of its K hypotheses (scores (A,K), lengths and finished flags
    (A*K,)), the best finished one by score / length**length_penalty, or the best unfinished one if none has
    finished. Returns its index among the K (A,), its score and its length (A,)."""
    A, K = scores.shape
    lengths, finished = lengths.view(A, K), finished.view(A, K)
    ranking = scores / lengths.clamp(min=1).float() ** length_penalty  # (A,K)
    ranking = ranking.masked_fill(finished.any(dim=1, keepdim=True) & ~finished, float("-inf"))
    k = ranking.argmax(dim=1, keepdim=True)  # (A,1)
    return k.squeeze(1), scores.gather(1, k).squeeze(1), lengths.gather(1, k).squeeze(1)


def _read_back(
    final_scores: torch.Tensor,
    final_lengths: torch.Tensor,
    final_finished: torch.Tensor,
    record_tokens: list[torch.Tensor],
    record_alphas: list[torch.Tensor],
    record_parents: list[torch.Tensor],
    length_penalty: float,
) -> Generation:
    """Each image's best hypothesis (finished ones first), read back along the back-pointers from its last word.
    Scores (B,K), lengths and finished (B*K,), and n words at a time the (n,B*K) words, (n,B*K,P) alphas and (n,B*K)
    parent rows."""
    record_tokens, record_alphas, record_parents = (
        list(torch.cat(record)) for record in (record_tokens, record_alphas, record_parents)
    )
    B, K = final_scores.shape
    device = final_scores.device
    winner = _winners(final_scores, final_lengths, final_finished, length_penalty)[0]
    choice = winner + torch.arange(B, device=device) * K  # (B,) record rows of the winners
    steps = len(record_tokens)
    P = record_alphas[0].size(1)
    out_tokens = torch.empty(B, steps, dtype=torch.long, device=device)
    out_alphas = torch.empty(B, steps, P, device=device)  # float32, also under autocast
    row = choice
    for t in reversed(range(steps)):  # follow the back-pointers from the last word to the first
        out_tokens[:, t] = record_tokens[t][row]
        out_alphas[:, t] = record_alphas[t][row]
        row = record_parents[t][row]
    lengths = final_lengths[choice]
    width = int(lengths.max())  # the longest winner: the columns after it hold <pad> only
    return Generation(out_tokens[:, :width], lengths, final_scores.view(-1)[choice], out_alphas[:, :width])
