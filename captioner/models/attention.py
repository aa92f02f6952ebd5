"""Soft attention over annotation vectors (paper §3.1.2, eq. 4-6).

Every scorer has one interface:
    keys = attention.project(annotations)                       # once per batch: (B,P,E) -> (B,P,K)
    context, alpha = attention(annotations, keys, h)            # every step:  -> (B,E), (B,P)
The projection of the annotations does not depend on the step, so it is computed once per batch, not T times.

In beam search, h has G = K rows per image (B*G rows, grouped by image), while the annotations and keys stay one
row per image: the G hypotheses of an image attend over the same (P,E) memory without copying it G times.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from captioner.errors import ConfigError
from captioner.models.onednn import Linear
from captioner.runtime import is_amd_cpu


class Attention(nn.Module):
    """Base class: subclasses define `project` (step-independent) and `score` (per step)."""

    def project(self, annotations: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def score(self, keys: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """keys (B,P,K), h (B,G,D) -> scores (B,G,P)."""
        raise NotImplementedError

    def forward(
        self,
        annotations: torch.Tensor,
        keys: torch.Tensor,
        h: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """annotations (B,P,E), keys (B,P,K), h (B*G,D), mask (B,P) True where valid -> context (B*G,E), alpha
        (B*G,P), in float32 also under autocast (float64 for a float64 model)."""
        B, P, E = annotations.shape
        G = h.size(0) // B  # hypotheses per image: 1, or the beam size
        e = self.score(keys, h.view(B, G, -1))  # (B,G,P)
        if mask is not None:
            e = e.masked_fill(~mask.unsqueeze(1), float("-inf"))
        # The softmax runs in float32 at least, as CUDA's autocast runs it; CPU autocast would keep it in bfloat16, and
        # the weights returned for the overlays and the attention penalty would sum to 1 only within about 2^-8.
        alpha = F.softmax(e, dim=-1, dtype=torch.promote_types(e.dtype, torch.float32))  # (B,G,P)
        context = torch.bmm(alpha.to(annotations.dtype), annotations)  # (B,G,E)
        return context.view(B * G, E), alpha.view(B * G, P)


FORMS = ("tanh", "sigmoid")

_workspace = threading.local()  # per thread: the memory the additive scorer builds its pieces in when decoding


def workspace(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat tensor of `numel` elements for this thread to build the additive scorer's pieces in, reused from step
    to step and call to call instead of allocated each time (see AdditiveAttention). Each thread keeps one, the
    largest it has needed since its dtype or device last changed: `chunk_elements`, or one image's piece when larger
    (under 4 MiB of float32 for beam 3 at both of benchmarks/common.py's sizes)."""
    buffer = getattr(_workspace, "buffer", None)
    if buffer is None or buffer.numel() < numel or buffer.dtype != dtype or buffer.device != device:
        with torch.inference_mode(False):  # a normal tensor: writable under inference_mode and no_grad alike
            buffer = _workspace.buffer = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel]


def default_form(vendor: str | None = None) -> str:
    """The additive scorer's form for this CPU: "sigmoid" on AMD CPUs, "tanh" elsewhere (see AdditiveAttention)."""
    return "sigmoid" if is_amd_cpu(vendor) else "tanh"


def default_float32_under_cpu_autocast(vendor: str | None = None) -> bool:
    """Whether the additive scorer computes in float32 under CPU autocast: on every CPU but AMD's, where plain
    autocast was the faster (see AdditiveAttention)."""
    return not is_amd_cpu(vendor)


