import pytest

from captioner.data.vocab import Vocabulary, detokenize, lost_characters, tokenize
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


@pytest.mark.parametrize(
    ("caption", "tokens"),
    [
        ("Un café crème, naïve.", ["un", "café", "crème", "naïve"]),
        ("CAFE\u0301 l\u2019eau", ["café", "l'eau"]),  # a combining accent and a typographic apostrophe
        ("Кошка спит на диване.", ["кошка", "спит", "на", "диване"]),
        ("Die Straße", ["die", "strasse"]),  # case folding
        ("一只猫在床上。", ["一", "只", "猫", "在", "床", "上"]),  # no spaces: one token a character
        ("猫がいる", ["猫", "が", "い", "る"]),
        ("नमस्ते दुनिया", ["नमस्ते", "दुनिया"]),  # combining vowel signs stay in their word
        ("two cats 😀 for 5 $", ["two", "cats", "for", "5"]),
    ],
)
def test_tokenize_keeps_the_words_of_every_script(caption, tokens):
    assert tokenize(caption) == tokens


def test_what_a_caption_loses_and_how_words_join_back():
    assert lost_characters("two cats 😀 for 5 $, no?") == {"😀", "$"}
    assert lost_characters("Un café crème, naïve.") == set()
    assert detokenize(["a", "red", "circle"]) == "a red circle"
    assert detokenize(["一", "只", "猫", "in", "a", "box", "里"]) == "一只猫 in a box 里"
    vocab = Vocabulary.build(["一只猫在床上", "un café"])
    assert "café" in vocab.stoi and "猫" in vocab.stoi
    assert vocab.decode(vocab.encode("一只猫")) == "一只猫"


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


def test_ascii_captions_take_a_faster_path_to_the_same_tokens_and_lost_symbols():
    """ASCII text is tokenized with Python's `re` (several times faster): the same words and dropped symbols as the
    Unicode patterns give, on every printable ASCII character alone and next to letters, and on random strings."""
    import random
    import string
    import unicodedata

    from captioner.data.vocab import _patterns, normalize

    def slow(text: str) -> tuple[list[str], set[str]]:
        text = unicodedata.normalize("NFC", unicodedata.normalize("NFC", text).casefold())
        return _patterns()[0].findall(text), set(_patterns()[2].findall(text))

    cases = [c for c in string.printable] + [f"a{c}b {c}x{c}" for c in string.printable]
    generator = random.Random(0)
    alphabet = string.ascii_letters + string.digits + string.punctuation + " '\t"
    cases += ["".join(generator.choices(alphabet, k=generator.randrange(1, 40))) for _ in range(3000)]
    cases += ["A man's dog -- isn't it? 3 o'clock, $5 <tag> a+b=c ~x^y `q` |z|", "''a''", "a'b'c d'", "'"]
    for text in cases:
        assert text.isascii() and (tokenize(text), lost_characters(text)) == slow(text), repr(text)
        assert normalize(text) == unicodedata.normalize("NFC", unicodedata.normalize("NFC", text).casefold())
