"""Tokenization and the word <-> id mapping."""

from __future__ import annotations

import json
import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from pathlib import Path

from captioner.errors import CaptionerError
from captioner.files import write_text_atomically

# Scripts written without spaces between words. Their text is split into characters (grapheme clusters), as Chinese
# and Japanese captions (COCO-CN, STAIR) are usually scored, and their tokens are joined back without spaces.
UNSPACED = r"\p{Han}\p{Hiragana}\p{Katakana}\p{Thai}\p{Lao}\p{Khmer}\p{Myanmar}"
_LETTER = rf"(?:(?![{UNSPACED}])[\p{{L}}\p{{M}}\p{{N}}])"  # a letter, mark or digit of any other script
# A word: letters, marks and digits, with inner apostrophes ("man's", "l'eau"); or one character of an unspaced script.
TOKEN = rf"(?=[{UNSPACED}])\X|{_LETTER}+(?:'{_LETTER}+)*"
TOKENIZER_VERSION = 2  # in the vocabulary's file name: 1 kept [a-z0-9] only
APOSTROPHES = str.maketrans({"\u2019": "'", "\u02bc": "'"})  # typographic ones count as "'"


@cache
def _patterns():
    # Imported on first use; `regex` knows Unicode scripts and grapheme clusters, `re` does not.
    import regex

    lost = r"[^\p{L}\p{M}\p{N}\p{P}\s]"  # what a caption loses besides punctuation and spaces: symbols, emoji
    return regex.compile(TOKEN), regex.compile(rf"^[{UNSPACED}]"), regex.compile(lost)


def normalize(text: str) -> str:
    """NFC and case folding: "Café" and "cafe\u0301" both give "café"; "Straße" gives "strasse"."""
    if text.isascii():  # NFC leaves ASCII as it is, and case folding is lowering there
        return text.lower()
    return unicodedata.normalize("NFC", unicodedata.normalize("NFC", text).casefold()).translate(APOSTROPHES)


# The same two patterns for ASCII text (most English captions), which Python's `re` runs several times faster: letters
# and digits with inner apostrophes, and the ASCII symbols (Unicode's S categories) that `tokenize` drops.
_ASCII_TOKEN = re.compile(r"[a-z0-9]+(?:'[a-z0-9]+)*")
_ASCII_LOST = re.compile(r"[$+<=>^`|~]")


def tokenize(text: str) -> list[str]:
    """A caption's words, in any script: normalised (`normalize`), then letters, marks and digits with inner
    apostrophes; punctuation and symbols are dropped, as in the usual COCO preprocessing, and text in an unspaced
    script (Chinese, Japanese, Thai, ...) is split into characters.

        "A red Circle, left." -> ["a", "red", "circle", "left"]
        "Un café crème."      -> ["un", "café", "crème"]
        "一只猫在床上"           -> ["一", "只", "猫", "在", "床", "上"]
    """
    text = normalize(text)
    return _ASCII_TOKEN.findall(text) if text.isascii() else _patterns()[0].findall(text)


def lost_characters(text: str) -> set[str]:
    """The characters that `tokenize` drops other than punctuation and spaces (symbols such as "$" or "°", emoji)."""
    return set(words_and_lost(text)[1])


def words_and_lost(text: str) -> tuple[list[str], set[str] | tuple[()]]:
    """`tokenize(text)` and `lost_characters(text)` (an empty tuple when nothing is lost), the text normalised once:
    what reading a split does for each of its captions (616k of them for COCO's training split)."""
    text = normalize(text)
    if text.isascii():
        words = _ASCII_TOKEN.findall(text)
        return words, set(_ASCII_LOST.findall(text)) if _ASCII_LOST.search(text) else ()
    token, _, lost = _patterns()
    return token.findall(text), set(lost.findall(text))


def detokenize(words: Sequence[str]) -> str:
    """Words -> text: joined by spaces, except between two characters of an unspaced script ("一只猫")."""
    unspaced = _patterns()[1]
    text = ""
    for previous, word in zip([None, *words], words, strict=False):
        joined = previous is not None and unspaced.match(previous) and unspaced.match(word)
        text += word if previous is None or joined else " " + word
    return text


def _words(caption: str | Sequence[str]) -> Sequence[str]:
    return tokenize(caption) if isinstance(caption, str) else caption


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
    def build(
        cls, captions: Iterable[str | Sequence[str]], min_freq: int = 1, max_size: int | None = None
    ) -> Vocabulary:
        """Count the words of `captions` (texts, or their tokens); keep those seen at least `min_freq` times, at most
        `max_size` ids in all.

        Ties in frequency are broken alphabetically, so the same captions always give the same vocabulary.
        """
        return cls.from_counts(Counter(word for caption in captions for word in _words(caption)), min_freq, max_size)

    @classmethod
    def from_counts(cls, counts: Mapping[str, int], min_freq: int = 1, max_size: int | None = None) -> Vocabulary:
        """The vocabulary of words counted `counts` times (`build`'s rule: at least `min_freq`, at most `max_size`
        ids, the most frequent first, ties alphabetical)."""
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
        get, unknown = self.stoi.get, self.unk_index
        return [self.start_index, *[get(w, unknown) for w in _words(caption)], self.end_index]

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
        return detokenize(self.decode_tokens(ids))

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
