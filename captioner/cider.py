"""CIDEr-D (Vedantam et al. 2015) as a reward: the self-critical objective scores every sampled caption of a batch.

pycocoevalcap's `Cider` computes document frequencies from the references it is given, which is right for a test
split and wrong for a batch of 64 images. `CiderD` takes them once from a whole corpus (the training split), and makes
an image's reference vectors when a caption is first scored against them and keeps them, so that scoring a caption
costs counting its n-grams once. Its scores are pycocoevalcap's `CiderScorer.compute_cider` on that corpus's references
(tests/test_cider.py checks it to 1e-6), quirks included: the document count is the corpus's number of images, and the
length that the Gaussian penalty compares is a caption's number of bigrams.

At COCO's size (566k training references) the document frequencies take about 20 s to count: `CiderD(references,
cache_dir=...)` keeps them in a file named by a hash of the references, which later runs, and the other processes of
a DDP run, read instead.
"""

from __future__ import annotations

import functools
import hashlib
import io
import logging
import math
import zipfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from captioner.files import build_lock, replace_atomically

N, SIGMA = 4, 6.0  # n-grams of 1 to 4 words; the length penalty's width

log = logging.getLogger(__name__)

Words = Sequence[str]
Vector = tuple[list[dict[str, float]], list[float], int]  # tf-idf per n, their norms, the length


def ngram_counts(words: Words) -> Counter:
    """How often each n-gram (n = 1..4; its words joined by spaces, which no token holds) occurs in a caption."""
    return Counter(" ".join(words[i : i + n]) for n in range(1, N + 1) for i in range(len(words) - n + 1))


def document_frequencies(references: Sequence[Sequence[Words]]) -> Counter:
    """For each n-gram in the references of at least two images, in how many images' references it occurs. An
    n-gram of one image's references has the weight of one of none (log(images) - log(1)), so it is left out."""
    frequency: Counter = Counter()
    for image in references:
        frequency.update(set().union(*(ngram_counts(reference) for reference in image)))
    return Counter({ngram: df for ngram, df in frequency.items() if df > 1})


class CiderD:
    """CIDEr-D of captions against the references of one image of a corpus.

    Args:
        references: for each image of the corpus, its references, each a list of words (`tokenize`).
        cache_dir: where to keep the corpus's document frequencies (`cider-<hash>.npz`), for later runs and the
            other processes of a run; None: count them here.
    """

    def __init__(self, references: Sequence[Sequence[Words]], cache_dir: str | Path | None = None):
        if not references:
            raise ValueError("CIDEr-D needs a corpus of at least one image")
        self.corpus = references
        self.log_images = math.log(len(references))
        frequency = document_frequencies(references) if cache_dir is None else self._cached(Path(cache_dir))
        self.idf = {ngram: self.log_images - math.log(df) for ngram, df in frequency.items()}
        # image -> its reference vectors, made at its first score and kept: the first epoch makes them as it goes
        self.references = functools.cache(self._reference_vectors)

    def _cached(self, folder: Path) -> Counter:
        """The corpus's document frequencies from its file in `folder`, counted and written first if it is missing
        or unreadable (one process at a time: the others wait, then read it). A folder that cannot be written costs
        one warning, and the counting in every run."""
        digest = hashlib.sha256()
        for image in self.corpus:
            digest.update("\n".join(" ".join(reference) for reference in image).encode() + b"\x1e")
        path = folder / f"cider-n{len(self.corpus)}-{digest.hexdigest()[:16]}.npz"
        frequency = None
        try:
            with build_lock(path):
                if path.exists():
                    try:
                        return self._read(path)
                    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:  # torn, or not ours
                        log.warning("%s: unreadable (%s); counting the document frequencies again", path, err)
                frequency = document_frequencies(self.corpus)
                blob = np.frombuffer("\n".join(frequency).encode(), dtype=np.uint8)
                counts = np.fromiter(frequency.values(), dtype=np.int64, count=len(frequency))
                buffer = io.BytesIO()
                np.savez(buffer, ngrams=blob, counts=counts)
                replace_atomically(path, lambda file: file.write(buffer.getvalue()))
        except OSError as err:  # the lock or the file cannot be written
            log.warning("%s: cannot be written (%s); CIDEr-D's document frequencies are counted in each run", path, err)
        return frequency if frequency is not None else document_frequencies(self.corpus)

    @staticmethod
    def _read(path: Path) -> Counter:
        with np.load(path) as stored:
            ngrams = stored["ngrams"].tobytes().decode().split("\n") if stored["counts"].size else []
            counts = stored["counts"].tolist()
        if len(ngrams) != len(counts):
            raise ValueError(f"{len(ngrams)} n-grams but {len(counts)} counts")
        return Counter(dict(zip(ngrams, counts, strict=True)))

    def _vector(self, counts: Counter) -> Vector:
        vector: list[dict[str, float]] = [{} for _ in range(N)]
        norms, length = [0.0] * N, 0
        for ngram, tf in counts.items():
            n = ngram.count(" ")
            weight = tf * self.idf.get(ngram, self.log_images)  # in one image's references, or none: df 1
            vector[n][ngram] = weight
            norms[n] += weight * weight
            if n == 1:  # pycocoevalcap's length: the bigrams
                length += tf
        return vector, [math.sqrt(norm) for norm in norms], length

    def _reference_vectors(self, image: int) -> list[Vector]:
        return [self._vector(ngram_counts(reference)) for reference in self.corpus[image]]

    def __call__(self, words: Words, image: int) -> float:
        """The CIDEr-D of a caption (its words) against the references of image `image` of the corpus."""
        vector, norms, length = self._vector(ngram_counts(words))
        references = self.references(image)
        total = 0.0
        for reference, reference_norms, reference_length in references:
            penalty = math.exp(-((length - reference_length) ** 2) / (2 * SIGMA**2))
            for n in range(N):
                overlap = sum(
                    min(weight, reference[n].get(ngram, 0.0)) * reference[n].get(ngram, 0.0)
                    for ngram, weight in vector[n].items()
                )
                if norms[n] and reference_norms[n]:
                    overlap /= norms[n] * reference_norms[n]
                total += overlap * penalty
        return 10.0 * total / N / len(references)
