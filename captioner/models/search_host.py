"""The host's part of a search, written once for every loop that runs a search's words a call at a time and reads
what has finished after each: the torch searches on a CPU (`captioner.models.decoding.greedy_search`,
`captioner.models.beam_search.beam_search`: one word a call) and the ONNX Runtime loop (`captioner.onnx.search`: the
exported graphs' words). A JavaScript host translates this file. What a search chooses (its words, the top-k, the
length penalty, each image's winner) is not here: it is the torch searches' word functions, which the exported graphs
are. What is here is what only a host can do, since it ends a loop or changes the batch's size:

- the record: each word written as it comes, for the captions (greedy) or images (beam) still in the batch;
- finishing: whether the search is over (every caption or image has finished, or `max_len` words are written);
- leaving: captions or images that have finished leave the batch, and the rows that stay are said (`keep`), for the
  loop to keep those of its state; an image that leaves keeps its winner;
- read-back: a beam search's captions followed along the back-pointers, from each image's winner to its first word.

numpy only: importing it imports neither torch nor ONNX Runtime.
"""

from __future__ import annotations

import numpy as np


class GreedyRecord:
    """A greedy search's captions: for each image, its words (ids, <end> included when it has ended), each word's
    attention (P cells), its score (the sum of its words' log-probabilities) and its length, written a call at a time
    for the captions still in the batch (`rows`), in the image order the search began with."""

    def __init__(self, images: int, cells: int, max_len: int, pad: int = 0):
        self.max_len, self.written = max_len, 0
        self.rows = np.arange(images, dtype=np.int64)  # the captions still being written
        self.ids = np.full((images, max_len), pad, np.int64)
        self.alphas = np.zeros((images, max_len, cells), np.float32)
        self.scores, self.lengths = np.zeros(images, np.float32), np.zeros(images, np.int64)

    def room(self, words: int) -> int:
        """How many of a call's `words` words are written: those within `max_len`."""
        return min(words, self.max_len - self.written)

    def write(self, ids: np.ndarray, alphas: np.ndarray, scores: np.ndarray, lengths: np.ndarray) -> None:
        """A call's words (A,m) and their attention (A,m,P), and each caption's score and length after them (A,), for
        the A captions still in the batch."""
        m = ids.shape[1]
        self.ids[self.rows, self.written : self.written + m] = ids
        self.alphas[self.rows, self.written : self.written + m] = alphas
        self.scores[self.rows], self.lengths[self.rows] = scores, lengths
        self.written += m

    def over(self, finished: np.ndarray) -> bool:
        """Whether the search ends here: every caption in the batch has finished (A,), or `max_len` words are
        written."""
        return self.written == self.max_len or bool(finished.all())

    def leave(self, finished: np.ndarray) -> np.ndarray | None:
        """The captions that have finished (A,) leave the batch: the rows that stay (a mask of the A), or None when
        none leaves."""
        if not finished.any():
            return None
        keep = ~finished
        self.rows = self.rows[keep]
        return keep

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Ids (B,T), lengths (B,), scores (B,) and attention (B,T,P), T the longest caption's length."""
        width = int(self.lengths.max(initial=0))
        return self.ids[:, :width], self.lengths, self.scores, self.alphas[:, :width]


class BeamRecord:
    """A beam search's record, for B images of K hypotheses each: per word, each hypothesis's word, its parent (the
    hypothesis it extends, 0 to K-1 within its image) and the attention that chose it, written a call at a time for the
    images still in the batch (`alive`); an image that has left goes on as <pad> hypotheses, each its own parent. Each
    image's winner (which of its K, its score and its length) is kept when it leaves or the search ends, and its
    caption read back along the parents (`arrays`)."""

    def __init__(self, images: int, beams: int, cells: int, max_len: int, pad: int = 0):
        self.max_len, self.written = max_len, 0
        self.alive = np.arange(images, dtype=np.int64)  # the images still searching
        self.ids = np.full((max_len, images, beams), pad, np.int64)
        self.parents = np.broadcast_to(np.arange(beams), (max_len, images, beams)).copy()
        self.alphas = np.zeros((max_len, images, beams, cells), np.float32)
        self.winner, self.scores, self.lengths = (np.zeros(images, t) for t in (np.int64, np.float32, np.int64))

    def room(self, words: int) -> int:
        """How many of a call's `words` words are written: those within `max_len`."""
        return min(words, self.max_len - self.written)

    def write(self, ids: np.ndarray, parents: np.ndarray, alphas: np.ndarray) -> None:
        """A call's m words for the A images still searching: each hypothesis's word (m,A,K), its parent within its
        image (m,A,K) and the attention that chose it (m,A,K,P)."""
        m = ids.shape[0]
        words = slice(self.written, self.written + m)
        self.ids[words, self.alive], self.parents[words, self.alive] = ids, parents
        self.alphas[words, self.alive] = alphas
        self.written += m

    def over(self, done: np.ndarray) -> bool:
        """Whether the search ends here: every image in the batch has done (A,), or `max_len` words are written."""
        return self.written == self.max_len or bool(done.all())

    def finish(self, winner: np.ndarray, score: np.ndarray, length: np.ndarray) -> None:
        """The search has ended: the winners (A,) of the images still searching."""
        self.winner[self.alive], self.scores[self.alive], self.lengths[self.alive] = winner, score, length

    def leave(self, done: np.ndarray, winner: np.ndarray, score: np.ndarray, length: np.ndarray) -> np.ndarray | None:
        """The images whose K hypotheses have all finished (`done`, (A,)) can no longer change: their winners (from
        `winner`, `score`, `length`, (A,) each) are final, and they leave the batch. The rows that stay (a mask of the
        A), or None when none leaves."""
        if not done.any():
            return None
        gone = self.alive[done]
        self.winner[gone], self.scores[gone], self.lengths[gone] = winner[done], score[done], length[done]
        keep = ~done
        self.alive = self.alive[keep]
        return keep

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Each image's winner read back along the parents, from its last word to its first: ids (B,T), lengths (B,),
        scores (B,) and attention (B,T,P), T the longest winner's length."""
        images, beam = np.arange(len(self.winner)), self.winner
        ids = np.empty((len(beam), self.written), np.int64)
        alphas = np.empty((len(beam), self.written, self.alphas.shape[-1]), np.float32)
        for step in reversed(range(self.written)):
            ids[:, step], alphas[:, step] = self.ids[step, images, beam], self.alphas[step, images, beam]
            beam = self.parents[step, images, beam]
        width = int(self.lengths.max(initial=0))
        return ids[:, :width], self.lengths, self.scores, alphas[:, :width]
