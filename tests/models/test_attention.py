import pytest
import torch

from captioner.errors import ConfigError
from captioner.models import attention as attention_module
from captioner.models.attention import SCORERS, AdditiveAttention, DotAttention, attend, build_scorer

B, G, P, E, D, A = 3, 2, 6, 8, 5, 7


@pytest.mark.parametrize("kind", sorted(SCORERS))
def test_weights_sum_to_one_and_the_context_is_their_average(kind):
    scorer = build_scorer(kind, E, D, A)
    a, h = torch.randn(B, P, E), torch.randn(B, G, D)
    e = scorer(scorer.project(a), h)
    context, alpha = attend(e, a)
    assert e.shape == alpha.shape == (B, G, P) and context.shape == (B, G, E)
    assert torch.allclose(alpha.sum(dim=-1), torch.ones(B, G)) and (alpha >= 0).all()
    assert torch.allclose(context, (alpha.unsqueeze(-1) * a.unsqueeze(1)).sum(dim=2), atol=1e-6)


def paper_formula(scorer: AdditiveAttention, a: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """e_ti = v . tanh(W a_i + U h) + b, written out as the paper writes it, one annotation at a time."""
    columns = [scorer.v(torch.tanh(scorer.W(a[:, i]).unsqueeze(1) + scorer.U(h))).squeeze(-1) for i in range(P)]
    return torch.stack(columns, dim=-1)  # (B,G,P)


def test_the_additive_score_and_its_gradients_are_the_papers_formula():
    scorer = AdditiveAttention(E, D, A)
    a, h = torch.randn(B, P, E), torch.randn(B, G, D)
    e, expected = scorer(scorer.project(a), h), paper_formula(scorer, a, h)
    assert torch.allclose(e, expected, atol=1e-5)
    params = list(scorer.parameters())
    for got, want in zip(
        torch.autograd.grad(e.square().sum(), params),
        torch.autograd.grad(expected.square().sum(), params),
        strict=True,
    ):
        assert torch.allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("chunk", [1, 2 * G * P * A, 2**20])  # one image per piece, two, all at once
def test_decoding_builds_the_additive_score_in_pieces_with_the_same_result(monkeypatch, chunk):
    monkeypatch.setattr(attention_module, "CHUNK", chunk)
    scorer = AdditiveAttention(E, D, A)
    a, h = torch.randn(B, P, E), torch.randn(B, G, D)
    with torch.inference_mode():
        assert torch.allclose(scorer(scorer.project(a), h), paper_formula(scorer, a, h), atol=1e-5)


def test_dot_attention_has_no_parameters_when_the_sizes_match():
    assert not list(DotAttention(D, D).parameters())
    assert len(list(DotAttention(E, D).parameters())) == 1  # projects E to D first


def test_an_unknown_scorer_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown attention 'bahdanau'; choose one of additive, dot, general"):
        build_scorer("bahdanau", E, D, A)
