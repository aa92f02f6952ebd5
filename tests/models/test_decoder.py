import math

import pytest
import torch
from torch import nn

from captioner.errors import ConfigError
from captioner.models.decoder import AttentionDecoder
from captioner.models.show_attend_tell import caption_loss

B, P, E, V = 4, 9, 16, 20


def make_decoder(**kwargs) -> AttentionDecoder:
    return AttentionDecoder(V, E, P, embed_dim=8, decoder_dim=12, attention_dim=10, dropout=0.0, **kwargs)


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
        keys = decoder.prepare(a[i : i + 1])
        state = decoder.init_state(a[i : i + 1])
        for t in range(n - 1):
            step_logits, state, alpha = decoder.step(captions[i, t : t + 1], state, a[i : i + 1], keys)
            assert torch.allclose(logits[i, t], step_logits[0], atol=1e-5)
            assert torch.allclose(alphas[i, t], alpha[0], atol=1e-6)


def test_initial_state_comes_from_the_mean_annotation():
    decoder = make_decoder()
    a = torch.randn(B, P, E)
    h, c = decoder.init_state(a)
    assert torch.allclose(h, torch.tanh(decoder.init_h(a.mean(1))))
    assert torch.allclose(c, torch.tanh(decoder.init_c(a.mean(1))))


def test_an_initial_state_of_zeros_has_no_weights_and_lets_the_image_in_only_through_attention():
    decoder = make_decoder(initial_state="zeros").eval()
    assert decoder.init_h is None and decoder.init_c is None
    assert not any(name.startswith(("init_h", "init_c")) for name, _ in decoder.named_parameters())
    a, captions, lengths = batch()
    h, c = decoder.init_state(a)
    assert h.shape == c.shape == (B, decoder.decoder_dim) and not h.any() and not c.any()
    # The paper's decoder whose f_init_h and f_init_c output 0 (tanh(0) = 0) computes the same logits and weights.
    torch.manual_seed(0)
    paper = make_decoder().eval()
    for layer in (paper.init_h, paper.init_c):
        torch.nn.init.zeros_(layer.weight), torch.nn.init.zeros_(layer.bias)
    weights = {k: v for k, v in paper.state_dict().items() if not k.startswith(("init_h", "init_c"))}
    decoder.load_state_dict(weights)
    (logits, alphas), (paper_logits, paper_alphas) = decoder(a, captions, lengths), paper(a, captions, lengths)
    assert torch.equal(logits, paper_logits) and torch.equal(alphas, paper_alphas)
    with pytest.raises(ConfigError, match="initial_state"):
        make_decoder(initial_state="random")


def test_annotation_projection_runs_once_per_batch():
    decoder = make_decoder()
    calls = []
    decoder.attention.W.register_forward_hook(lambda *_: calls.append(1))
    a, captions, lengths = batch()
    decoder(a, captions, lengths)
    assert len(calls) == 1


def set_weights(layer: nn.Linear, weight, bias) -> None:
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(weight, dtype=torch.float32))
        layer.bias.copy_(torch.tensor(bias, dtype=torch.float32))


@pytest.mark.parametrize(
    ("gate", "beta"), [("scalar", [0.5, 0.5]), ("channel", [0.5, 1 / (1 + math.exp(-2))]), ("none", [1, 1])]
)
def test_the_gated_context_is_beta_times_the_attention_average_by_hand(gate, beta):
    """z_t = beta_t * sum_i alpha_ti a_i, beta_t = sigmoid(f_beta(h_{t-1})) (§4.2.1), with dot scoring (E = D = 2)
    so that e_i = h . a_i: a_1 = (ln 3, 2), a_2 = (0, 2) and h = (1, 0) give e = (ln 3, 0), alpha = (3/4, 1/4) and
    the average (3/4 ln 3, 2). f_beta's weights are zero, so beta = sigmoid(its bias): 1/2 for the scalar gate on both
    channels, and (1/2, sigmoid(2)) per channel: the second channel tells the two gates apart."""
    decoder = AttentionDecoder(V, 2, 2, embed_dim=2, decoder_dim=2, attention="dot", gate=gate)
    if decoder.f_beta is not None:
        width = decoder.f_beta.out_features
        set_weights(decoder.f_beta, [[0.0, 0.0]] * width, [0.0, 2.0][:width])
    a = torch.tensor([[[math.log(3), 2.0], [0.0, 2.0]]])  # (1,2,2)
    h = torch.tensor([[1.0, 0.0]])
    context, alpha = decoder.attend(h, a, decoder.prepare(a))
    assert torch.allclose(alpha, torch.tensor([[0.75, 0.25]]))
    expected = torch.tensor([[0.75 * math.log(3) * beta[0], 2.0 * beta[1]]])
    assert torch.allclose(context, expected, atol=1e-6)


