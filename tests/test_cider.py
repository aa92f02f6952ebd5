"""CIDEr-D (captioner.cider): the self-critical reward and the split's score, against pycocoevalcap's, with the same
document frequencies and references."""

import random

import pytest
from pycocoevalcap.cider.cider_scorer import CiderScorer

from captioner.cider import CiderD
from captioner.data.shapes import ShapesDataset
from captioner.data.vocab import tokenize


def pycocoevalcap_scores(captions: list[list[str]], references: list[list[list[str]]]) -> list[float]:
    """pycocoevalcap's per-caption CIDEr-D, its document frequencies taken from these references."""
    scorer = CiderScorer(n=4, sigma=6.0)
    for caption, image_references in zip(captions, references, strict=True):
        scorer += (" ".join(caption), [" ".join(reference) for reference in image_references])
    scorer.compute_doc_freq()
    return scorer.compute_cider()


def test_cider_d_equals_pycocoevalcap_with_the_same_document_frequencies():
    split = ShapesDataset("val", 60)
    references = [[tokenize(caption) for caption in split.captions(i)] for i in range(len(split))]
    rng = random.Random(0)
    captions = []
    for i, image_references in enumerate(references):  # exact, shortened, shuffled, another image's, empty
        caption = list(rng.choice(image_references))
        kind = i % 5
        if kind == 1:
            caption = caption[: rng.randrange(1, len(caption))]
        elif kind == 2:
            rng.shuffle(caption)
        elif kind == 3:
            caption = list(references[(i + 1) % len(references)][0])
        elif kind == 4:
            caption = []
        captions.append(caption)
    expected = pycocoevalcap_scores(captions, references)
    scorer = CiderD(references)
    got = [scorer(caption, i) for i, caption in enumerate(captions)]
    assert got == pytest.approx(expected, abs=1e-6)
    assert max(got) > 3 and min(got) == 0.0  # the cases differ: the check is not of zeros


def test_document_frequencies_come_from_the_corpus_not_from_the_captions_scored():
    """Scoring one image alone with pycocoevalcap gives every n-gram the same idf; the corpus's df differ."""
    references = [[["a", "red", "circle"]], [["a", "blue", "square"]], [["a", "red", "square"]]]
    scorer = CiderD(references)
    assert scorer(["a", "red", "circle"], 0) == pytest.approx(
        pycocoevalcap_scores([["a", "red", "circle"]] * 3, references)[0]
    )
    alone = pycocoevalcap_scores([["a", "red", "circle"]], references[:1])[0]  # log(1) - log(1): every idf is 0
    assert alone == 0.0 and scorer(["a", "red", "circle"], 0) > 1


def test_the_split_s_cider_d_is_pycocoevalcap_s_corpus_score():
    """Validation's CIDEr-D (captioner.metrics.cider) is pycocoevalcap's `Cider` over the split, through CiderD."""
    from pycocoevalcap.cider.cider import Cider

    from captioner.metrics import cider

    split = ShapesDataset("val", 40)
    references = [[tokenize(caption) for caption in split.captions(i)] for i in range(len(split))]
    captions = [references[(i * 7) % len(references)][i % 5][: 3 + i % 6] for i in range(len(references))]
    gts = {i: [" ".join(r) for r in refs] for i, refs in enumerate(references)}
    expected = Cider().compute_score(gts, {i: [" ".join(c)] for i, c in enumerate(captions)})[0]
    assert cider(captions, references) == pytest.approx(expected, abs=1e-6) and expected > 0.1


def test_the_document_frequencies_are_kept_in_a_file_that_later_runs_read_and_a_damaged_one_is_counted_again(
    tmp_path, monkeypatch, caplog
):
    """`CiderD(references, cache_dir)` counts the corpus's document frequencies once and writes them to a file named
    by the references; a later one reads the file instead of counting (the same scores as counting, to the bit), other
    references get a file of their own, and an unreadable file is said in one warning and counted again."""
    import captioner.cider as cider

    split = ShapesDataset("val", 40)
    references = [[tokenize(caption) for caption in split.captions(i)] for i in range(len(split))]
    captions = [references[(i * 7) % 40][0][: 3 + i % 4] for i in range(40)]
    counted = CiderD(references)
    want = [counted(caption, i) for i, caption in enumerate(captions)]
    assert max(want) > 1 and len(counted.idf) > 0

    CiderD(references, cache_dir=tmp_path)
    (stored,) = tmp_path.glob("cider-n40-*.npz")

    def no_counting(_):
        raise AssertionError("counted again")

    with monkeypatch.context() as patch:
        patch.setattr(cider, "document_frequencies", no_counting)
        again = CiderD(references, cache_dir=tmp_path)
        assert again.idf == counted.idf
        assert [again(caption, i) for i, caption in enumerate(captions)] == want

    CiderD(references[:30], cache_dir=tmp_path)
    assert len(list(tmp_path.glob("cider-*.npz"))) == 2

    stored.write_bytes(stored.read_bytes()[:100])  # a torn file
    with caplog.at_level("WARNING", logger="captioner.cider"):
        recounted = CiderD(references, cache_dir=tmp_path)
    assert [recounted(caption, i) for i, caption in enumerate(captions)] == want
    assert (
        len(caplog.records) == 1
        and str(stored) in caplog.text
        and "counting the document frequencies again" in caplog.text
    )
    assert CiderD(references, cache_dir=tmp_path).idf == counted.idf  # rewritten whole


def test_a_folder_that_cannot_be_written_costs_one_warning_and_the_counting(tmp_path, caplog):
    references = [[["a", "red", "circle"]], [["a", "blue", "square"]], [["a", "red", "square"]]]
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the folder should be: nothing can be written under it
    with caplog.at_level("WARNING", logger="captioner.cider"):
        scorer = CiderD(references, cache_dir=blocked / "data")
    assert scorer.idf == CiderD(references).idf and scorer(["a", "red", "circle"], 0) > 1
    assert len(caplog.records) == 1 and "cannot be written" in caplog.text and str(blocked) in caplog.text
