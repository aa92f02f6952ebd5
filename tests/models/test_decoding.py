import math

import pytest
import torch
import torch.nn.functional as F

from captioner.models.beam_search import beam_search
from captioner.models.decoding import CHECK_EVERY, greedy_search
from tests.helpers import END, PAD, SPECIAL, START, A, B, C, TableDecoder, random_decoder

# Greedy takes A (0.55) and then can only end with 0.34: p = 0.187.
# Starting with B (0.45) ends with 0.9: p = 0.405, which a beam of 2 finds.
TRAP = {START: {A: 0.55, B: 0.45}, A: {END: 0.34, B: 0.33, C: 0.33}, B: {END: 0.9, C: 0.1}, C: {END: 1.0}}


def test_beam_finds_a_better_caption_than_greedy():
    decoder, annotations = TableDecoder(TRAP), torch.zeros(1, 4, 2)
    greedy = greedy_search(decoder, annotations, **SPECIAL)
    beam = beam_search(decoder, annotations, beam_size=2, **SPECIAL)
    assert greedy.tokens[0, :2].tolist() == [A, END]
    assert beam.tokens[0, :2].tolist() == [B, END]
    assert beam.scores[0].item() == pytest.approx(math.log(0.45 * 0.9), abs=1e-4)
    assert greedy.scores[0].item() == pytest.approx(math.log(0.55 * 0.34), abs=1e-4)


@pytest.mark.parametrize("beam_size", [1, 3])
def test_no_hypothesis_ends_returns_the_best_unfinished_one(beam_size):
    never_ends = {w: {A: 0.5, B: 0.3, C: 0.2} for w in (START, A, B, C)}
    generation = beam_search(TableDecoder(never_ends), torch.zeros(2, 4, 2), beam_size=beam_size, max_len=5, **SPECIAL)
    assert generation.tokens.tolist() == [[A] * 5, [A] * 5]
    assert generation.lengths.tolist() == [5, 5]
    assert generation.alphas.shape == (2, 5, 4)


# A weak model: every word is a gamble. Greedy search writes A B C and ends, p = 0.5 * 0.4 * 0.5 * 0.6 = 0.06, about
# 0.50 a word (geometric mean, <end> counted); ending after A has p = 0.5 * 0.35 = 0.175, more in all but 0.42 a word.
WEAK = {
    START: {A: 0.5, B: 0.25, C: 0.2, END: 0.05},
    A: {B: 0.4, END: 0.35, C: 0.25},
    B: {C: 0.5, END: 0.3, A: 0.2},
    C: {END: 0.6, A: 0.2, B: 0.2},
}


def test_on_a_weak_model_beam_search_ranked_per_word_does_not_cut_the_caption_short():
    """Ranked by raw log-probability, beam search prefers the one-word caption that greedy search passes by; ranked
    per word (the default), it writes the caption greedy does."""
    decoder, annotations = TableDecoder(WEAK), torch.zeros(1, 4, 2)
    greedy = greedy_search(decoder, annotations, max_len=10, **SPECIAL)
    raw = beam_search(decoder, annotations, beam_size=3, max_len=10, length_penalty=0.0, **SPECIAL)
    default = beam_search(decoder, annotations, beam_size=3, max_len=10, **SPECIAL)
    assert greedy.tokens[0].tolist() == [A, B, C, END]
    assert raw.tokens[0, : int(raw.lengths[0])].tolist() == [A, END]
    assert default.tokens[0].tolist() == [A, B, C, END]
    assert default.scores[0].item() == pytest.approx(math.log(0.06), abs=1e-5)  # the raw sum, as before


def test_beam_size_one_is_exactly_greedy():
    decoder, annotations = random_decoder(), torch.randn(5, 9, 16)
    with torch.inference_mode():
        greedy = greedy_search(decoder, annotations, max_len=12, **SPECIAL)
        beam = beam_search(decoder, annotations, beam_size=1, max_len=12, **SPECIAL)
    assert torch.equal(greedy.tokens, beam.tokens)
    assert torch.equal(greedy.lengths, beam.lengths)
    assert torch.allclose(greedy.scores, beam.scores, atol=1e-5)
    assert torch.allclose(greedy.alphas, beam.alphas, atol=1e-6)


