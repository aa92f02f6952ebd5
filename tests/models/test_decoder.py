import pytest
import torch

from captioner.lit_module import caption_loss
from captioner.models.decoder import AttentionDecoder

B, P, E, V = 4, 9, 16, 20


def make_decoder(**kwargs) -> AttentionDecoder:
    return AttentionDecoder(V, E, embed_dim=8, decoder_dim=12, attention_dim=10, dropout=0.0, num_pixels=P, **kwargs)


def batch():
    lengths = torch.tensor([5, 7, 3, 6])  # <start> ... <end>
    captions = torch.zeros(B, 8, dtype=torch.long)
    for i, n in enumerate(lengths):
        captions[i, :n] = torch.randint(4, V, (n,))
        captions[i, 0], captions[i, n - 1] = 1, 2
    return torch.randn(B, P, E), captions, lengths


@pytest.mark.parametrize("attention", ["additive", "dot", "general"])
@pytest.mark.parametrize("gate", ["scalar", "channel", "none"])
def test_shapes_and_zeros_at_padding(attention, gate):
    a, captions, lengths = batch()
    logits, alphas = make_decoder(attention=attention, gate=gate)(a, captions, lengths)
    assert logits.shape == (B, 6, V) and alphas.shape == (B, 6, P)  # T = longest caption - 1
    for i, n in enumerate(lengths.tolist()):
        assert (logits[i, n - 1 :] == 0).all() and (alphas[i, n - 1 :] == 0).all()
        assert torch.allclose(alphas[i, : n - 1].sum(-1), torch.ones(n - 1))
    assert torch.isfinite(logits).all()


def test_each_caption_is_decoded_as_if_alone():
    """Sorting by length and shrinking the batch must not mix captions up."""
    decoder = make_decoder(position_embedding=True).eval()
    a, captions, lengths = batch()
    logits, alphas = decoder(a, captions, lengths)
    for i in range(B):
        n = int(lengths[i])
        alone, alone_alphas = decoder(a[i : i + 1], captions[i : i + 1, :n], lengths[i : i + 1])
        assert torch.allclose(logits[i, : n - 1], alone[0], atol=1e-5)
        assert torch.allclose(alphas[i, : n - 1], alone_alphas[0], atol=1e-6)


@pytest.mark.parametrize("position_embedding", [False, True])
def test_teacher_forcing_matches_stepping_word_by_word(position_embedding):
    """forward runs the output layer once for all steps; `step`, one word at a time as decoding does, must agree."""
    decoder = make_decoder(position_embedding=position_embedding)
    a, captions, lengths = batch()
    logits, alphas = decoder(a, captions, lengths)
    for i, n in enumerate(lengths.tolist()):
        memory, keys = decoder.prepare(a[i : i + 1])
        state = decoder.init_state(a[i : i + 1])
        for t in range(n - 1):
            step_logits, state, alpha = decoder.step(captions[i, t : t + 1], state, memory, keys)
            assert torch.allclose(logits[i, t], step_logits[0], atol=1e-5)
            assert torch.allclose(alphas[i, t], alpha[0], atol=1e-6)


def test_initial_state_comes_from_the_mean_annotation():
    decoder = make_decoder()
    a = torch.randn(B, P, E)
    h, c = decoder.init_state(a)
    assert torch.allclose(h, torch.tanh(decoder.init_h(a.mean(1))))
    assert torch.allclose(c, torch.tanh(decoder.init_c(a.mean(1))))


def test_annotation_projection_runs_once_per_batch():
    decoder = make_decoder()
    calls = []
    decoder.attention.W.register_forward_hook(lambda *_: calls.append(1))
    a, captions, lengths = batch()
    decoder(a, captions, lengths)
    assert len(calls) == 1


def test_loss_ignores_padded_positions():
    a, captions, lengths = batch()
    logits, alphas = make_decoder()(a, captions, lengths)
    targets = captions[:, 1 : 1 + logits.size(1)]
    loss, nll, ds = caption_loss(logits, targets, alphas, alpha_c=1.0)
    padded = (targets == 0).unsqueeze(-1)
    noisy_logits = torch.where(padded, torch.randn_like(logits) * 100, logits)
    noisy_alphas = torch.where(padded, torch.rand_like(alphas), alphas)
    loss2, nll2, ds2 = caption_loss(noisy_logits, targets, noisy_alphas, alpha_c=1.0)
    assert torch.equal(loss, loss2) and torch.equal(nll, nll2) and torch.equal(ds, ds2)
    assert padded.any()


def test_doubly_stochastic_term_matches_hand_computation():
    # One caption of 2 real steps (then padding) over P=3 positions, one caption of 1 step.
    alphas = torch.tensor(
        [
            [[0.5, 0.25, 0.25], [0.5, 0.5, 0.0], [0.9, 0.1, 0.0]],  # third step is padding
            [[0.2, 0.2, 0.6], [0.3, 0.3, 0.4], [0.3, 0.3, 0.4]],  # only the first step is real
        ]
    )
    targets = torch.tensor([[5, 2, 0], [2, 0, 0]])
    logits = torch.zeros(2, 3, 7)  # uniform: -log(1/7) per word
    # caption 0: sum_t alpha = (1.0, 0.75, 0.25) -> (0)^2 + (0.25)^2 + (0.75)^2 = 0.625
    # caption 1: sum_t alpha = (0.2, 0.2, 0.6)   -> 0.64 + 0.64 + 0.16        = 1.44
    expected_ds = (0.625 + 1.44) / 2
    loss, nll, ds = caption_loss(logits, targets, alphas, alpha_c=2.0)
    assert ds.item() == pytest.approx(expected_ds)
    log7 = torch.log(torch.tensor(7.0)).item()
    assert nll.item() == pytest.approx(log7)
    assert loss.item() == pytest.approx(3 * log7 / 2 + 2.0 * expected_ds)  # 3 real words over 2 captions
