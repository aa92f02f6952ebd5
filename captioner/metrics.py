"""Caption metrics. BLEU comes from nltk; nothing here re-implements a published scorer."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from nltk.translate.bleu_score import corpus_bleu

Tokens = Sequence[str]


def bleu(hypotheses: Sequence[Tokens], references: Sequence[Sequence[Tokens]], n: int = 4) -> float:
    """Corpus BLEU-n (uniform weights) of tokenized hypotheses, each against all of its references."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} reference sets")
    if not hypotheses:
        return 0.0
    with warnings.catch_warnings():  # nltk warns when a poor (e.g. untrained) model has no n-gram overlap at all
        warnings.simplefilter("ignore", UserWarning)
        return float(corpus_bleu(references, hypotheses, weights=(1.0 / n,) * n))
