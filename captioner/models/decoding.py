"""Caption generation from annotations: what both searches share (the length penalty, sync-free reading, their
result), greedy search, and the sampling of self-critical training; beam search is `captioner.models.beam_search`.
Each is batched over images (and hypotheses)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from captioner.errors import ConfigError
from captioner.models.decoder import AttentionDecoder
from captioner.models.search_host import GreedyRecord

# Beam search ranks hypotheses by log-probability / length**LENGTH_PENALTY. Ranked by the raw sum (0), every word
# costs probability, so short captions win: on a weak model, beam search ends after two words where greedy search
# goes on. Per word (1, as fairseq and Hugging Face default to) it does not; on the bundled model it also scores
# higher (docs/attention.md, "The bundled model": BLEU-4 0.956 against 0.945 ranked by the raw sum).
LENGTH_PENALTY = 1.0

# Sync-free decoding (the GPU's: see `greedy_search`) asks the device whether every caption has ended once every this
# many words: one device-to-host copy per CHECK_EVERY words instead of one per word, at the cost of up to
# CHECK_EVERY - 1 words run after the last caption ended. The words between two reads are one call (`_greedy_words`,
# `_beam_words`): with a compiled decoder, one graph. An uncompiled search on a CPU, where the read waits for nothing,
# reads at every word (`check_interval`).
CHECK_EVERY = 8


def check_interval(annotations: torch.Tensor, check_every: int | None, decoder: AttentionDecoder) -> int:
    """How often a sync-free search reads whether every caption has ended: `check_every` as asked; else CHECK_EVERY
    words on an accelerator, where the read makes the host wait for the device, and with a compiled decoder, whose
    graph runs the words between two reads (on this CPU, chunks of 8 words search one image 1.85x as fast as eager,
    a graph per word 1.17x: docs/benchmarks.md); else every word, which on a CPU waits for nothing and stops the search
    at the last caption's end."""
    if check_every is not None:
        if check_every < 1:
            raise ConfigError(f"check_every must be >= 1, got {check_every}")
        return check_every
    if annotations.device.type != "cpu" or decoder.compiled:
        return CHECK_EVERY
    return 1


def sync_free_default(annotations: torch.Tensor, sync_free: bool | None, decoder: AttentionDecoder) -> bool:
    """`sync_free` as asked, or by default on CUDA, where a device-to-host copy per word stalls the launch queue, and
    with a compiled decoder, whose step runs at fixed shapes (`AttentionDecoder.compile_search`). On a CPU there is
    no queue to stall, and the shrinking batch saves work."""
    if sync_free is not None:
        return sync_free
    return annotations.device.type == "cuda" or decoder.compiled


@dataclass
class Generation:
    """Generated captions for a batch.

    tokens: (B,T) word ids after <start>, up to and including <end> when it was produced, then <pad> (0).
    lengths: (B,) number of real tokens in each row, <end> included.
    scores: (B,) sum of the log-probabilities of the real tokens.
    alphas: (B,T,P) attention of each generated token, zero after the end; float32, also under autocast.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    scores: torch.Tensor
    alphas: torch.Tensor


def _host(x: torch.Tensor):
    """A tensor's values on the host, as numpy, for the host's part of a search (`captioner.models.search_host`): no
    copy on a CPU."""
    return x.detach().cpu().numpy()


def _generation(arrays: tuple, device: torch.device) -> Generation:
    """A host record's arrays (`GreedyRecord.arrays`, `BeamRecord.arrays`) as a Generation on `device`."""
    return Generation(*(torch.from_numpy(array).to(device) for array in arrays))


def _words(decoder: AttentionDecoder, function):
    """A sync-free search's run of words between two reads (`_greedy_words`, `_beam_words`): compiled, one graph per
    shape, for a compiled decoder (`AttentionDecoder.compiled_function`); else `function` itself."""
    return decoder.compiled_function(function) if decoder.compiled else function


