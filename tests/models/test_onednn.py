import pytest
import torch
import torch.nn.functional as F
from torch import nn

from captioner.decoding import beam_search
from captioner.models import onednn
from captioner.models.decoder import AttentionDecoder

needs_onednn = pytest.mark.skipif(not onednn.AVAILABLE, reason="this torch build has no oneDNN linear")


@pytest.fixture(autouse=True)
def onednn_on(monkeypatch):
    """These tests check the oneDNN path, which is on by default only on AMD CPUs: turn it on on every CPU."""
    monkeypatch.setattr(onednn, "enabled", True)


@pytest.mark.parametrize(
    ("setting", "vendor", "mkl", "expected"),
    [
        ("auto", "AuthenticAMD", True, True),  # where MKL's few-row products were measured slow
        ("auto", "GenuineIntel", True, False),  # where they were measured fast
        ("auto", "", True, False),  # unknown (an Arm CPU has no vendor_id): torch's own path
        ("auto", "AuthenticAMD", False, False),  # no MKL to replace
        ("1", "GenuineIntel", True, True),
        ("0", "AuthenticAMD", True, False),
    ],
)
def test_default_is_onednn_on_amd_cpus_with_mkl_only(setting, vendor, mkl, expected):
    assert onednn.default_enabled(setting, vendor, mkl) is expected


def test_an_unknown_setting_warns_and_means_auto(monkeypatch):
    monkeypatch.setenv("CAPTIONER_ONEDNN", "yes")
    with pytest.warns(UserWarning, match="CAPTIONER_ONEDNN='yes' is not one of auto, 1, 0"):
        assert onednn.default_enabled(vendor="GenuineIntel", mkl=True) is False
    monkeypatch.setenv("CAPTIONER_ONEDNN", "1")
    assert onednn.default_enabled(vendor="GenuineIntel", mkl=True) is True


def test_use_sets_the_switch_for_a_block_and_restores_it():
    with onednn.use(False):
        assert onednn.enabled is False
        with pytest.raises(RuntimeError), onednn.use(True):
            assert onednn.enabled is True
            raise RuntimeError
        assert onednn.enabled is False
    assert onednn.enabled is True  # the fixture's value


def calls_to_onednn(monkeypatch) -> list[int]:
    """Count the calls that reach the oneDNN operator."""
    calls = []
    real = onednn._linear_pointwise

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(onednn, "_linear_pointwise", counting)
    return calls


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 5, 64])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_equals_torch_when_decoding(monkeypatch, rows, bias):
    calls = calls_to_onednn(monkeypatch)
    layer = onednn.Linear(40, 24, bias=bias)
    x = torch.randn(rows, 40)
    with torch.inference_mode():
        got = layer(x)
        assert calls, "the oneDNN path was not taken"
        torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer(x.view(rows, 1, 40)), got.view(rows, 1, 24), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_lstm_cell_equals_torch_when_decoding(monkeypatch):
    calls = calls_to_onednn(monkeypatch)
    torch.manual_seed(0)
    cell = onednn.LSTMCell(10, 7)
    reference = nn.LSTMCell(10, 7)
    reference.load_state_dict(cell.state_dict())
    x, h, c = torch.randn(3, 10), torch.randn(3, 7), torch.randn(3, 7)
    with torch.inference_mode():
        got = cell(x, (h, c))
        assert len(calls) == 2
        expected = reference(x, (h, c))
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # torch's, from mkldnn.flags()
def test_training_autocast_and_the_switch_use_torchs_own_path(monkeypatch):
    calls = calls_to_onednn(monkeypatch) if onednn.AVAILABLE else []
    layer, cell = onednn.Linear(8, 4), onednn.LSTMCell(8, 4)
    x, state = torch.randn(2, 8), (torch.zeros(2, 4), torch.zeros(2, 4))
    loss = layer(x).sum() + cell(x, state)[0].sum()  # autograd on
    loss.backward()
    assert layer.weight.grad is not None and cell.weight_ih.grad is not None
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16  # autocast still applies
        cell(x, state)
    with torch.inference_mode(), torch.backends.mkldnn.flags(enabled=False):  # torch's own switch
        layer(x), cell(x, state)
    monkeypatch.setattr(onednn, "enabled", False)
    with torch.inference_mode():
        layer(x), cell(x, state)
    assert calls == []


