"""Tokenization and the word <-> id mapping."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from functools import cache
from pathlib import Path

from captioner.errors import CaptionerError
from captioner.files import write_text_atomically


@cache
def _tokenizer():
    # Imported on first use: nltk takes about a second to import, and captioning images never tokenizes.
    from nltk.tokenize import RegexpTokenizer

    # Words and numbers, keeping inner apostrophes ("man's"); punctuation is dropped, as in the usual COCO
    # preprocessing. A RegexpTokenizer needs no downloaded nltk data (word_tokenize needs punkt).
    return RegexpTokenizer(r"[a-z0-9]+(?:'[a-z]+)*")


def tokenize(text: str) -> list[str]:
    """Lowercase and split a caption into words: "A red Circle, left." -> ["a", "red", "circle", "left"]."""
    return _tokenizer().tokenize(text.lower())


class Vocabulary:
    """Maps words to ids. Ids 0-3 are the special tokens <pad> <start> <end> <unk>; words follow by frequency."""

    PAD, START, END, UNK = "<pad>", "<start>", "<end>", "<unk>"
    SPECIALS = (PAD, START, END, UNK)

    def __init__(self, words: Iterable[str]):
        """Build from the ordered word list; the special tokens are put first if they are not already there."""
        words = [w for w in words if w not in self.SPECIALS]
        self.itos: list[str] = [*self.SPECIALS, *words]
        self.stoi: dict[str, int] = {w: i for i, w in enumerate(self.itos)}
        if len(self.stoi) != len(self.itos):
            raise CaptionerError("vocabulary has duplicate words")

    pad_index, start_index, end_index, unk_index = 0, 1, 2, 3

    @classmethod
    def build(cls, captions: Iterable[str], min_freq: int = 1, max_size: int | None = None) -> Vocabulary:
        """Count the words of `captions`; keep those seen at least `min_freq` times, at most `max_size` ids in all.

        Ties in frequency are broken alphabetically, so the same captions always give the same vocabulary.
        """
        counts = Counter(word for caption in captions for word in tokenize(caption))
        words = sorted((w for w, n in counts.items() if n >= min_freq), key=lambda w: (-counts[w], w))
        if max_size is not None:
            words = words[: max(0, max_size - len(cls.SPECIALS))]
        return cls(words)

    def __len__(self) -> int:
        return len(self.itos)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocabulary) and self.itos == other.itos

    def __repr__(self) -> str:
        return f"Vocabulary({len(self)} tokens)"

    def encode(self, caption: str | Sequence[str]) -> list[int]:
        """Caption text (or its tokens) -> [<start>, w1, ..., wn, <end>]; unknown words map to <unk>."""
        words = tokenize(caption) if isinstance(caption, str) else caption
        return [self.start_index, *(self.stoi.get(w, self.unk_index) for w in words), self.end_index]

    def decode_tokens(self, ids: Iterable[int]) -> list[str]:
        """Ids -> words, stopping at <end> and skipping <pad>/<start>."""
        words = []
        for i in ids:
            i = int(i)
            if i == self.end_index:
                break
            if i not in (self.pad_index, self.start_index):
                words.append(self.itos[i])
        return words

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(self.decode_tokens(ids))

    def to_list(self) -> list[str]:
        return list(self.itos)

    def save(self, path: str | Path) -> None:
        write_text_atomically(path, json.dumps({"itos": self.itos}, indent=0))

    @classmethod
    def load(cls, path: str | Path) -> Vocabulary:
        try:
            itos = json.loads(Path(path).read_text())["itos"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CaptionerError(f"{path}: not a vocabulary file ({err})") from None
        if list(itos[: len(cls.SPECIALS)]) != list(cls.SPECIALS):
            raise CaptionerError(f"{path}: vocabulary does not start with {' '.join(cls.SPECIALS)}")
        return cls(itos)
