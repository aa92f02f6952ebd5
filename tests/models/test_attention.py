import threading

import pytest
import torch

from captioner.errors import ConfigError
from captioner.models import attention as attention_module
from captioner.models.attention import (
    ATTENTIONS,
    FORMS,
    AdditiveAttention,
    DotAttention,
    build_attention,
    default_float32_under_cpu_autocast,
    default_form,
    workspace,
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


@pytest.mark.parametrize("kind", sorted(ATTENTIONS))
def test_weights_are_float32_in_low_precision_and_keep_float64(kind):
    torch.manual_seed(0)
    attention = build_attention(kind, E, D, A)
    a, h = torch.randn(64, 49, E), 4 * torch.randn(64, D)  # bfloat16 weights would sum to 1 only within ~2^-8
    with torch.autocast("cpu", dtype=torch.bfloat16):
        context, alpha = attention(a, attention.project(a), h)
    assert alpha.dtype == torch.float32 and context.dtype == torch.bfloat16  # the bmm still runs under autocast
    assert torch.allclose(alpha.sum(dim=1), torch.ones(64), atol=1e-6)
    attention.to(torch.bfloat16)  # a bfloat16 module without autocast: the context stays in its dtype
    context, alpha = attention(a.bfloat16(), attention.project(a.bfloat16()), h.bfloat16())
    assert alpha.dtype == torch.float32 and context.dtype == torch.bfloat16
    attention.to(torch.float64)
    context, alpha = attention(a.double(), attention.project(a.double()), h.double())
    assert alpha.dtype == context.dtype == torch.float64


@pytest.mark.parametrize("decoding", [True, False])
@pytest.mark.parametrize("form", FORMS)
def test_additive_scores_are_float32_under_cpu_autocast(monkeypatch, form, decoding):
    """Under CPU autocast W a and U h run in bfloat16, and the rest of the scorer in float32: the keys and scores are
    float32, equal to that computation within float32 rounding, and gradients flow. Plain autocast's scores (the
    switch off, the default on AMD CPUs) have bfloat16's rounding."""
    monkeypatch.setattr(AdditiveAttention, "form", form)
    monkeypatch.setattr(AdditiveAttention, "float32_under_cpu_autocast", True)
    torch.manual_seed(0)
    attention = AdditiveAttention(E, D, A)
    a, h = torch.randn(B, P, E), torch.randn(B, 2, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        k, u = attention.W(a).float(), attention.U(h).float()  # the two matmuls, as autocast runs them
    reference = attention.v(torch.tanh(k.unsqueeze(1) + u.unsqueeze(2))).squeeze(-1).detach()
    mode = torch.inference_mode() if decoding else torch.enable_grad()
    with mode, torch.autocast("cpu", dtype=torch.bfloat16):
        keys = attention.project(a)
        e = attention.score(keys, h)
        monkeypatch.setattr(AdditiveAttention, "float32_under_cpu_autocast", False)
        plain = attention.score(attention.project(a), h)
    assert keys.dtype == e.dtype == torch.float32
    assert torch.allclose(e, reference, atol=1e-5)
    assert not torch.allclose(plain.float(), reference, atol=1e-5)  # bfloat16's rounding is far coarser
    if not decoding:
        e.square().sum().backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in attention.parameters())


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


@pytest.mark.parametrize("reuse_workspace", [True, False])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("chunk_elements", [1, 2 * P * A, 2**20])  # one image per piece, two, all at once
def test_additive_score_built_in_pieces_when_decoding_is_the_same(monkeypatch, chunk_elements, form, reuse_workspace):
    monkeypatch.setattr(AdditiveAttention, "form", form)
    attention = AdditiveAttention(E, D, A)
    attention.chunk_elements = chunk_elements
    attention.reuse_workspace = reuse_workspace
    a, h = torch.randn(B, P, E), torch.randn(B, 2, D)
    with torch.inference_mode():
        keys = attention.project(a)
        reference = attention.v(torch.tanh(keys.unsqueeze(1) + attention.U(h).unsqueeze(2))).squeeze(-1)
        assert torch.allclose(attention.score(keys, h), reference, atol=1e-5)


@pytest.mark.parametrize("form", FORMS)
def test_decoding_reuses_one_workspace_and_returns_scores_that_do_not_share_it(monkeypatch, form):
    monkeypatch.setattr(AdditiveAttention, "form", form)
    attention = AdditiveAttention(E, D, A)
    attention.chunk_elements = P * A  # one image per piece: pieces overwrite each other's memory
    given = []  # the memory each call was given, and a copy of what it held then

    def recorded(numel, dtype, device):
        memory = workspace(numel, dtype, device)
        given.append((memory, memory.clone()))
        return memory

    monkeypatch.setattr(attention_module, "workspace", recorded)
    a = torch.randn(B, P, E)
    with torch.inference_mode():
        keys = attention.project(a)
        first_h, second_h = torch.randn(B, 2, D), torch.randn(B, 2, D)
        first = attention.score(keys, first_h)
        kept = first.clone()
        second = attention.score(keys, second_h)
        assert torch.equal(first, kept)  # the second call did not write into the first one's scores
        for h, scores in ((first_h, first), (second_h, second)):
            reference = attention.v(torch.tanh(keys.unsqueeze(1) + attention.U(h).unsqueeze(2))).squeeze(-1)
            assert torch.allclose(scores, reference, atol=1e-5)
    assert len(given) == 2 and given[0][0].data_ptr() == given[1][0].data_ptr()  # both calls had the same memory
    assert not torch.equal(given[1][0], given[1][1])  # and the second call built its pieces in it


def test_the_workspace_is_writable_under_no_grad_after_inference_mode():
    attention = AdditiveAttention(E, D, A)
    a, h = torch.randn(B, P, E), torch.randn(B, 1, D)
    with torch.inference_mode():  # the workspace is made here first ...
        expected = attention.score(attention.project(a), h)
    with torch.no_grad():  # ... and written here: an inference tensor would refuse the in-place update
        assert torch.allclose(attention.score(attention.project(a), h), expected)


def test_each_thread_has_its_own_workspace():
    taken = {}  # the tensors themselves, so that a finished thread's memory cannot be handed to the next one

    def take(name):
        taken[name] = workspace(64, torch.float32, torch.device("cpu"))

    threads = [threading.Thread(target=take, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    take("main")
    assert len({memory.data_ptr() for memory in taken.values()}) == 3


def test_the_workspace_grows_and_follows_the_dtype():
    small = workspace(8, torch.float32, torch.device("cpu"))
    large = workspace(10**4, torch.float32, torch.device("cpu"))
    assert small.numel() == 8 and large.numel() == 10**4
    assert workspace(8, torch.float32, torch.device("cpu")).data_ptr() == large.data_ptr()  # kept, not shrunk
    assert workspace(8, torch.bfloat16, torch.device("cpu")).dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("vendor", "form"),
    [("AuthenticAMD", "sigmoid"), ("GenuineIntel", "tanh"), ("", "tanh")],  # "": unknown, e.g. an Arm CPU
)
def test_the_scorer_form_is_chosen_by_cpu(vendor, form):
    assert default_form(vendor) == form


@pytest.mark.parametrize("vendor, float32", [("AuthenticAMD", False), ("GenuineIntel", True), ("", True)])
def test_the_scorer_precision_under_cpu_autocast_is_chosen_by_cpu(vendor, float32):
    assert default_float32_under_cpu_autocast(vendor) is float32


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


def test_torch_compile_traces_the_decoding_scorer_in_one_graph():
    """While torch.compile traces it, the scorer does not use the thread-local workspace, which would break the
    graph (Inductor plans its own buffers)."""
    attention = AdditiveAttention(E, D, A)
    attention.chunk_elements = P * A  # several pieces
    a, h = torch.randn(B, P, E), torch.randn(B, 2, D)
    torch._dynamo.reset()
    with torch.no_grad():
        keys = attention.project(a)
        explained = torch._dynamo.explain(attention.score)(keys, h)
        assert explained.graph_break_count == 0 and explained.graph_count == 1
        reference = attention.v(torch.tanh(keys.unsqueeze(1) + attention.U(h).unsqueeze(2))).squeeze(-1)
        assert torch.allclose(torch.compile(attention.score, backend="eager")(keys, h), reference, atol=1e-5)