class AdditiveAttention(Attention):
    """Bahdanau scoring, the paper's: e_ti = v . tanh(W a_i + U h_{t-1}).

    The (B,G,P,A) tensor x = W a_i + U h_{t-1} is the largest of a decoding step. It is updated in place rather than
    allocated twice, and when decoding (no autograd) it is built a few images at a time so that each piece stays in
    cache; training keeps one piece, as autograd stores it anyway and slicing would add to the backward pass.
    When decoding, the pieces are built in one per-thread `workspace` that lives from call to call
    (`reuse_workspace = False` gives each piece fresh memory, as before, and so does tracing by torch.compile). A
    freshly allocated piece (4 MiB at batch 64) can come from pages that glibc's malloc gave back to the kernel, and
    every such page costs a fault and a zero-fill (benchmarks/malloc.py, docs/benchmarks.md).

    `form` picks one of two ways to compute the same function, by which of torch's CPU kernels is faster
    (benchmarks/attention.py, docs/benchmarks.md):
    - "tanh": v . tanh(x) + b, as written; the default except on AMD CPUs. On an Intel Xeon it was 1.2–1.6x as fast
      as the sigmoid form;
    - "sigmoid": 2v . sigmoid(2x) + b - sum(v), since tanh(x) = 2 sigmoid(2x) - 1; the default on AMD CPUs, where
      torch's tanh kernel was several times slower than its sigmoid.
    The class attribute sets it for every instance (`AdditiveAttention.form = "tanh"`), an instance's for one.

    Under autocast on a CPU (bf16-mixed), except on AMD CPUs, the keys are kept in float32 and x, its tanh and
    v . tanh(x) are computed in float32; the matmuls W a and U h still run in bfloat16. Plain autocast computes all
    of it in bfloat16, as it does on a GPU. The paper predates mixed precision, so neither is a deviation from it.
    It is a choice of speed, by CPU (benchmarks/attention.py; docs/benchmarks-log.md has the runs):
    - on an Intel Xeon, torch's bfloat16 tanh and sigmoid were slow, and a decoding step's scorer ran 2.4-3.3x as
      fast in float32 as under plain autocast (training: about even);
    - on an AMD EPYC (with avx512_bf16) plain autocast was the faster: whole bf16-mixed training steps ran 1.08-1.11x
      as fast with it, beam-3 searches about even (0.94-1.25x), and the bundled model's captions changed no more
      (222 of 256 the same as float32's, against 221).
    Float32 is the more precise. `float32_under_cpu_autocast` (True or False) sets it for every instance, like
    `form`.
    """

    chunk_elements = 2**20  # about 4 MB of float32 per piece when decoding
    reuse_workspace = True  # build the pieces in this thread's workspace (when decoding)
    form = default_form()
    float32_under_cpu_autocast = default_float32_under_cpu_autocast()

    def __init__(self, encoder_dim: int, decoder_dim: int, attention_dim: int):
        super().__init__()
        self.W = Linear(encoder_dim, attention_dim)
        self.U = Linear(decoder_dim, attention_dim, bias=False)  # W already carries the bias
        self.v = Linear(attention_dim, 1)

    def _in_float32(self, x: torch.Tensor) -> bool:
        """Whether to score in float32 rather than autocast's type (see the class docstring)."""
        return self.float32_under_cpu_autocast and x.device.type == "cpu" and torch.is_autocast_enabled("cpu")

    def project(self, annotations: torch.Tensor) -> torch.Tensor:
        keys = self.W(annotations)  # (B,P,A)
        return keys.to(torch.promote_types(keys.dtype, torch.float32)) if self._in_float32(keys) else keys

    def score(self, keys: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        uh = self.U(h)  # (B,G,A)
        if not self._in_float32(uh):
            return self._score(keys, uh)
        dtype = torch.promote_types(torch.result_type(keys, uh), torch.float32)
        with torch.autocast("cpu", enabled=False):  # or v . tanh(x) would go back to bfloat16
            return self._score(keys.to(dtype), uh.to(dtype))

    def _score(self, keys: torch.Tensor, uh: torch.Tensor) -> torch.Tensor:
        """keys (B,P,A) and U h (B,G,A) -> e (B,G,P)."""
        B, P, A = keys.shape
        if torch.is_grad_enabled():  # one piece, unsliced: a slice would add a full-size zero-fill to the backward
            xs = [keys.unsqueeze(1) + uh.unsqueeze(2)]  # (B,G,P,A)
        else:  # pieces of `step` images; xs is consumed lazily below, each piece used up before the next is built
            G = uh.size(1)
            step = max(1, self.chunk_elements // (G * P * A))
            pairs = zip(keys.split(step), uh.split(step), strict=True)
            # Every piece in the same memory, overwriting the one before; not while torch.compile traces the scorer,
            # which plans its own buffers (and would break its graph at the thread-local workspace).
            if self.reuse_workspace and not torch.compiler.is_compiling():
                memory = workspace(min(step, B) * G * P * A, torch.result_type(keys, uh), keys.device)
                xs = (
                    torch.add(k.unsqueeze(1), u.unsqueeze(2), out=memory[: k.numel() * G].view(k.size(0), G, P, A))
                    for k, u in pairs
                )
            else:
                xs = (k.unsqueeze(1) + u.unsqueeze(2) for k, u in pairs)
        if self.form == "tanh":
            pieces, offset = [self.v(x.tanh_()).squeeze(-1) for x in xs], None  # each (b,G,P)
        elif self.form == "sigmoid":
            w = self.v.weight.squeeze(0)  # (A,)
            pieces, offset = [x.mul_(2).sigmoid_() @ (2 * w) for x in xs], self.v.bias - w.sum()  # each (b,G,P)
        else:
            raise ConfigError(f"unknown additive scorer form {self.form!r}; choose one of {', '.join(FORMS)}")
        e = pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # (B,G,P)
        return e if offset is None else e + offset


class GeneralAttention(Attention):
    """Luong's general scoring: e_ti = h . (W a_i)."""

    def __init__(self, encoder_dim: int, decoder_dim: int, attention_dim: int = 0):
        super().__init__()
        self.W = Linear(encoder_dim, decoder_dim, bias=False)

    def project(self, annotations: torch.Tensor) -> torch.Tensor:
        return self.W(annotations)  # (B,P,D)

    def score(self, keys: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.bmm(h, keys.transpose(1, 2))  # (B,G,D) @ (B,D,P) -> (B,G,P)


class DotAttention(GeneralAttention):
    """Luong's dot scoring: e_ti = h . a_i, with no parameters when E == D.

    When the sizes differ, the annotations are first projected to the decoder size by a learned linear map, which
    makes this the same as general scoring.
    """

    def __init__(self, encoder_dim: int, decoder_dim: int, attention_dim: int = 0):
        super().__init__(encoder_dim, decoder_dim)
        if encoder_dim == decoder_dim:
            self.W = nn.Identity()


ATTENTIONS: dict[str, type[Attention]] = {
    "additive": AdditiveAttention,
    "dot": DotAttention,
    "general": GeneralAttention,
}


def build_attention(kind: str, encoder_dim: int, decoder_dim: int, attention_dim: int) -> Attention:
    if kind not in ATTENTIONS:
        raise ConfigError(f"unknown attention {kind!r}; choose one of {', '.join(ATTENTIONS)}")
    return ATTENTIONS[kind](encoder_dim, decoder_dim, attention_dim)