def test_batched_beam_search_equals_one_image_at_a_time():
    decoder, annotations = random_decoder(), torch.randn(4, 9, 16)
    with torch.inference_mode():
        batched = beam_search(decoder, annotations, beam_size=3, max_len=12, length_penalty=0.7, **SPECIAL)
        for i in range(4):
            alone = beam_search(decoder, annotations[i : i + 1], beam_size=3, max_len=12, length_penalty=0.7, **SPECIAL)
            n = int(alone.lengths[0])
            assert int(batched.lengths[i]) == n
            assert torch.equal(batched.tokens[i, :n], alone.tokens[0, :n])
            assert torch.allclose(batched.scores[i], alone.scores[0], atol=1e-5)
            assert torch.allclose(batched.alphas[i, :n], alone.alphas[0, :n], atol=1e-6)


def test_generation_never_emits_pad_or_start_and_alphas_are_distributions():
    decoder, annotations = random_decoder(), torch.randn(3, 9, 16)
    with torch.inference_mode():
        out = beam_search(decoder, annotations, beam_size=4, max_len=8, **SPECIAL)
    for row, n in zip(out.tokens, out.lengths, strict=True):
        assert n >= 1 and PAD not in row[:n].tolist() and START not in row[:n].tolist()
        assert (row[n:] == PAD).all()
    real = torch.arange(out.tokens.size(1)).unsqueeze(0) < out.lengths.unsqueeze(1)  # (B,T)
    assert torch.allclose(out.alphas.sum(-1)[real], torch.ones(int(real.sum())), atol=1e-5)
    assert (out.alphas.sum(-1)[~real] == 0).all()


class RowCounter:
    """Wraps a decoder and records, per decoding step, the rows its attention ran and the rows the rest of the step
    (LSTM and output layer) ran, with the words fed to the latter."""

    def __init__(self, decoder):
        self.decoder, self.attended, self.rows, self.words = decoder, [], [], []

    def __getattr__(self, name):
        return getattr(self.decoder, name)

    def step(self, tokens, state, annotations, keys):
        self.attended.append(tokens.size(0))
        self.rows.append(tokens.size(0))
        self.words.append(tokens.tolist())
        return self.decoder.step(tokens, state, annotations, keys)

    def attend(self, h, annotations, keys):
        self.attended.append(h.size(0))
        return self.decoder.attend(h, annotations, keys)

    def update(self, tokens, context, state):
        self.rows.append(tokens.size(0))
        self.words.append(tokens.tolist())
        return self.decoder.update(tokens, context, state)


def test_greedy_runs_only_the_captions_still_being_written():
    decoder, annotations = random_decoder(), torch.randn(8, 9, 16)
    decoder.L_o.bias.data[END] += 1.0  # captions of mixed lengths
    counter = RowCounter(decoder)
    with torch.inference_mode():
        out = greedy_search(counter, annotations, max_len=12, **SPECIAL)
    assert len(set(out.lengths.tolist())) > 1
    assert counter.rows == [int((out.lengths > t).sum()) for t in range(out.tokens.size(1))]