def test_the_deep_output_layer_is_eq_7_by_hand():
    """logits = L_o(E y + L_h h + L_z z): with y = (1, 2), L_h h = (0.5, 0.5), L_z z = (2, 1) the sum is (3.5, 3.5),
    and L_o maps it to (3.5 + 3.5, 3.5 - 3.5 + 0.5) = (7, 0.5)."""
    decoder = AttentionDecoder(2, 2, 1, embed_dim=2, decoder_dim=2, dropout=0.0)
    set_weights(decoder.L_h, [[1.0, 0.0], [0.0, 1.0]], [0.0, 0.0])
    set_weights(decoder.L_z, [[2.0, 0.0], [0.0, 0.0]], [0.0, 1.0])
    set_weights(decoder.L_o, [[1.0, 1.0], [1.0, -1.0]], [0.0, 0.5])
    logits = decoder.output(torch.tensor([[1.0, 2.0]]), torch.tensor([[0.5, 0.5]]), torch.tensor([[1.0, 7.0]]))
    assert torch.allclose(logits, torch.tensor([[7.0, 0.5]]))


def test_loss_ignores_padded_positions():
    a, captions, lengths = batch()
    logits, alphas = make_decoder()(a, captions, lengths)
    targets = captions[:, 1 : 1 + logits.size(1)]
    loss, nll, ds, entropy = caption_loss(logits, targets, alphas, alpha_c=1.0)
    padded = (targets == 0).unsqueeze(-1)
    noisy_logits = torch.where(padded, torch.randn_like(logits) * 100, logits)
    noisy_alphas = torch.where(padded, torch.rand_like(alphas), alphas)
    loss2, nll2, ds2, entropy2 = caption_loss(noisy_logits, targets, noisy_alphas, alpha_c=1.0)
    assert torch.equal(loss, loss2) and torch.equal(nll, nll2) and torch.equal(ds, ds2)
    assert torch.equal(entropy, entropy2)
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
    loss, nll, ds, _ = caption_loss(logits, targets, alphas, alpha_c=2.0)
    assert ds.item() == pytest.approx(expected_ds)
    log7 = torch.log(torch.tensor(7.0)).item()
    assert nll.item() == pytest.approx(log7)
    assert loss.item() == pytest.approx(3 * log7 / 2 + 2.0 * expected_ds)  # 3 real words over 2 captions


def test_the_attention_entropy_penalty_matches_hand_computation():
    """Each real word's attention entropy over the uniform's (log P), summed over a caption's words, averaged over the
    captions, times its weight; padded steps count for nothing; the logged part is the mean over the real words."""
    import math

    alphas = torch.tensor(
        [
            [[1 / 3, 1 / 3, 1 / 3], [1.0, 0.0, 0.0], [0.9, 0.1, 0.0]],  # uniform (1), one cell (0), then padding
            [[0.5, 0.5, 0.0], [0.3, 0.3, 0.4], [0.3, 0.3, 0.4]],  # only the first step is real: log 2 / log 3
        ]
    )
    targets = torch.tensor([[5, 2, 0], [2, 0, 0]])
    logits = torch.randn(2, 3, 7)
    words = [1.0, 0.0, math.log(2) / math.log(3)]
    plain = caption_loss(logits, targets, alphas, alpha_c=1.0)
    for sync_free in (False, True):
        penalised = caption_loss(logits, targets, alphas, 1.0, 0, sync_free, attention_entropy_penalty=0.5)
        assert penalised.attention_entropy.item() == pytest.approx(sum(words) / 3)
        assert plain.attention_entropy.item() == pytest.approx(sum(words) / 3)
        assert (penalised.loss - plain.loss).item() == pytest.approx(0.5 * sum(words) / 2, rel=1e-5)
        assert torch.equal(penalised.nll_per_word, plain.nll_per_word)


def test_teacher_forcing_with_lengths_and_several_captions_an_image_names_the_cause():
    """The shrinking batch (lengths given) cannot take k captions an image: the error says so, not that the counts are
    wrong."""
    from tests.helpers import caption_batch, small_model

    model = small_model()
    annotations, captions, lengths = caption_batch(model)
    with pytest.raises(ValueError, match=r"^2 captions an image need fixed shapes \(lengths=None\)"):
        model.decoder(annotations[: len(captions) // 2], captions, lengths, captions_per_image=2)
