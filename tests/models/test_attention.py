import pytest
import torch

from captioner.errors import ConfigError
from captioner.models.attention import (
    ATTENTIONS,
    FORMS,
    AdditiveAttention,
    DotAttention,
    build_attention,
    default_form,
)

B, P, E, D, A = 3, 6, 8, 5, 7


@pytest.mark.parametrize("kind", sorted(ATTENTIONS))
def test_weights_sum_to_one_and_context_is_their_average(kind):
    attention = build_attention(kind, E, D, A)
    a, h = torch.randn(B, P, E), torch.randn(B, D)
    context, alpha = attention(a, attention.project(a), h)
    assert context.shape == (B, E) and alpha.shape == (B, P)
    assert torch.allclose(alpha.sum(dim=1), torch.ones(B))
    assert (alpha >= 0).all()
    assert torch.allclose(context, (alpha.unsqueeze(-1) * a).sum(dim=1), atol=1e-6)


def test_additive_score_matches_the_formula():
    attention = AdditiveAttention(E, D, A)
    a, h = torch.randn(B, P, E), torch.randn(B, D)
    _, alpha = attention(a, attention.project(a), h)
    e = torch.stack([attention.v(torch.tanh(attention.W(a[:, i]) + attention.U(h))).squeeze(-1) for i in range(P)], 1)
    assert torch.allclose(alpha, torch.softmax(e, dim=1), atol=1e-6)


@pytest.mark.parametrize("form", FORMS)
def test_additive_score_and_its_gradients_equal_the_tanh_form(monkeypatch, form):
    """Either form (v.tanh(x) + b in place, or 2v.sigmoid(2x) + b - sum(v)): same values, same gradients."""
    monkeypatch.setattr(AdditiveAttention, "form", form)
    attention = AdditiveAttention(E, D, A)
    a, h = torch.randn(B, P, E), torch.randn(B, 2, D)  # two hypotheses per image
    params = list(attention.parameters())

    def grads(score):
        return torch.autograd.grad(score.square().sum(), params)

    keys = attention.project(a)
    fast = attention.score(keys, h)
    reference = attention.v(torch.tanh(attention.project(a).unsqueeze(1) + attention.U(h).unsqueeze(2))).squeeze(-1)
    assert fast.shape == (B, 2, P)
    assert torch.allclose(fast, reference, atol=1e-5)
    for g_fast, g_ref in zip(grads(fast), grads(reference), strict=True):
        assert torch.allclose(g_fast, g_ref, atol=1e-4)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("chunk_elements", [1, 2 * P * A, 2**20])  # one image per piece, two, all at once
def test_additive_score_built_in_pieces_when_decoding_is_the_same(monkeypatch, chunk_elements, form):
    monkeypatch.setattr(AdditiveAttention, "form", form)
    attention = AdditiveAttention(E, D, A)
    attention.chunk_elements = chunk_elements
    a, h = torch.randn(B, P, E), torch.randn(B, 2, D)
    with torch.inference_mode():
        keys = attention.project(a)
        reference = attention.v(torch.tanh(keys.unsqueeze(1) + attention.U(h).unsqueeze(2))).squeeze(-1)
        assert torch.allclose(attention.score(keys, h), reference, atol=1e-5)


@pytest.mark.parametrize(
    ("vendor", "form"),
    [("AuthenticAMD", "sigmoid"), ("GenuineIntel", "tanh"), ("", "tanh")],  # "": unknown, e.g. an Arm CPU
)
def test_the_scorer_form_is_chosen_by_cpu(vendor, form):
    assert default_form(vendor) == form


def test_an_unknown_scorer_form_is_a_config_error():
    attention = AdditiveAttention(E, D, A)
    attention.form = "exp"
    with pytest.raises(ConfigError, match="unknown additive scorer form 'exp'"):
        attention.score(torch.randn(B, P, A), torch.randn(B, 1, D))


def test_dot_attention_has_no_parameters_when_sizes_match():
    attention = DotAttention(E, E)
    assert sum(p.numel() for p in attention.parameters()) == 0
    a, h = torch.randn(B, P, E), torch.randn(B, E)
    _, alpha = attention(a, attention.project(a), h)
    assert torch.allclose(alpha, torch.softmax(torch.einsum("bpe,be->bp", a, h), dim=1), atol=1e-6)


def test_mask_gives_zero_weight():
    attention = AdditiveAttention(E, D, A)
    a, h = torch.randn(B, P, E), torch.randn(B, D)
    mask = torch.ones(B, P, dtype=torch.bool)
    mask[:, -2:] = False
    _, alpha = attention(a, attention.project(a), h, mask)
    assert (alpha[:, -2:] == 0).all() and torch.allclose(alpha.sum(1), torch.ones(B))


def test_unknown_attention_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown attention"):
        build_attention("luong", E, D, A)
