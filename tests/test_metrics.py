"""The corpus metrics against scores computed by hand."""

import math

import pytest

from captioner.metrics import bleu, cider


def test_bleu_is_the_geometric_mean_of_clipped_precisions_times_the_brevity_penalty_by_hand():
    """Hypothesis "a red circle left of a square" (7 words) against "a red circle left of a blue square" (8): every
    unigram matches (7/7), 5 of 6 bigrams, 4 of 5 trigrams and 3 of 4 four-grams; the brevity penalty is
    exp(1 - 8/7). So BLEU-4 = exp(-1/7) (1 * 5/6 * 4/5 * 3/4)^(1/4) = exp(-1/7) 0.5^(1/4)."""
    hypothesis = "a red circle left of a square".split()
    reference = "a red circle left of a blue square".split()
    assert bleu([hypothesis], [[reference]]) == pytest.approx(math.exp(-1 / 7) * 0.5**0.25, rel=1e-9)
    assert bleu([reference], [[reference]]) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        bleu([["a"]], [])


def test_cider_d_of_a_two_image_corpus_by_hand():
    """References "a red circle" (image 1) and "a blue square" (image 2). Document frequencies come from the
    references: "a" is in both images, so its idf log(2/2) is 0; every other n-gram's is log(2/1) = l.

    Image 1, "a red circle": its tf-idf vectors equal the reference's, cosine 1 for n = 1, 2, 3 and no 4-gram:
    10 * (1 + 1 + 1 + 0) / 4 = 7.5.
    Image 2, "a blue circle" against "a blue square": unigrams (0, l, l) . (0, l, 0) / (sqrt(2) l)^2 = 1/2, bigrams
    "a blue" of two each, 1/2, trigrams 0: 10 * (1/2 + 1/2) / 4 = 2.5. Equal lengths, so no length penalty.
    The corpus score is their mean, 5.0."""
    hypotheses = [["a", "red", "circle"], ["a", "blue", "circle"]]
    references = [[["a", "red", "circle"]], [["a", "blue", "square"]]]
    assert cider(hypotheses, references) == pytest.approx(5.0, rel=1e-9)
    assert cider([], []) == 0.0


def test_how_peaked_attention_is_a_word_s_share_in_its_strongest_tenth_and_its_entropy_over_uniform_s():
    import torch

    from captioner.metrics import peakedness

    uniform, spot, zeros = torch.full((49,), 1 / 49), torch.zeros(49), torch.zeros(49)
    spot[7] = 1.0
    two = torch.zeros(196)
    two[:40] = 1 / 40  # 20 of its 40 cells are the strongest tenth of 196
    top, entropy = peakedness(torch.stack([uniform, spot, zeros]))
    assert top.tolist() == pytest.approx([5 / 49, 1.0, 0.0]) and entropy.tolist() == pytest.approx([1.0, 0.0, 0.0])
    top, entropy = peakedness(two.view(1, 1, 196))  # any leading dimensions: (B,T,P) -> (B,T)
    assert top.shape == entropy.shape == (1, 1)
    assert top.item() == pytest.approx(0.5) and entropy.item() == pytest.approx(math.log(40) / math.log(196))


def test_the_split_s_peakedness_is_over_all_words_and_over_content_words():
    """A caption's function words ("a", "on", "the", FUNCTION_WORDS) are left out of the content-word figures."""
    from captioner.metrics import Decoded, peakedness_scores

    words = ["a", "red", "circle", "on", "the", "grass"]
    peaks, entropies = [0.1, 0.6, 0.8, 0.1, 0.1, 0.5], [1.0, 0.4, 0.2, 1.0, 1.0, 0.6]
    shifts = [0.0, 0.3, 0.7, 0.1, 0.0, 0.5]
    decoded = [Decoded(0, words, [], [], [], [], peaks, entropies, shifts), Decoded(1, [], [], [], [], [], [], [], [])]
    scores = peakedness_scores(decoded)
    assert scores["attn_top_tenth"] == pytest.approx(sum(peaks) / 6)
    assert scores["attn_entropy"] == pytest.approx(sum(entropies) / 6)
    assert scores["attn_shift"] == pytest.approx(sum(shifts) / 6)
    assert scores["attn_top_tenth_content"] == pytest.approx((0.6 + 0.8 + 0.5) / 3)
    assert scores["attn_entropy_content"] == pytest.approx((0.4 + 0.2 + 0.6) / 3)
    assert scores["attn_shift_content"] == pytest.approx((0.3 + 0.7 + 0.5) / 3)
    function_words = Decoded(0, ["a", "the"], [], [], [], [], [0.1, 0.1], [1.0, 1.0], [0.2, 0.2])
    assert peakedness_scores([function_words]).keys() == {"attn_top_tenth", "attn_entropy", "attn_shift"}
    assert peakedness_scores(decoded[1:]) == {}