def test_state_dict_is_torchs():
    """Checkpoints written before these classes existed (plain nn.Linear / nn.LSTMCell) still load."""
    assert onednn.Linear(3, 2).state_dict().keys() == nn.Linear(3, 2).state_dict().keys()
    assert onednn.LSTMCell(3, 2).state_dict().keys() == nn.LSTMCell(3, 2).state_dict().keys()


@needs_onednn
def test_beam_search_gives_the_same_captions_either_way(monkeypatch):
    torch.manual_seed(0)
    decoder = AttentionDecoder(30, 16, embed_dim=8, decoder_dim=12, attention_dim=10).eval()
    annotations = torch.randn(6, 9, 16)
    results = []
    for flag in (True, False):
        monkeypatch.setattr(onednn, "enabled", flag)
        with torch.inference_mode():
            results.append(beam_search(decoder, annotations, start_index=1, end_index=2, beam_size=3, max_len=12))
    fast, plain = results
    assert torch.equal(fast.tokens, plain.tokens) and torch.equal(fast.lengths, plain.lengths)
    torch.testing.assert_close(fast.scores, plain.scores, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fast.alphas, plain.alphas, rtol=1e-4, atol=1e-5)


@needs_onednn
def test_torch_compile_of_the_decoder_step_works_when_decoding():
    """A compiled step traces torch's own linear (Inductor cannot lower the oneDNN operator with the weight as an
    input), and gives the eager step's results."""
    torch.manual_seed(0)
    decoder = AttentionDecoder(vocab_size=12, encoder_dim=16, embed_dim=8, decoder_dim=8, attention_dim=8).eval()
    annotations = torch.randn(2, 5, 16)
    with torch.inference_mode():
        keys = decoder.attention.project(annotations)
        state = decoder.init_state(annotations)
        tokens = torch.tensor([1, 1])
        expected = decoder.step(tokens, state, annotations, keys)
        compiled = torch.compile(decoder.step, dynamic=False)
        got = compiled(tokens, state, annotations, keys)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-4, atol=1e-5)  # logits
    torch.testing.assert_close(got[1], expected[1], rtol=1e-4, atol=1e-5)  # (h, c)
    torch.testing.assert_close(got[2], expected[2], rtol=1e-4, atol=1e-5)  # alpha


@needs_onednn
@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit.trace is deprecated, but still used (and by ONNX)
def test_torchscript_tracing_records_torchs_own_linear():
    torch.manual_seed(0)
    layer, cell = onednn.Linear(8, 4).eval(), onednn.LSTMCell(8, 4).eval()
    x, state = torch.randn(2, 8), (torch.randn(2, 4), torch.randn(2, 4))
    with torch.no_grad():
        traced_layer = torch.jit.trace(layer, x)
        traced_cell = torch.jit.trace(cell, (x, state))
        assert "mkldnn" not in str(traced_layer.graph) + str(traced_cell.graph)
        torch.testing.assert_close(traced_layer(x), layer(x), rtol=1e-5, atol=1e-6)
        for a, b in zip(traced_cell(x, state), cell(x, state), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@needs_onednn
def test_torch_export_records_torchs_own_linear():
    """torch.export turns torch.backends.mkldnn.enabled off while it traces, and is_compiling() is true then too:
    either keeps the oneDNN operator out of the exported program (without both, it is recorded)."""
    layer = onednn.Linear(8, 4).eval()
    x = torch.randn(2, 8)
    with torch.inference_mode():
        program = torch.export.export(layer, (x,))
        assert "mkldnn" not in str(program.graph)
        torch.testing.assert_close(program.module()(x), layer(x), rtol=1e-5, atol=1e-6)
