"""The searches' host loop on ONNX Runtime. Every choice is inside the exported graphs
(`captioner.onnx_export.GreedyWordsGraph`, `BeamWordsGraph`): the torch searches' own word functions
(`captioner.models.decoding._greedy_words`, `captioner.models.beam_search._beam_words`), `words` words a call, with
the top-k, the length penalty, the reorder by parent and each image's winner (the best finished hypothesis, else the
best unfinished one). What the host does, and why it cannot be a graph, is `captioner.models.search_host`'s, which the
torch searches on a CPU use too: it stops (whether every image has finished is read once a call, and a graph cannot
end a loop it does not hold); it lets images that have finished leave the batch (a gather of their rows, at most once
a call), so the graphs' work shrinks as the torch searches' does on a CPU; and it follows the back-pointers once at
the end (a caption's length is known only then).

The state passes from one call to the next as OrtValues, through numpy only when images leave the batch (their rows
gathered); the annotations and keys become OrtValues on the provider's device once per batch, and again only when
images leave (`Words`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from ..models.search_host import BeamRecord, GreedyRecord
from .layout import STATE


class SearchError(ValueError):
    """A search option out of range (a beam wider than the vocabulary, no words at all)."""


@dataclass
class SearchOutput:
    """Each image's caption: its word ids (<end> included when it ended), its score (the sum of its words'
    log-probabilities) and each word's attention (len(ids), P), float32."""

    ids: list[list[int]]
    scores: list[float]
    alphas: list[np.ndarray]

    @classmethod
    def of(cls, ids: np.ndarray, lengths: np.ndarray, scores: np.ndarray, alphas: np.ndarray) -> SearchOutput:
        """From a record's arrays (`GreedyRecord.arrays`, `BeamRecord.arrays`)."""
        kept = range(len(lengths))
        return cls([ids[b, : lengths[b]].tolist() for b in kept], [float(s) for s in scores],
                   [alphas[b, : lengths[b]] for b in kept])  # fmt: skip


class Words:
    """A word graph's session for one batch: the inputs that stay fixed become OrtValues once (`bind`), on `device`
    ("cpu" or "cuda"), and each call's state is the last call's outputs, OrtValues as ONNX Runtime returned them
    (`run_with_ort_values`), never numpy arrays. Each call's outputs are new: a state is never overwritten by the call
    that reads it (ONNX Runtime 1.20's IOBinding wrote a call's outputs over the last call's; tests/test_onnx.py
    checks that they outlive the next call)."""

    def __init__(self, session: ort.InferenceSession, device: str, fixed: dict[str, np.ndarray]):
        self.session, self.device = session, device
        self.outputs = [output.name for output in session.get_outputs()]
        self.fixed: dict[str, ort.OrtValue] = {}
        self.bind(fixed)

    def value(self, array: np.ndarray) -> ort.OrtValue:
        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), self.device, 0)

    def bind(self, fixed: dict[str, np.ndarray]) -> None:
        """Inputs that every call reads, as OrtValues: the annotations and keys (again when images leave the batch)
        and the length penalty."""
        self.fixed.update({name: self.value(array) for name, array in fixed.items()})

    def __call__(self, state: dict[str, ort.OrtValue]) -> dict[str, ort.OrtValue]:
        out = self.session.run_with_ort_values(self.outputs, {**self.fixed, **state})
        return dict(zip(self.outputs, out, strict=True))

    def next_state(self, out: dict[str, ort.OrtValue], keep: np.ndarray | None = None) -> dict[str, ort.OrtValue]:
        """The state for the next call: the outputs as they are, or, when images leave, the rows `keep` of each."""
        if keep is None:
            return {name: out[name + "_out"] for name in STATE}
        return {name: self.value(out[name + "_out"].numpy()[keep]) for name in STATE}


def greedy_search(
    words: Words, annotations: np.ndarray, keys: np.ndarray, h: np.ndarray, c: np.ndarray, start: int, n: int,
    pad: int = 0, max_len: int = 30,
) -> SearchOutput:  # fmt: skip
    """The most probable word at each step, `n` words a call, until every caption has ended or has `max_len` words;
    a caption that has ended leaves the batch at the end of its call (`GreedyRecord`)."""
    if max_len < 1:
        raise SearchError(f"max_len must be >= 1, got {max_len}")
    B, P = annotations.shape[:2]
    state = {"tokens": np.full(B, start, np.int64), "h": h, "c": c, "scores": np.zeros(B, np.float32),
             "lengths": np.zeros(B, np.int64), "finished": np.zeros(B, bool)}  # fmt: skip
    state = {name: words.value(x) for name, x in state.items()}
    record = GreedyRecord(B, P, max_len, pad)
    while True:
        out = words(state)
        m = record.room(n)
        record.write(*(out[name].numpy()[:, :m] for name in ("words", "alphas")),
                     *(out[name].numpy()[:, m - 1] for name in ("word_scores", "word_lengths")))  # fmt: skip
        finished = out["finished_out"].numpy()
        if record.over(finished):
            return SearchOutput.of(*record.arrays())
        keep = record.leave(finished)
        if keep is not None:
            annotations, keys = annotations[keep], keys[keep]
            words.bind({"annotations": annotations, "keys": keys})
        state = words.next_state(out, keep)


def beam_search(
    words: Words, annotations: np.ndarray, keys: np.ndarray, h: np.ndarray, c: np.ndarray, start: int, n: int,
    vocab_size: int, pad: int = 0, beam_size: int = 3, max_len: int = 30, length_penalty: float = 1.0,
) -> SearchOutput:  # fmt: skip
    """Beam search over all images and beams at once, `n` words a call, until each image's K hypotheses have all
    finished or have `max_len` words. Before the first word each image has one hypothesis, <start>: it is the first
    of K whose other K - 1 score -inf, so no word extends them. An image whose K hypotheses have finished leaves the
    batch at the end of its call, with its winner; each caption is read back along the parents (`BeamRecord`)."""
    K = beam_size
    if K < 1 or max_len < 1:
        raise SearchError(f"beam_size and max_len must be >= 1, got {K} and {max_len}")
    if vocab_size - 2 < K:  # never <pad> or <start> (`captioner.models.beam_search.check_beam_size`)
        raise SearchError(
            f"beam size {K} is larger than the {vocab_size - 2} words this vocabulary can generate (of {vocab_size})"
        )
    B, P = annotations.shape[:2]
    first = np.where(np.arange(K) == 0, np.float32(0), np.float32(-np.inf))
    state = {"tokens": np.full((B, K), start, np.int64), "h": np.repeat(h[:, None], K, 1),
             "c": np.repeat(c[:, None], K, 1),
             "scores": np.tile(first, (B, 1)), "lengths": np.zeros((B, K), np.int64),
             "finished": np.zeros((B, K), bool)}  # fmt: skip
    state = {name: words.value(x) for name, x in state.items()}
    words.bind({"length_penalty": np.array(length_penalty, np.float32)})
    record = BeamRecord(B, K, P, max_len, pad)
    while True:
        out = words(state)
        m = record.room(n)
        record.write(*(out[name].numpy()[:m] for name in ("words", "parents", "alphas")))
        best = tuple(out[name].numpy()[m - 1] for name in ("winner", "winner_score", "winner_length"))  # (A,) each
        done = out["finished_out"].numpy().all(axis=1)  # (A,)
        if record.over(done):
            record.finish(*best)
            return SearchOutput.of(*record.arrays())
        keep = record.leave(done, *best)
        if keep is not None:
            annotations, keys = annotations[keep], keys[keep]
            words.bind({"annotations": annotations, "keys": keys})
        state = words.next_state(out, keep)