def test_a_word_s_attention_shift_is_half_its_l1_distance_from_its_caption_s_average():
    """Caption 0, two words on disjoint cells: the average is (1/2, 1/2, 0, 0), each word 1/2 away. Caption 1, three
    words on one cell (peaked, but the same map for every word): 0. Caption 2, one word: 0. Steps after the words
    (the <end> step's own attention, padding) count in nothing and give 0."""
    import torch

    from captioner.metrics import attention_shift

    alphas = torch.zeros(3, 4, 4)
    alphas[0, 0, 0] = alphas[0, 1, 1] = 1.0
    alphas[0, 2] = torch.tensor([0.0, 0.0, 0.0, 1.0])  # the <end> step: not a word
    alphas[1, :3, 2] = 1.0
    alphas[2, 0] = torch.tensor([0.25, 0.25, 0.25, 0.25])
    shift = attention_shift(alphas, torch.tensor([2, 3, 1]))
    assert shift.flatten().tolist() == pytest.approx([0.5, 0.5, 0.0, 0.0] + [0.0] * 8)
    alphas[1, 1] = torch.tensor([0.5, 0.0, 0.5, 0.0])  # words 1/1, 1/2, 1 on cell 2: average (1/6, 0, 5/6, 0)
    assert attention_shift(alphas, torch.tensor([2, 3, 1]))[1, :3].tolist() == pytest.approx([1 / 6, 1 / 3, 1 / 6])


def test_a_batch_without_object_boxes_copies_from_the_device_only_each_word_s_peakedness(monkeypatch):
    """Validation scores attention correctness only on datasets with object boxes (shapes): for the others (COCO,
    Flickr, UCM) it copies no attention weights from the device, only the two peakedness figures of each step, computed
    there (`peakedness`), which each caption keeps for its words."""
    from types import SimpleNamespace

    import torch

    import captioner.metrics as metrics
    from captioner.data.vocab import Vocabulary
    from captioner.metrics import decode_batch

    class OnTheDevice:
        def __getattr__(self, name: str):
            raise AssertionError(f"alphas.{name}: the attention weights were read")

    alphas = OnTheDevice()

    def per_step(weights):
        assert weights is alphas
        return torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8]]), torch.full((2, 4), 0.9)

    def shift(weights, counts):
        assert weights is alphas and counts.tolist() == [3, 2]  # each caption's words: the tokens before <end>
        return torch.full((2, 4), 0.25)

    monkeypatch.setattr(metrics, "peakedness", per_step)
    monkeypatch.setattr(metrics, "attention_shift", shift)
    vocab = Vocabulary(["a", "red", "circle"])
    generation = SimpleNamespace(tokens=torch.tensor([[4, 5, 6, 2], [4, 6, 2, 0]]), alphas=alphas)
    batch = {"index": torch.tensor([3, 7]), "objects": [None, None], "canvas": [None, None]}
    batch["references"] = [[["a", "red", "circle"]], [["a", "circle"]]]
    decoded = decode_batch(batch, generation, vocab, (7, 7))
    assert [d.index for d in decoded] == [3, 7] and all(d.masses == [] for d in decoded)
    assert [d.words for d in decoded] == [["a", "red", "circle"], ["a", "circle"]]
    assert [len(d.peaks) for d in decoded] == [len(d.entropies) for d in decoded] == [3, 2]  # the words' steps
    assert [*decoded[0].peaks, *decoded[1].peaks] == pytest.approx([0.1, 0.2, 0.3, 0.5, 0.6])
    assert [*decoded[0].entropies, *decoded[1].entropies] == pytest.approx([0.9] * 5)
    assert [*decoded[0].shifts, *decoded[1].shifts] == pytest.approx([0.25] * 5)
