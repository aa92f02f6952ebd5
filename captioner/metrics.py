"""Caption metrics. BLEU comes from nltk; nothing here re-implements a published scorer."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence

from nltk.translate.bleu_score import corpus_bleu

log = logging.getLogger(__name__)

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


def coco_caption_scores(
    hypotheses: dict, references: dict, meteor: bool | None = None, tokenized: bool = False
) -> dict[str, float]:
    """BLEU-1..4, METEOR, ROUGE-L and CIDEr-D from pycocoevalcap, the scorers called one by one.

    `COCOEvalCap.evaluate()` is not used: it always builds SPICE, which downloads Stanford CoreNLP. METEOR and the
    PTB tokenizer run Java; without Java, METEOR is skipped with a one-line warning.

    Args:
        hypotheses: image id -> generated caption.
        references: image id -> list of reference captions.
        meteor: compute METEOR (None: when Java is available).
        tokenized: captions are already lowercased, space-separated tokens (skips the PTB tokenizer, so no Java).
    """
    import shutil

    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    java = shutil.which("java") is not None
    if meteor is None:
        meteor = java
    if meteor and not java:
        log.warning("METEOR skipped: it needs Java, which is not installed")
        meteor = False
    if set(hypotheses) != set(references):
        raise ValueError("hypotheses and references must cover the same image ids")
    if tokenized:
        res = {k: [v] for k, v in hypotheses.items()}
        gts = {k: list(v) for k, v in references.items()}
    else:
        if not java:
            raise RuntimeError("the PTB tokenizer needs Java; pass tokenized captions instead")
        from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

        tokenizer = PTBTokenizer()
        res = tokenizer.tokenize({k: [{"caption": v}] for k, v in hypotheses.items()})
        gts = tokenizer.tokenize({k: [{"caption": c} for c in v] for k, v in references.items()})
    scores: dict[str, float] = {}
    bleu_scores, _ = Bleu(4).compute_score(gts, res, verbose=0)
    scores.update({f"Bleu_{n}": float(s) for n, s in enumerate(bleu_scores, start=1)})
    if meteor:
        from pycocoevalcap.meteor.meteor import Meteor

        scorer = Meteor()
        scores["METEOR"] = float(scorer.compute_score(gts, res)[0])
        del scorer  # stops its Java process
    scores["ROUGE_L"] = float(Rouge().compute_score(gts, res)[0])
    scores["CIDEr"] = float(Cider().compute_score(gts, res)[0])
    return scores


def cider(hypotheses: Sequence[Tokens], references: Sequence[Sequence[Tokens]]) -> float:
    """CIDEr-D (pycocoevalcap) of tokenized captions; pure Python, no Java."""
    from pycocoevalcap.cider.cider import Cider

    if not hypotheses:
        return 0.0
    res = {i: [" ".join(h)] for i, h in enumerate(hypotheses)}
    gts = {i: [" ".join(r) for r in refs] for i, refs in enumerate(references)}
    return float(Cider().compute_score(gts, res)[0])