def greedy_search(
    decoder: AttentionDecoder,
    annotations: torch.Tensor,
    start_index: int,
    end_index: int,
    max_len: int = 30,
    pad_index: int = 0,
    sync_free: bool | None = None,
    check_every: int | None = None,
) -> Generation:
    """Pick the most probable word at every step until every caption has produced <end> or max_len words.

    Two ways to the same captions (`sync_free`: by default on CUDA and compiled, see `sync_free_default`):
    - the batch shrinks as captions end: the decoder only runs the captions still being written, and the host reads
      at every word which have ended (the CPU's way: 1.45x faster there at batch 64, docs/benchmarks.md);
    - sync-free: every caption runs every step, an ended one writing <pad> at no cost, and whether all have ended is
      read once every `check_every` words (`check_interval`: 8 on a GPU and with a compiled decoder): the device
      never waits for the host in between. The words between two reads are one call (`_greedy_words`), one graph for
      a compiled decoder: with `check_every` >= `max_len`, the whole search.
    """
    if max_len < 1:
        raise ConfigError(f"max_len must be >= 1, got {max_len}")
    sync_free = sync_free_default(annotations, sync_free, decoder)
    check_every = check_interval(annotations, check_every, decoder)
    B, P, _ = annotations.shape
    device = annotations.device
    h, c = decoder.init_state(annotations)  # (B,D) each
    keys = decoder.prepare(annotations)  # (B,P,K)
    never = torch.tensor([pad_index, start_index], device=device)  # words never generated
    tokens = torch.full((B,), start_index, dtype=torch.long, device=device)
    scores = torch.zeros(B, device=device)
    lengths = torch.zeros(B, dtype=torch.long, device=device)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    if sync_free:  # every caption runs every word, an ended one going on with <pad> at no cost
        words, fixed = _words(decoder, _greedy_words), (annotations, keys, never)
        state, written, t = (tokens, h, c, scores, lengths, finished), [], 0
        while t < max_len:  # check_every words a call, then the one host sync
            n = min(check_every, max_len - t)
            state, *chunk = words(decoder, state, fixed, n, pad_index, end_index)  # _, (B,n), (B,n,P)
            written.append(chunk)
            t += n
            if t < max_len and bool(state[-1].all()):
                break
        _, _, _, scores, lengths, _ = state
        out_tokens, out_alphas = (torch.cat(parts, dim=1) for parts in zip(*written, strict=True))
        steps = int(lengths.max())
        return Generation(out_tokens[:, :steps], lengths, scores, out_alphas[:, :steps])
    # The batch shrinks as captions end, a word a call; the host's part (what has ended, captions leaving, the record)
    # is `search_host.GreedyRecord`'s, as the ONNX loop's. On CUDA each word's read waits for the device.
    record = GreedyRecord(B, P, max_len, pad_index)
    while True:
        logits, (h, c), alpha = decoder.step(tokens, (h, c), annotations, keys)  # (A,V), _, (A,P)
        best, tokens = F.log_softmax(logits.float(), dim=-1).index_fill_(1, never, float("-inf")).max(dim=-1)
        scores, lengths = scores + best, lengths + 1
        record.write(_host(tokens.unsqueeze(1)), _host(alpha.float().unsqueeze(1)), _host(scores), _host(lengths))
        finished = _host(tokens == end_index)
        if record.over(finished):
            return _generation(record.arrays(), device)
        keep = record.leave(finished)
        if keep is not None:  # the ended captions leave the batch
            keep = torch.from_numpy(keep).to(device)
            tokens, h, c, annotations, keys, scores, lengths = (
                x[keep] for x in (tokens, h, c, annotations, keys, scores, lengths)
            )


def _greedy_words(
    decoder: AttentionDecoder,
    state: tuple[torch.Tensor, ...],
    fixed: tuple[torch.Tensor, ...],
    words: int,
    pad: int,
    end: int,
    totals: bool = False,
) -> tuple:
    """`words` words of the sync-free greedy search (`_greedy_word`): the state after them, and their words (B,words)
    and float32 alphas (B,words,P); with `totals`, also each caption's score and length after each word (B,words)
    each, from which a search cut short within these words reads its result (the exported graph's). Fixed shapes, no
    host read: a compiled decoder runs it as one graph, and `captioner export --format onnx` writes it as one."""
    tokens, alphas, scores, lengths = [], [], [], []
    for _ in range(words):
        state, alpha = _greedy_word(decoder, state, fixed, pad, end)
        tokens.append(state[0])
        alphas.append(alpha)
        scores.append(state[3])
        lengths.append(state[4])
    out = state, torch.stack(tokens, dim=1), torch.stack(alphas, dim=1)
    return (*out, torch.stack(scores, dim=1), torch.stack(lengths, dim=1)) if totals else out


