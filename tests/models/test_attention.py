import pytest
import torch

from captioner.errors import ConfigError
from captioner.models.attention import ATTENTIONS, AdditiveAttention, DotAttention, build_attention

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
