"""The popular tutorial's way of writing the same model (sgrvinod's a-PyTorch-Tutorial-to-Image-Captioning), with
captioner's layers: its teacher forcing and its beam search, the reference every speed table compares with."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from captioner.models.decoder import AttentionDecoder
from common.synthetic import SPECIAL


def tutorial_forward(decoder: AttentionDecoder, a: torch.Tensor, captions: torch.Tensor, lengths: torch.Tensor):
    """The tutorial decoder's teacher forcing: captions sorted by length, each word run on a slice of the captions
    still going (their lengths read to the host), the annotations' attention projection computed again at every
    word, the output layer word by word. Returns logits (B,T-1,V) and alphas (B,T-1,P) in the sorted order, and the
    order."""
    lengths, order = lengths.sort(descending=True)
    a, captions = a[order], captions[order]
    steps = (lengths - 1).tolist()
    h, c = decoder.init_state(a)
    B, T = captions.size(0), steps[0]
    logits = a.new_zeros(B, T, decoder.vocab_size)
    alphas = a.new_zeros(B, T, a.size(1))
    scorer = decoder.attention
    for t in range(T):
        n = sum(s > t for s in steps)
        e = scorer.v(torch.tanh(scorer.W(a[:n]) + scorer.U(h[:n]).unsqueeze(1))).squeeze(-1)  # (n,P)
        alpha = F.softmax(e, dim=1)
        context = torch.sigmoid(decoder.f_beta(h[:n])) * (alpha.unsqueeze(2) * a[:n]).sum(dim=1)  # (n,E)
        y = decoder.embedding(captions[:n, t])
        h, c = decoder.lstm(torch.cat([y, context], dim=1), (h[:n], c[:n]))
        logits[:n, t] = decoder.output(y, h, context).float()
        alphas[:n, t] = alpha.float()
    return logits, alphas, order


def tutorial_beam_search(decoder: AttentionDecoder, a: torch.Tensor, K: int, max_len: int) -> list[int]:
    """The tutorial's beam search for one image (1,P,E), as its caption.py runs it: its K beams shrink as they end,
    which the host reads at every word; the annotations' attention projection is computed at every word."""
    V, end = decoder.vocab_size, SPECIAL["end_index"]
    a = a.expand(K, *a.shape[1:])
    words = torch.full((K, 1), SPECIAL["start_index"], device=a.device)
    scores = torch.zeros(K, 1, device=a.device)
    h, c = decoder.init_state(a)
    complete, complete_scores = [], []
    scorer = decoder.attention
    for step in range(max_len):
        k = words.size(0)
        e = scorer.v(torch.tanh(scorer.W(a[:k]) + scorer.U(h).unsqueeze(1))).squeeze(-1)
        context = torch.sigmoid(decoder.f_beta(h)) * (F.softmax(e, dim=1).unsqueeze(2) * a[:k]).sum(dim=1)
        y = decoder.embedding(words[:, -1])
        h, c = decoder.lstm(torch.cat([y, context], dim=1), (h, c))
        log_probs = scores + F.log_softmax(decoder.output(y, h, context), dim=1)  # (k,V)
        flat = log_probs[0] if step == 0 else log_probs.view(-1)
        scores, best = flat.topk(k)
        parent, word = best // V, best % V
        words = torch.cat([words[parent], word.unsqueeze(1)], dim=1)
        ended = (word == end).tolist()  # the host learns which beams ended: a sync at every word
        going = [i for i, e in enumerate(ended) if not e]
        complete += [words[i].tolist() for i, e in enumerate(ended) if e]
        complete_scores += [float(scores[i]) for i, e in enumerate(ended) if e]
        if not going:
            break
        words, scores = words[going], scores[going].unsqueeze(1)
        h, c = h[parent[going]], c[parent[going]]
    if not complete:
        return words[0].tolist()
    return complete[max(range(len(complete)), key=complete_scores.__getitem__)]
