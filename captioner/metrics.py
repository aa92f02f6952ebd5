"""Caption metrics over a split. BLEU comes from nltk and the coco-caption scores from pycocoevalcap; CIDEr-D of
validation is `captioner.cider`'s, which SCST needs anyway and which gives pycocoevalcap's scores. Attention
correctness (Liu et al. 2017) and its ceiling score any dataset whose words can be linked to object boxes; on shapes,
`captioner.data.shapes.word_boxes` links them."""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from nltk.translate.bleu_score import corpus_bleu

from captioner.cider import CiderD
from captioner.data.shapes import word_boxes
from captioner.data.vocab import Vocabulary

log = logging.getLogger(__name__)

Tokens = Sequence[str]
Box = tuple[int, int, int, int]  # x0, y0, x1, y1 in pixels
Boxes = Sequence[Box | None]  # per word: the box of the object it names, or None


# English words that name nothing in an image, whose attention may rightly look nowhere: the peakedness figures are
# also given without them ("content words"). Captions in another language keep all their words.
FUNCTION_WORDS = frozenset(
    """a an the this that these those there here it its they them their he him his she her we our you your i me my
    of on in at to for with without by from into onto over under above below near next beside behind between among
    around through along across up down out off about against toward towards while as than then so very too also
    and or but nor if because
    is are was were be been being am has have had do does did can could will would may might should must
    some any many much more most several each every other another few lots lot all both either neither no not
    which who whom whose what where when how""".split()  # noqa: SIM905 (a block of words reads better than a list)
)


class Decoded(NamedTuple):
    """One image's caption in a validation or test, and what scores it."""

    index: int  # the image's index in its split
    words: list[str]
    references: list[list[str]]
    masses: list[float]  # attention correctness of each word that names an object (datasets with boxes: shapes)
    baselines: list[float]  # what uniform attention scores on those words
    ceilings: list[float]  # the best that attention on the grid can score on them
    peaks: Sequence[float] = ()  # per word: the share of its attention in its strongest tenth of cells (`peakedness`)
    entropies: Sequence[float] = ()  # per word: its attention's entropy over uniform's, log P (`peakedness`)
    shifts: Sequence[float] = ()  # per word: how far its attention is from its caption's average (`attention_shift`)


def attention_scores(words: Tokens, alphas, grid_hw: tuple[int, int], objects, size: int | None) -> tuple[list, ...]:
    """Attention correctness, its uniform baseline and its ceiling on one image's words, for a dataset with object
    boxes (`objects`, on a `size`-pixel square canvas); three empty lists for the others."""
    if objects is None:
        return [], [], []
    boxes = word_boxes(words, objects)
    masses, baselines = attention_correctness(alphas, boxes, grid_hw, (size, size))
    return masses, baselines, attention_ceiling(boxes, grid_hw, (size, size))


def decode_batch(batch: dict, generation, vocab: Vocabulary, grid_hw: tuple[int, int]) -> list[Decoded]:
    """A validation or test batch's captions (`generation`, a `Generation`) read as `Decoded`: each image's words,
    its references and, for a dataset with object boxes, its attention scores."""
    # One copy of the attention weights from the device for the batch, and none for a dataset without boxes (COCO,
    # Flickr, UCM), where nothing reads them.
    boxed = any(objects is not None for objects in batch["objects"])
    alphas, decoded = generation.alphas.float().cpu() if boxed else None, []
    ends = generation.tokens == vocab.end_index  # (B,T): the words are the tokens before the first <end>
    counts = torch.where(ends.any(dim=1), ends.int().argmax(dim=1), ends.size(1))  # (B,)
    shift = attention_shift(generation.alphas, counts)
    peaks, entropies, shifts = torch.stack([*peakedness(generation.alphas), shift]).tolist()  # (B,T) each, one copy
    for i, (index, tokens) in enumerate(zip(batch["index"].tolist(), generation.tokens.tolist(), strict=True)):
        words = vocab.decode_tokens(tokens)
        image_alphas = None if alphas is None else alphas[i]
        where = attention_scores(words, image_alphas, grid_hw, batch["objects"][i], batch["canvas"][i])
        n = len(words)
        figures = peaks[i][:n], entropies[i][:n], shifts[i][:n]
        decoded.append(Decoded(index, words, batch["references"][i], *where, *figures))
    return decoded


def attention_correctness(
    alphas, boxes: Boxes, grid_hw: tuple[int, int], image_size: tuple[int, int]
) -> tuple[list[float], list[float]]:
    """Attention correctness (Liu et al. 2017) on one image: for each generated word that names an object (`boxes[t]`,
    the object's box, or None), the share of its attention `alphas[t]` (upsampled to the image and normalised) inside
    that box. Returns the per-word masses and, for the same words, the uniform-attention baseline (the box's share of
    the image)."""
    from captioner.visualize import attention_map

    W, H = image_size
    masses, baselines = [], []
    for t, box in enumerate(boxes):
        if box is None:
            continue
        x0, y0, x1, y1 = box
        heat = attention_map(alphas[t], grid_hw, (W, H))  # (H,W), sums to 1
        masses.append(float(heat[y0:y1, x0:x1].sum()))
        baselines.append((x1 - x0) * (y1 - y0) / (W * H))
    return masses, baselines