class PerImageTableDecoder(TableDecoder):
    """Like TableDecoder, with one table per image; the image's number is stored in its annotations and passed on as
    the context of each of its rows."""

    def __init__(self, tables):
        self.tables = [TableDecoder(t).logits for t in tables]
        self.vocab_size = self.tables[0].size(1)

    def attend(self, h, annotations, keys):
        images = annotations[:, 0, :1].repeat_interleave(h.size(0) // annotations.size(0), dim=0)  # (N,1)
        P = annotations.size(1)
        return images, annotations.new_full((h.size(0), P), 1.0 / P)

    def update(self, tokens, context, state):
        images = context[:, 0].long().tolist()
        return torch.stack([self.tables[i][w] for i, w in zip(images, tokens.tolist(), strict=True)]), state


def test_beam_search_drops_an_image_once_all_its_hypotheses_have_ended():
    ends_soon = {START: {END: 0.9, A: 0.1}, A: {END: 1.0}}
    never_ends = {w: {A: 0.5, B: 0.3, C: 0.2} for w in (START, A, B, C)}
    annotations = torch.arange(2.0).view(2, 1, 1).expand(2, 4, 2)  # image i holds the number i
    counter = RowCounter(PerImageTableDecoder([ends_soon, never_ends]))
    out = beam_search(counter, annotations, beam_size=2, max_len=6, **SPECIAL)
    # Step 1: one <start> row per image. Step 2: two beams each, but image 0's first beam ended at step 1 and only
    # the attention runs it; both beams of image 0 have ended after step 2, so the image leaves.
    assert counter.attended == [2, 4, 2, 2, 2, 2]
    assert counter.rows == [2, 3, 2, 2, 2, 2]
    assert out.tokens[0].tolist() == [END] + [PAD] * 5 and out.lengths.tolist() == [1, 6]
    assert out.tokens[1].tolist() == [A] * 6
    assert out.scores[0].item() == pytest.approx(math.log(0.9), abs=1e-4)


def reference_beam_search(decoder, annotations, beam_size, max_len, length_penalty):
    """Beam search in plain Python, one image and one hypothesis at a time, every hypothesis through the whole step,
    ranked by log-probability / length**length_penalty. Returns (words, score) per image."""

    def rank(beam):
        return beam[1] / len(beam[0]) ** length_penalty

    results = []
    for image in annotations:
        memory = image.unsqueeze(0)
        keys = decoder.prepare(memory)
        beams = [([], 0.0, decoder.init_state(image.unsqueeze(0)))]  # words so far, log-probability, state
        for _ in range(max_len):
            candidates = []
            for words, score, state in beams:
                if words and words[-1] == END:  # finished: kept as it is
                    candidates.append((words, score, state))
                    continue
                previous = torch.tensor([words[-1] if words else START])
                logits, next_state, _ = decoder.step(previous, state, memory, keys)
                log_probs = F.log_softmax(logits[0], dim=-1).tolist()
                candidates += [
                    (words + [w], score + lp, next_state) for w, lp in enumerate(log_probs) if w not in (PAD, START)
                ]
            beams = sorted(candidates, key=rank, reverse=True)[:beam_size]
            if all(words[-1] == END for words, _, _ in beams):
                break
        finished = [beam for beam in beams if beam[0][-1] == END]
        words, score, _ = max(finished or beams, key=rank)
        results.append((words, score))
    return results


@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
@pytest.mark.parametrize("beam_size", [3, 5])
def test_batched_beam_search_matches_a_plain_reference_and_runs_no_ended_hypothesis(beam_size, length_penalty):
    decoder, annotations = random_decoder(), torch.randn(6, 9, 16)
    decoder.L_o.bias.data[END] += 1.0 + 0.5 * length_penalty  # hypotheses end at different steps, also in one image
    counter = RowCounter(decoder)
    with torch.inference_mode():
        out = beam_search(
            counter, annotations, beam_size=beam_size, max_len=10, length_penalty=length_penalty, **SPECIAL
        )
        expected = reference_beam_search(decoder, annotations, beam_size, 10, length_penalty)
    for i, (words, score) in enumerate(expected):
        assert out.tokens[i, : int(out.lengths[i])].tolist() == words
        assert out.scores[i].item() == pytest.approx(score, abs=1e-4)
    assert len({len(words) for words, _ in expected}) > 1
    # Some steps attended over ended hypotheses that the LSTM and output layer skipped; none was fed to them.
    assert any(rows < attended for rows, attended in zip(counter.rows, counter.attended, strict=True))
    assert not any(END in words or PAD in words for words in counter.words)


# Sync-free decoding (the default on CUDA): fixed shapes, "all ended" read every CHECK_EVERY words there (every word
# on a CPU). Same captions.


@pytest.mark.parametrize("table", [TRAP, WEAK], ids=["trap", "weak"])
@pytest.mark.parametrize("beam_size", [1, 2, 3])
@pytest.mark.parametrize("check_every", [1, CHECK_EVERY])  # a CPU's default, a GPU's
def test_sync_free_search_finds_the_same_captions_on_tables(table, beam_size, check_every):
    decoder, annotations = TableDecoder(table), torch.zeros(2, 4, 2)
    for length_penalty in (0.0, 1.0):
        options = {"max_len": 10, **SPECIAL}
        if beam_size == 1:
            want = greedy_search(decoder, annotations, sync_free=False, **options)
            got = greedy_search(decoder, annotations, sync_free=True, check_every=check_every, **options)
        else:
            options |= {"beam_size": beam_size, "length_penalty": length_penalty}
            want = beam_search(decoder, annotations, sync_free=False, **options)
            got = beam_search(decoder, annotations, sync_free=True, check_every=check_every, **options)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.lengths, want.lengths)
        assert torch.allclose(got.scores, want.scores, atol=1e-5)