def _greedy_word(
    decoder: AttentionDecoder, state: tuple[torch.Tensor, ...], fixed: tuple[torch.Tensor, ...], pad: int, end: int
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """One word of the sync-free greedy search, every caption at once (an ended one writes <pad> at no cost): from
    the search's state (tokens (B,), h and c (B,D), scores, lengths and finished flags (B,)) and what stays fixed
    (annotations, keys, the words never generated), the next state and the words' float32 alphas (B,P). Fixed shapes,
    no host read: a compiled decoder runs it as one graph (`AttentionDecoder.compiled_function`)."""
    tokens, h, c, scores, lengths, finished = state
    annotations, keys, never = fixed
    logits, (h, c), alpha = type(decoder).step(decoder, tokens, (h, c), annotations, keys)  # the uncompiled step
    best, tokens = F.log_softmax(logits.float(), dim=-1).index_fill_(1, never, float("-inf")).max(dim=-1)
    writing = ~finished
    tokens = tokens.masked_fill(finished, pad)
    state = tokens, h, c, scores + best * writing, lengths + writing, finished | (tokens == end)
    return state, alpha.float() * writing.unsqueeze(1)


@dataclass
class Samples:
    """Captions drawn from the model, K per image (self-critical training).

    tokens: (B,K,T) word ids after <start>, up to and including <end> when it was drawn, then <pad>.
    log_probs: (B,K,T) log p(w_t | w_<t, image) of each drawn word, 0 after the end; differentiable.
    mask: (B,K,T) the real words, <end> included.
    """

    tokens: torch.Tensor
    log_probs: torch.Tensor
    mask: torch.Tensor


def sample_captions(
    decoder: AttentionDecoder,
    annotations: torch.Tensor,
    samples: int,
    start_index: int,
    end_index: int,
    max_len: int = 30,
    pad_index: int = 0,
) -> Samples:
    """Draw `samples` captions per image from the model's word distribution (temperature 1), keeping the graph of
    each drawn word's log-probability. Batched as beam search is: the K captions of an image are its K hypotheses, and
    attend over its annotations without copying them. Every caption runs until all have drawn <end> (or max_len)."""
    if samples < 1 or max_len < 1:
        raise ConfigError(f"samples and max_len must be >= 1, got {samples} and {max_len}")
    B, K = annotations.size(0), samples
    keys = decoder.prepare(annotations)  # (B,P,K')
    h, c = (x.repeat_interleave(K, dim=0) for x in decoder.init_state(annotations))  # (B*K,D) each
    tokens = torch.full((B * K,), start_index, dtype=torch.long, device=annotations.device)
    finished = torch.zeros(B * K, dtype=torch.bool, device=annotations.device)
    never = torch.tensor([pad_index, start_index], device=annotations.device)  # words never drawn
    drawn, log_probs, real = [], [], []
    for _ in range(max_len):
        logits, (h, c), _ = decoder.step(tokens, (h, c), annotations, keys)  # (B*K,V)
        log_p = F.log_softmax(logits.float().index_fill(1, never, float("-inf")), dim=-1)  # (B*K,V)
        word = torch.multinomial(log_p.detach().exp(), 1).squeeze(1)  # (B*K,)
        word = word.masked_fill(finished, pad_index)
        chosen = log_p.gather(1, word.masked_fill(finished, end_index).unsqueeze(1)).squeeze(1)  # finite everywhere
        drawn.append(word)
        log_probs.append(chosen.masked_fill(finished, 0.0))
        real.append(~finished)
        finished = finished | (word == end_index)
        tokens = word
        if bool(finished.all()):
            break
    shape = (B, K, len(drawn))
    return Samples(
        torch.stack(drawn, 1).view(shape), torch.stack(log_probs, 1).view(shape), torch.stack(real, 1).view(shape)
    )
