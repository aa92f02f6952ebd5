import pytest

from captioner.data.vocab import Vocabulary, tokenize
from captioner.errors import CaptionerError


def test_tokenize_lowercases_and_drops_punctuation():
    assert tokenize("A Man's red Circle, left-of: the SQUARE.") == [
        "a",
        "man's",
        "red",
        "circle",
        "left",
        "of",
        "the",
        "square",
    ]


def test_build_counts_thresholds_and_caps():
    captions = ["a red circle", "a blue circle", "a red square", "zebra"]
    vocab = Vocabulary.build(captions, min_freq=2)
    assert vocab.itos == ["<pad>", "<start>", "<end>", "<unk>", "a", "circle", "red"]
    assert len(Vocabulary.build(captions, max_size=6)) == 6


def test_encode_decode():
    vocab = Vocabulary.build(["a red circle"])
    ids = vocab.encode("A red triangle")
    assert ids == [1, vocab.stoi["a"], vocab.stoi["red"], Vocabulary.unk_index, 2]
    assert vocab.decode(ids + [0, 0]) == "a red <unk>"
    assert vocab.decode([vocab.stoi["red"], 2, vocab.stoi["a"]]) == "red"  # stops at <end>


def test_save_load_round_trip(tmp_path):
    vocab = Vocabulary.build(["a red circle", "two blue squares"])
    vocab.save(tmp_path / "vocab.json")
    assert Vocabulary.load(tmp_path / "vocab.json") == vocab


def test_load_rejects_a_foreign_file(tmp_path):
    (tmp_path / "x.json").write_text('{"words": []}')
    with pytest.raises(CaptionerError, match=r"x\.json: not a vocabulary file"):
        Vocabulary.load(tmp_path / "x.json")