@pytest.mark.parametrize("end_bias", [-1e4, 0.0, 1.5, 3.0])  # never ends, mixed lengths, short captions
@pytest.mark.parametrize("max_len", [5, 8, 13])  # below, at and past CHECK_EVERY
@pytest.mark.parametrize("check_every", [1, CHECK_EVERY])  # a CPU's default, a GPU's
def test_sync_free_search_equals_the_shrinking_search(end_bias, max_len, check_every):
    decoder, annotations = random_decoder(), torch.randn(7, 9, 16)
    decoder.L_o.bias.data[END] += end_bias
    with torch.inference_mode():
        for beam_size, length_penalty in ((1, 1.0), (3, 0.0), (3, 1.0), (5, 0.7)):
            options = {"beam_size": beam_size, "max_len": max_len, "length_penalty": length_penalty, **SPECIAL}
            search = beam_search if beam_size > 1 else greedy_search
            if beam_size == 1:
                options.pop("beam_size"), options.pop("length_penalty")
            want = search(decoder, annotations, sync_free=False, **options)
            got = search(decoder, annotations, sync_free=True, check_every=check_every, **options)
            assert torch.equal(got.tokens, want.tokens), (beam_size, length_penalty)
            assert torch.equal(got.lengths, want.lengths)
            assert torch.allclose(got.scores, want.scores, atol=1e-5)
            assert torch.allclose(got.alphas, want.alphas, atol=1e-6)


@pytest.mark.parametrize("check_every", [1, CHECK_EVERY])
def test_the_sync_free_search_shrinks_only_to_powers_of_two_and_finds_the_same_captions(check_every):
    """Sync-free, the batch keeps its size until the images still searching fit in half of it, then shrinks to the
    least power of two that holds them (ended images fill the rest): a compiled step meets a few fixed shapes. The
    captions, scores and attention are the shrinking search's."""
    decoder, annotations = random_decoder(), torch.randn(20, 9, 16)
    decoder.L_o.bias.data[END] += 1.3  # captions of 3 to 24 words
    with torch.inference_mode():
        options = {"beam_size": 3, "max_len": 24, "length_penalty": 1.0, **SPECIAL}
        want = beam_search(decoder, annotations, sync_free=False, **options)
        counter = RowCounter(decoder)
        got = beam_search(counter, annotations, sync_free=True, check_every=check_every, **options)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.lengths, want.lengths)
    assert torch.allclose(got.scores, want.scores, atol=1e-5) and torch.allclose(got.alphas, want.alphas, atol=1e-6)
    images = [rows // 3 for rows in counter.rows[1:]]  # after the first word: 3 hypotheses per image
    assert counter.rows[0] == 20 and images[0] == 20 and len(set(images)) > (2 if check_every == 1 else 1)  # shrank
    assert all(n == 20 or n & (n - 1) == 0 for n in images)  # 20, then powers of two only
    assert images == sorted(images, reverse=True)
