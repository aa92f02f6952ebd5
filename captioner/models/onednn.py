"""`nn.Linear` and `nn.LSTMCell` whose matmuls can run through oneDNN when decoding on a CPU.

torch sends a float32 `nn.Linear` on a CPU to MKL's GEMM. How fast that is for the few rows of single-image decoding
depends on the CPU (`benchmarks/onednn.py`, docs/benchmarks.md):

- on an AMD EPYC (the MKL that ships with torch 2.14), 3 rows cost about three times 1 row, and oneDNN, which torch
  also ships, ran the same products 2.5–5x faster at 1–5 rows and 1.1–1.5x faster at 192: single-image beam search
  at the paper's sizes 2.7–3.3x as fast;
- on an Intel Xeon, MKL's few-row products are fast and oneDNN's up to 2.6x slower: oneDNN made single-image beam
  search 0.53–0.59x as fast, and batch 64 0.98–1.03x.

So oneDNN is used by default only on AMD CPUs with an MKL build of torch, the case it was measured to help (MKL is
Intel's library and tuned for Intel's CPUs); everywhere else the decoder keeps torch's own path. torch itself calls
oneDNN for a linear layer only from graphs that `torch.compile` has frozen, through the operator
`torch.ops.mkldnn._linear_pointwise`; these classes call that operator directly, and only where that is safe:

- float32 tensors on a CPU, with autograd off (decoding runs under `torch.inference_mode`) and autocast off;
- not while `torch.compile` or `torch.jit.trace` traces the module: Inductor cannot lower the operator with the
  weight as a graph input ("weight must be a graph constant") and makes its own choice of matmul kernel, and the
  TorchScript tracer (also under the legacy ONNX exporter) cannot record it;
- the operator exists in this torch build (it is private: a build or version without it falls back);
- `captioner.models.onednn.enabled` is true, and so is torch's `torch.backends.mkldnn.enabled`. `enabled` starts
  as `default_enabled()`: the environment variable `CAPTIONER_ONEDNN=1` turns it on on any CPU, `0` off, and
  `auto` (or unset) applies the rule above. `with onednn.use(True): ...` sets it for a block.

Everywhere else, training included, they are plain `nn.Linear` / `nn.LSTMCell`, with the same parameters and
state_dict keys. The results differ from MKL's only by float rounding (tests/models/test_onednn.py).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from captioner.errors import CaptionerWarning
from captioner.runtime import is_amd_cpu

_linear_pointwise = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
AVAILABLE = _linear_pointwise is not None and torch.backends.mkldnn.is_available()
SETTINGS = ("auto", "1", "0")


def default_enabled(setting: str | None = None, vendor: str | None = None, mkl: bool | None = None) -> bool:
    """Whether to use oneDNN when nothing else says: `setting` is CAPTIONER_ONEDNN's value ("auto" when unset);
    "auto" means on an AMD CPU with an MKL build of torch (see the module docstring)."""
    setting = os.environ.get("CAPTIONER_ONEDNN", "auto") if setting is None else setting
    if setting not in SETTINGS:
        warnings.warn(
            f"CAPTIONER_ONEDNN={setting!r} is not one of {', '.join(SETTINGS)}; using auto",
            CaptionerWarning,
            stacklevel=2,
        )
        setting = "auto"
    if setting != "auto":
        return setting == "1"
    mkl = torch.backends.mkl.is_available() if mkl is None else mkl
    return mkl and is_amd_cpu(vendor)


enabled = default_enabled()


@contextlib.contextmanager
def use(flag: bool) -> Iterator[None]:
    """Within the block, set `enabled` to `flag` (restored after it): `with onednn.use(False): ...`."""
    global enabled
    previous, enabled = enabled, flag
    try:
        yield
    finally:
        enabled = previous


def _use_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        enabled
        and AVAILABLE
        and torch.backends.mkldnn.enabled  # torch's own switch (torch.backends.mkldnn.flags)
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear`, through oneDNN where that is safe (see the module docstring)."""
    if _use_onednn(x, weight):
        return _linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class LSTMCell(nn.LSTMCell):
    """The same cell as `nn.LSTMCell` (gates in torch's order: input, forget, cell, output), written out so that its
    two matmuls can go through oneDNN; with autograd on it is `nn.LSTMCell` itself."""

    def forward(
        self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if state is None or x.dim() != 2 or not _use_onednn(x, self.weight_ih):
            return super().forward(x, state)
        h, c = state
        gates = linear(x, self.weight_ih, self.bias_ih).add_(linear(h, self.weight_hh, self.bias_hh))  # (N,4D)
        return lstm_state(gates, c)


def lstm_state(gates: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The new (h, c) of an LSTM cell from its pre-activation gates (N,4D), in torch's order (input, forget, cell,
    output), and the previous c (N,D)."""
    i, f, g, o = gates.chunk(4, dim=1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c
