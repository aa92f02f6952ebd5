import pytest

from captioner.metrics import bleu


def test_bleu_exact_match_and_nltk_agreement():
    refs = [[["a", "red", "circle", "on", "the", "left"], ["one", "shape", "a", "red", "circle"]]]
    assert bleu([["a", "red", "circle", "on", "the", "left"]], refs) == pytest.approx(1.0)
    assert bleu([["a", "blue", "square", "on", "the", "left"]], refs) < 0.6
    with pytest.raises(ValueError):
        bleu([["a"]], [])