def oracle_attention(box: Box, grid_hw: tuple[int, int], image_size: tuple[int, int]) -> np.ndarray:
    """The best attention a grid can give an object: spread evenly over the cells whose centres lie inside its box
    (the cell holding the box's centre if none does). A (P,) numpy array."""
    (h, w), (W, H) = grid_hw, image_size
    x0, y0, x1, y1 = box
    xs, ys = (np.arange(w) + 0.5) * W / w, (np.arange(h) + 0.5) * H / h  # cell centres, in pixels
    inside = np.outer((ys >= y0) & (ys < y1), (xs >= x0) & (xs < x1)).astype(np.float64)  # (h,w)
    if not inside.any():
        inside[min(int((y0 + y1) / 2 * h / H), h - 1), min(int((x0 + x1) / 2 * w / W), w - 1)] = 1.0
    return (inside / inside.sum()).reshape(-1)


def attention_ceiling(boxes: Boxes, grid_hw: tuple[int, int], image_size: tuple[int, int]) -> list[float]:
    """Attention correctness's ceiling on one image: the score of `oracle_attention` for the same words as
    `attention_correctness` scores. Upsampling spreads even the best grid attention beyond the box, so it is below 1:
    on 224-pixel shapes images about 0.81 for a small shape and 0.88 for a large one on the 14x14 grid, 0.64 and 0.78
    on 7x7."""
    P = grid_hw[0] * grid_hw[1]
    alphas = [oracle_attention(box, grid_hw, image_size) if box is not None else np.zeros(P) for box in boxes]
    return attention_correctness(np.array(alphas).reshape(len(boxes), P), boxes, grid_hw, image_size)[0]


def peakedness(alphas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How peaked each word's attention is, for attention weights (..., P) over P cells, computed where they are:
    - the share of its weight in its strongest tenth of the cells, ceil(P/10) of them: uniform attention gives
      ceil(P/10)/P (0.102 on 7x7, on 14x14 too), attention on one cell 1;
    - its entropy over uniform attention's, H(alpha) / log P: 1 for uniform attention, 0 for one cell.
    Rows of zeros (steps after a caption's end) give 0 and 0."""
    alphas = alphas.float()
    P = alphas.size(-1)
    total = alphas.sum(-1)
    top = alphas.topk(math.ceil(P / 10), dim=-1).values.sum(-1) / total.clamp_min(1e-12)
    entropy = -(alphas * alphas.clamp_min(1e-12).log()).sum(-1)
    return top, (entropy / math.log(P) if P > 1 else torch.zeros_like(entropy))


def attention_shift(alphas: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """How far each word's attention is from the average of its caption's words', half the L1 distance between them:
    0 when every word of the caption attends to the same cells (however peaked), up to 1 - 1/n for n words that
    attend to disjoint cells. Computed where the weights are: `alphas` (B,T,P), the first `counts` (B,) steps of each
    caption its words'. (B,T), 0 after the words. Peaked attention that is the same for every word has a shift of 0:
    this figure says whether the overlays differ word by word."""
    alphas = alphas.float()
    words = (torch.arange(alphas.size(1), device=alphas.device) < counts.to(alphas.device)[:, None]).unsqueeze(-1)
    average = (alphas * words).sum(1, keepdim=True) / counts.to(alphas.device).clamp_min(1).view(-1, 1, 1)  # (B,1,P)
    return 0.5 * ((alphas - average).abs() * words).sum(-1)


def peakedness_scores(decoded: Sequence[Decoded]) -> dict[str, float]:
    """The mean of `peakedness`'s two figures and of `attention_shift` over every word of the captions, and over
    their content words (not in FUNCTION_WORDS) alone: attn_top_tenth(_content), attn_entropy(_content) and
    attn_shift(_content). Empty without words."""
    rows = (zip(d.words, d.peaks, d.entropies, d.shifts, strict=True) for d in decoded if d.peaks)
    words = [row for caption in rows for row in caption]  # scored captions' words
    content = [row for row in words if row[0] not in FUNCTION_WORDS]
    scores = {}
    for suffix, rows in (("", words), ("_content", content)):
        if rows:
            scores[f"attn_top_tenth{suffix}"] = sum(row[1] for row in rows) / len(rows)
            scores[f"attn_entropy{suffix}"] = sum(row[2] for row in rows) / len(rows)
            scores[f"attn_shift{suffix}"] = sum(row[3] for row in rows) / len(rows)
    return scores


def split_scores(decoded: Sequence[Decoded]) -> dict[str, float]:
    """The corpus scores of a split's captions (gathered from every process under DDP: an image that the
    DistributedSampler repeated counts once): BLEU-4, CIDEr-D and, with object boxes, attention correctness per word,
    with what uniform attention and the best grid attention score."""
    images = {d.index: d for d in decoded}
    ordered = [images[i] for i in sorted(images)]
    hypotheses, references = [d.words for d in ordered], [d.references for d in ordered]
    scores = {"bleu4": bleu(hypotheses, references, n=4), "cider": cider(hypotheses, references)}
    masses = [m for d in ordered for m in d.masses]
    if masses:
        baselines, ceilings = [b for d in ordered for b in d.baselines], [c for d in ordered for c in d.ceilings]
        scores["attn_correctness"] = sum(masses) / len(masses)
        scores["attn_uniform_baseline"] = sum(baselines) / len(baselines)
        scores["attn_ceiling"] = sum(ceilings) / len(ceilings)
    return scores | peakedness_scores(ordered)


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
    """CIDEr-D of tokenized captions over a corpus, document frequencies from its references: pycocoevalcap's `Cider`
    score (tests/test_cider.py), computed by `captioner.cider.CiderD`, the one CIDEr-D that SCST's reward uses too."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} reference sets")
    if not hypotheses:
        return 0.0
    scorer = CiderD(references)
    return sum(scorer(words, image) for image, words in enumerate(hypotheses)) / len(hypotheses)
