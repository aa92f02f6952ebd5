"""CIDEr-D (Vedantam et al. 2015) as a reward: the self-critical objective scores every sampled caption of a batch.

pycocoevalcap's `Cider` computes document frequencies from the references it is given, which is right for a test
split and wrong for a batch of 64 images. `CiderD` takes them once from a whole corpus (the training split), and keeps
each image's reference vectors, so that scoring a caption costs counting its n-grams once. Its scores are
pycocoevalcap's `CiderScorer.compute_cider` on that corpus's references (tests/test_cider.py checks it to 1e-6),
quirks included: the document count is the corpus's number of images, and the length that the Gaussian penalty
compares is a caption's number of bigrams.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

N, SIGMA = 4, 6.0  # n-grams of 1 to 4 words; the length penalty's width

Words = Sequence[str]
Vector = tuple[list[dict[tuple[str, ...], float]], list[float], int]  # tf-idf per n, their norms, the length


def ngram_counts(words: Words) -> Counter:
    """How often each n-gram (n = 1..4, as a tuple of words) occurs in a caption."""
    return Counter(tuple(words[i : i + n]) for n in range(1, N + 1) for i in range(len(words) - n + 1))


class CiderD:
    """CIDEr-D of captions against the references of one image of a corpus.

    Args:
        references: for each image of the corpus, its references, each a list of words (`tokenize`).
    """

    def __init__(self, references: Sequence[Sequence[Words]]):
        if not references:
            raise ValueError("CIDEr-D needs a corpus of at least one image")
        counts = [[ngram_counts(reference) for reference in image] for image in references]
        frequency = Counter(ngram for image in counts for ngram in set().union(*image))  # images that have it
        self.log_images = math.log(len(references))
        self.idf = {ngram: self.log_images - math.log(df) for ngram, df in frequency.items()}
        self.references = [[self._vector(reference) for reference in image] for image in counts]

    def _vector(self, counts: Counter) -> Vector:
        vector: list[dict[tuple[str, ...], float]] = [{} for _ in range(N)]
        norms, length = [0.0] * N, 0
        for ngram, tf in counts.items():
            n = len(ngram) - 1
            weight = tf * self.idf.get(ngram, self.log_images)  # an n-gram no reference has: document frequency 0
            vector[n][ngram] = weight
            norms[n] += weight * weight
            if n == 1:  # pycocoevalcap's length: the bigrams
                length += tf
        return vector, [math.sqrt(norm) for norm in norms], length

    def __call__(self, words: Words, image: int) -> float:
        """The CIDEr-D of a caption (its words) against the references of image `image` of the corpus."""
        vector, norms, length = self._vector(ngram_counts(words))
        total = 0.0
        for reference, reference_norms, reference_length in self.references[image]:
            penalty = math.exp(-((length - reference_length) ** 2) / (2 * SIGMA**2))
            for n in range(N):
                overlap = sum(
                    min(weight, reference[n].get(ngram, 0.0)) * reference[n].get(ngram, 0.0)
                    for ngram, weight in vector[n].items()
                )
                if norms[n] and reference_norms[n]:
                    overlap /= norms[n] * reference_norms[n]
                total += overlap * penalty
        return 10.0 * total / N / len(self.references[image])
