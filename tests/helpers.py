"""What several test files share: toy decoders with known outputs, a small model and a batch of captions for it,
and the metrics a run logged."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import torch

from captioner.models.decoder import AttentionDecoder
from captioner.models.show_attend_tell import ShowAttendTell

PAD, START, END, A, B, C = range(6)
SPECIAL = {"start_index": START, "end_index": END, "pad_index": PAD}


class TableDecoder:
    """Next-word probabilities depend only on the previous word, read from a (V,V) table of probabilities."""

    compiled = False

    def __init__(self, probs: dict[int, dict[int, float]], vocab_size: int = 6):
        self.vocab_size = vocab_size
        self.logits = torch.full((vocab_size, vocab_size), -1e4)
        for prev, row in probs.items():
            for word, p in row.items():
                self.logits[prev, word] = math.log(p)

    def prepare(self, annotations):
        return annotations

    def init_state(self, annotations):
        zeros = annotations.new_zeros(annotations.size(0), 1)
        return zeros, zeros

    def step(self, tokens, state, annotations, keys):
        context, alpha = self.attend(state[0], annotations, keys)
        logits, state = self.update(tokens, context, state)
        return logits, state, alpha

    def attend(self, h, annotations, keys):
        N, P = h.size(0), annotations.size(1)
        return annotations.new_zeros(N, 1), annotations.new_full((N, P), 1.0 / P)

    def update(self, tokens, context, state):
        return self.logits[tokens], state


def random_decoder() -> AttentionDecoder:
    torch.manual_seed(0)
    return AttentionDecoder(30, 16, 9, embed_dim=8, decoder_dim=12, attention_dim=10, dropout=0.0).eval()


V = 20


def small_model(**options) -> ShowAttendTell:
    """A ShowAttendTell of a few units a layer, its encoder untrained, over a vocabulary of V words."""
    options = {"embed_dim": 8, "decoder_dim": 12, "attention_dim": 10, "dropout": 0.0} | options
    return ShowAttendTell(V, pretrained=False, **options)


def caption_batch(m: ShowAttendTell, lengths=(5, 7, 3, 10, 2)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Annotations, captions (B,T) padded to the longest, lengths: captions end at different steps, not sorted."""
    lengths = torch.tensor(lengths)
    captions = torch.randint(4, V, (len(lengths), int(lengths.max())))
    for i, n in enumerate(lengths):
        captions[i, 0], captions[i, n - 1], captions[i, n:] = 1, 2, 0
    a = torch.randn(len(lengths), m.encoder.num_pixels, m.encoder.out_dim).relu()
    return a, captions, lengths


def metrics_csvs(root: Path) -> list[list[dict[str, str]]]:
    """The rows of each metrics.csv that the commands run under `root` wrote (each command writes one), oldest first."""
    paths = sorted((root / "logs").rglob("metrics.csv"), key=lambda p: p.stat().st_mtime_ns)
    return [list(csv.DictReader(path.read_text().splitlines())) for path in paths]


def logged(root: Path, epoch: int | None = None) -> dict[str, float]:
    """Every metric the commands run under `root` logged: its last value (of `epoch`, if given)."""
    rows = [row for run in metrics_csvs(root) for row in run if epoch is None or row["epoch"] == str(epoch)]
    return {key: float(value) for row in rows for key, value in row.items() if value and "/" in key}


def ranking(result, max_len: int = 30, length_penalty: float = 1.0) -> float:
    """What beam search ranked a caption by: its score / its length ** length_penalty (<end> counted if it ended)."""
    length = len(result.tokens) + 1 if len(result.tokens) < max_len else max_len
    return result.score / length**length_penalty


def compare(want: list, got: list, beam_size: int, **options) -> list[int]:
    """Torch's captions (`want`) against ONNX Runtime's (`got`): the images whose captions differ, each a beam's
    near-tie (rankings within 1e-4), which float rounding may decide either way; for those equal, the scores and each
    word's attention agree."""
    differ = [i for i, (w, g) in enumerate(zip(want, got, strict=True)) if w.tokens != g.tokens]
    for w, g in zip(want, got, strict=True):
        if w.tokens == g.tokens:
            assert g.text == w.text and g.grid_hw == w.grid_hw
            assert abs(g.score - w.score) < 1e-3, (w.score, g.score)
            assert g.alphas.shape == tuple(w.alphas.shape) and g.alphas.dtype == np.float32
            assert np.abs(g.alphas - w.alphas.numpy()).max() <= 1e-4, w.text
    for i in differ:  # a beam's near-tie, which float rounding may decide either way
        assert beam_size > 1, (want[i].text, got[i].text)
        assert abs(ranking(want[i], **options) - ranking(got[i], **options)) <= 1e-4, (want[i].text, got[i].text)
    return differ
