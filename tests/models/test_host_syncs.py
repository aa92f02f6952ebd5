"""The paths meant for CUDA make the host wait for the device no more than they say: the fixed-shape training step
never, the sync-free searches once every CHECK_EVERY words and once at the end. Checked on the CPU by `HostSyncs`,
which sees every op that would make a CUDA host wait (tests/host_syncs.py); a sync put in on purpose is seen."""

import pytest
import torch

from captioner.models.beam_search import beam_search
from captioner.models.decoding import CHECK_EVERY, greedy_search
from captioner.models.show_attend_tell import pad_to_bucket
from tests.helpers import END, SPECIAL, TableDecoder, caption_batch, small_model
from tests.host_syncs import HostSyncs

READ = "reads a value to the host (.item(), bool(), int(), float(), if t:)"


def fixed_step(m, a, captions, lengths) -> list[tuple[str, str]]:
    """The syncs of one fixed-shape training step (what torch.compile captures, and CUDA graphs replay): forward,
    backward and hard attention's baseline update."""
    hard = m.attention_mode == "hard"
    with HostSyncs() as syncs:
        baseline = m.reward_baseline.clone() if hard else None
        loss, log_likelihood = m._teacher_forced_loss(a, pad_to_bucket(captions, 0), lengths, hard, None, baseline)
        loss.loss.backward()
        if hard:
            m.update_baseline(log_likelihood)
    return syncs.seen


@pytest.mark.parametrize(
    "options",
    [{}, {"attention_mode": "hard"}, {"gate": "channel", "position_embedding": True}, {"attention": "general"}],
    ids=["soft", "hard", "channel-gate-position", "general"],
)
def test_the_fixed_shape_step_makes_the_host_wait_nowhere(options):
    m = small_model(**options).train()
    m.fixed_shape = True
    assert fixed_step(m, *caption_batch(m)) == []


def test_the_shrinking_step_is_seen_to_wait_at_every_word():
    """The CPU's path reads each step's batch size to the host, and gathers the real words by a mask: the check sees
    both."""
    m = small_model().train()
    a, captions, lengths = caption_batch(m)
    seen = fixed_step(m, a, captions, lengths)
    kinds = [what for what, _ in seen]
    assert kinds.count(READ) >= captions.size(1) - 1 and "indexing with a boolean mask" in kinds


@pytest.mark.parametrize(
    "plant",
    [
        pytest.param(lambda h: float(h.sum()), id="item"),
        pytest.param(lambda h: h[h > 0], id="boolean mask"),
        pytest.param(lambda h: h.tolist(), id="tolist"),
        pytest.param(lambda h: torch.nonzero(h), id="nonzero"),
    ],
)
def test_a_sync_put_in_the_step_on_purpose_is_seen(plant, monkeypatch):
    m = small_model().train()
    m.fixed_shape = True
    recur = m.decoder.recur
    monkeypatch.setattr(m.decoder, "recur", lambda tokens, z, state: (plant(state[0]), recur(tokens, z, state))[1])
    seen = fixed_step(m, *caption_batch(m))
    assert seen and all(where.startswith("test_host_syncs.py") or "decoder.py" in where for _, where in seen), seen


@pytest.mark.parametrize("beam_size", [1, 3])
@pytest.mark.parametrize("max_len", [5, 8, 12, 16, 30])  # 8, 16: no check after the last word
def test_sync_free_search_waits_once_every_check_every_words_and_once_at_the_end(beam_size, max_len):
    torch.manual_seed(0)
    m = small_model().eval()
    with torch.no_grad():
        m.decoder.L_o.bias[END] = -1e4  # no caption ends: the search runs to max_len
    a = torch.randn(3, m.encoder.num_pixels, m.encoder.out_dim).relu()
    options = {"max_len": max_len, "sync_free": True, "check_every": CHECK_EVERY, **SPECIAL}  # a GPU's interval
    options |= {"beam_size": beam_size} if beam_size > 1 else {}
    search = beam_search if beam_size > 1 else greedy_search
    with torch.no_grad(), HostSyncs() as syncs:
        out = search(m.decoder, a, **options)
    assert out.tokens.size(1) == max_len
    checks = (max_len - 1) // CHECK_EVERY  # "have all ended?" after each CHECK_EVERY words, before the last word
    assert [what for what, _ in syncs.seen] == [READ] * (checks + 1), syncs.seen  # + the output's width


@pytest.mark.parametrize("beam_size", [1, 3])
def test_a_search_whose_captions_all_end_at_once_stops_at_the_first_check(beam_size):
    table = TableDecoder({1: {END: 0.9, 4: 0.1}, 4: {END: 1.0}})
    options = {"max_len": 30, "sync_free": True, "check_every": CHECK_EVERY, **SPECIAL}
    options |= {"beam_size": beam_size} if beam_size > 1 else {}
    search = beam_search if beam_size > 1 else greedy_search
    with HostSyncs() as syncs:
        out = search(table, torch.zeros(3, 4, 2), **options)
    assert [what for what, _ in syncs.seen] == [READ, READ]  # the check at word CHECK_EVERY, and the width
    assert out.tokens.tolist() == [[END]] * 3


@pytest.mark.parametrize("beam_size", [1, 3])
def test_on_a_cpu_a_sync_free_search_reads_at_every_word_and_stops_at_the_last_caption_s_end(beam_size):
    """A read waits for nothing on a CPU (where a compiled decoder searches sync-free): the default interval is one
    word, so the search stops as soon as every caption has ended, not at the next multiple of CHECK_EVERY."""
    table = TableDecoder({1: {4: 1.0}, 4: {5: 1.0}, 5: {END: 1.0}})  # "w4 w5 <end>": three words
    options = {"max_len": 30, **SPECIAL} | ({"beam_size": beam_size} if beam_size > 1 else {})
    search = beam_search if beam_size > 1 else greedy_search
    with HostSyncs() as syncs:
        out = search(table, torch.zeros(2, 4, 2), sync_free=True, **options)
    assert torch.equal(out.tokens, search(table, torch.zeros(2, 4, 2), sync_free=False, **options).tokens)
    assert out.tokens.tolist() == [[4, 5, END]] * 2
    checks = [where for what, where in syncs.seen if what == READ][:-1]  # the last read is the output's width
    assert len(set(checks)) == 1 and len(checks) < CHECK_EVERY  # one check a word, stopped before the 8th
    if beam_size == 1:
        assert len(checks) == 3  # after words 1 and 2 (going on) and 3 (all ended)
