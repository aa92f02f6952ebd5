"""The LSTM decoder with soft attention (paper §3.1.2, §4.2.1).

Per step t, with annotations a (B,P,E), previous word y_{t-1} and state (h, c):
    alpha_t   = softmax_i(score(a_i, h_{t-1}))               attention.py
    beta_t    = sigmoid(f_beta(h_{t-1}))                      the gate, scalar as in the paper (§4.2.1)
    z_t       = beta_t * sum_i alpha_ti a_i
    h_t, c_t  = LSTMCell([E y_{t-1}; z_t], (h_{t-1}, c_{t-1}))
    logits_t  = L_o(dropout(E y_{t-1} + L_h h_t + L_z z_t))   the deep output layer (eq. 7)
`step` is `attend` (the first three lines) followed by `update`, which is `recur` (the LSTM) and then `output` (the
deep output layer). The output layer does not feed the recurrence, so teacher forcing (`forward`) runs it once, on
every word of every step together, instead of once per step.

Linear and LSTMCell are torch's, except that their matmuls can go through oneDNN when decoding on a CPU (by default
on AMD CPUs, where that was measured to be faster: onednn.py).
"""

from __future__ import annotations

import torch
from torch import nn

from captioner.errors import ConfigError
from captioner.models.attention import build_attention
from captioner.models.onednn import Linear, LSTMCell

GATES = ("scalar", "channel", "none")
COMPILED_METHODS = ("step", "update", "attend", "recur", "output")  # by AttentionDecoder.compile_steps
# dynamo's limit of graphs per function: its name in newer torch, and in torch 2.4
RECOMPILE_LIMIT = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"


def check_compiler(device: torch.device | str, backend: str = "inductor") -> None:
    """Raise a ConfigError when torch.compile with `backend` cannot compile for `device`: on a CPU, Inductor (the
    default backend) writes C++ and needs a working C++ compiler. torch.compile is lazy, so without this check a
    missing compiler would show as a traceback at the first word; `Captioner` and `CaptioningModule.setup` call it
    when `compile_decoder` is on, where the device is known. Elsewhere (a GPU, another backend) it does nothing."""
    if torch.device(device).type != "cpu" or backend != "inductor":
        return
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler  # the search Inductor itself runs, cached
    except ImportError:  # an older torch: Inductor reports a missing compiler at the first call
        return
    try:
        get_cpp_compiler()
    except Exception as err:  # InvalidCxxCompiler; on Windows a RuntimeError
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(
            f"compile_decoder: torch.compile needs a working C++ compiler to compile for the CPU ({detail}); install "
            "g++ or clang++ (or set CXX to one), or leave compile_decoder off"
        ) from None


class AttentionDecoder(nn.Module):
    """Show-Attend-Tell decoder.

    Args:
        vocab_size: V, including the special tokens.
        encoder_dim: E, channels of the annotation vectors.
        embed_dim: M, word embedding size.
        decoder_dim: D, LSTM hidden size.
        attention_dim: A, hidden size of the additive scorer.
        attention: "additive" (the paper's), "dot" or "general".
        dropout: dropout before the output layer.
        gate: "scalar" beta (the paper's), "channel" (one beta per annotation channel) or "none".
        num_pixels: P; needed only with `position_embedding`.
        position_embedding: add a learned embedding of each grid position to the annotations. Not in the paper: it
            lets the decoder know *where* it attended, which words like "left of" need. Off by default.
        pad_index: index of <pad>; its embedding stays zero.
    """

    def __init__(
        self,
        vocab_size: int,
        encoder_dim: int,
        embed_dim: int = 512,
        decoder_dim: int = 512,
        attention_dim: int = 512,
        attention: str = "additive",
        dropout: float = 0.5,
        gate: str = "scalar",
        num_pixels: int | None = None,
        position_embedding: bool = False,
        pad_index: int = 0,
    ):
        super().__init__()
        if gate not in GATES:
            raise ConfigError(f"unknown gate {gate!r}; choose one of {', '.join(GATES)}")
        if not 0 <= dropout < 1:
            raise ConfigError(f"dropout must be in [0, 1), got {dropout}")
        if position_embedding and not num_pixels:
            raise ConfigError("position_embedding needs num_pixels")
        self.vocab_size = vocab_size
        self.attention = build_attention(attention, encoder_dim, decoder_dim, attention_dim)
        self.position = nn.Parameter(0.1 * torch.randn(num_pixels, encoder_dim)) if position_embedding else None
        self.embedding = nn.Embedding(vocab_size, embed_dim, padding_idx=pad_index)
        self.init_h = Linear(encoder_dim, decoder_dim)
        self.init_c = Linear(encoder_dim, decoder_dim)
        self.f_beta = None if gate == "none" else Linear(decoder_dim, 1 if gate == "scalar" else encoder_dim)
        self.lstm = LSTMCell(embed_dim + encoder_dim, decoder_dim)
        self.L_h = Linear(decoder_dim, embed_dim)
        self.L_z = Linear(encoder_dim, embed_dim)
        self.L_o = Linear(embed_dim, vocab_size)
        self.dropout = nn.Dropout(dropout)

    # The position embedding p is added to the annotations: a'_i = a_i + p_i. Everything downstream is linear in a'
    # (the key projection is affine, the context and the mean are weighted sums), so p is applied to each of them
    # separately. The result is the same, and the big (B,P,E) annotations never enter the autograd graph.

    def prepare(self, annotations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Step-independent work, once per batch: (B,P,E) -> the annotations as the steps use them (B,P,E), and the
        attention keys (B,P,K). `init_state` takes the annotations as given, not these.

        Under autocast, float32 annotations are cast to autocast's type here, once: the key projection and each
        step's attention bmm would cast them again, the largest cast of a step (annotations from the feature cache are
        float32). The results are the same.
        """
        device = annotations.device.type
        if annotations.dtype == torch.float32 and torch.is_autocast_enabled(device):
            annotations = annotations.to(torch.get_autocast_dtype(device))
        keys = self.attention.project(annotations)  # (B,P,K)
        if self.position is not None:
            project = self.attention.project
            keys = keys + project(self.position) - project(torch.zeros_like(self.position[:1]))  # + W p_i: (P,K)
        return annotations, keys

    def init_state(self, annotations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h0 = tanh(f_init_h(mean_i a_i)), c0 = tanh(f_init_c(mean_i a_i)) (§3.1.2)."""
        mean = annotations.mean(dim=1)  # (B,E)
        if self.position is not None:
            mean = mean + self.position.mean(dim=0)
        return torch.tanh(self.init_h(mean)), torch.tanh(self.init_c(mean))  # (B,D), (B,D)

    def step(
        self,
        tokens: torch.Tensor,
        state: tuple[torch.Tensor, torch.Tensor],
        annotations: torch.Tensor,
        keys: torch.Tensor,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        """One word: tokens y_{t-1} (N,), state (N,D)x2 -> logits (N,V), new state, alpha (N,P).

        N is B, or B*G in beam search (G hypotheses per image, adjacent), with annotations and keys (B,P,.).
        Beam search calls `attend` and `update` separately in the steps where some hypotheses have ended, and
        teacher forcing calls `attend` and `recur` at each step and `output` once for all steps, so a subclass that
        changes the step should override `attend`, `recur` or `output`, not this.
        """
        context, alpha = self.attend(state[0], annotations, keys)
        logits, state = self.update(tokens, context, state)
        return logits, state, alpha

    def attend(
        self, h: torch.Tensor, annotations: torch.Tensor, keys: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first half of a step, from h_{t-1} (N,D): the gated context z_t (N,E) and alpha_t (N,P).

        Works image by image: the N rows are the G hypotheses of each of the B images, as in `step`.
        """
        context, alpha = self.attention(annotations, keys, h)  # (N,E), (N,P)
        if self.position is not None:
            context = context + alpha @ self.position  # sum_i alpha_i (a_i + p_i): (N,P) @ (P,E)
        if self.f_beta is not None:
            context = torch.sigmoid(self.f_beta(h)) * context  # z_t: (N,1 or E) * (N,E)
        return context, alpha

    def update(
        self, tokens: torch.Tensor, context: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The second half of a step: the LSTM and the deep output layer -> logits (N,V), new state (N,D)x2.

        Each row depends on its own inputs only, so beam search runs it on just the hypotheses still being written.
        """
        y, state = self.recur(tokens, context, state)
        return self.output(y, state[0], context), state

    def recur(
        self, tokens: torch.Tensor, context: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The LSTM: tokens y_{t-1} (N,), z_t (N,E), state (N,D)x2 -> the embedded words E y_{t-1} (N,M) and the new
        state (N,D)x2."""
        y = self.embedding(tokens)  # (N,M)
        return y, self.lstm(torch.cat([y, context], dim=1), state)

    def output(self, y: torch.Tensor, h: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """The deep output layer (eq. 7): E y_{t-1} (N,M), h_t (N,D), z_t (N,E) -> logits (N,V), for any N rows."""
        return self.L_o(self.dropout(y + self.L_h(h) + self.L_z(context)))

    def compile_steps(self, **options) -> AttentionDecoder:
        """Compile the per-word methods (`step`, `update`, `attend`, `recur`, `output`) with `torch.compile(**options)`,
        in place; the loops over words stay in Python.

        Off by default (not in the paper; `CaptioningModule(compile_decoder=True)` and `Captioner.load(...,
        compile_decoder=True)` turn it on). A search calls `step`, which dynamo compiles into one graph with the
        methods it calls, or `attend` and `update` once some hypothesis has ended; teacher forcing calls `attend`,
        `recur` and `output`. `dynamic=True` unless `options` say otherwise: the batch shrinks as captions end.
        Compiling is lazy, at a method's first call in each setting: with and without autograd, in inference mode, a
        batch of one (torch specialises size 1), inputs that are slices (teacher forcing's shrinking batch) or not.
        One process that trains, validates and captions meets about a dozen settings, more than dynamo's default limit
        of 8 graphs per function, past which it would run the method uncompiled; so this raises dynamo's process-wide
        limit to at least 32. On a CPU, Inductor (the default backend) needs a C++ compiler.

        What it gave is in docs/benchmarks.md (torch.compile; benchmarks/compile_step.py). Calling it again does
        nothing. Returns the decoder. `check_compiler` says at once whether Inductor can compile for a device.
        """
        config, limit = torch._dynamo.config, RECOMPILE_LIMIT
        setattr(config, limit, max(getattr(config, limit), 32))
        for name in COMPILED_METHODS:
            if name not in self.__dict__:  # compiled: the instance attribute hides the method
                setattr(self, name, torch.compile(getattr(self, name), **{"dynamic": True} | options))
        return self

    def forward(
        self, annotations: torch.Tensor, captions: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher forcing.

        Args:
            annotations: (B,P,E).
            captions: (B,T) token ids, `<start> w1 ... wn <end>` then padding.
            lengths: (B,) real length of each caption, <start> and <end> included.

        Returns:
            logits (B,T-1,V) predicting captions[:, 1:], and alphas (B,T-1,P); both are zero at padded steps, where
            nothing is computed: the batch is sorted by length and each step runs only the captions still going.
        """
        B, P, _ = annotations.shape
        steps = lengths.to(annotations.device) - 1  # (B,) words to predict, <end> included
        order = steps.argsort(descending=True)
        steps = steps[order]
        annotations = annotations[order]
        # prepare, then init_state: both use the position embedding, and autograd sums its gradient in the order of
        # the uses, so swapping them would change float32 training's rounding
        memory, keys = self.prepare(annotations)
        h, c = self.init_state(annotations)
        annotations = memory
        inputs = captions[order]  # (B,T)
        T = int(steps[0])
        running = torch.bincount(steps, minlength=T + 1).flip(0).cumsum(0).flip(0)  # running[t] = #(steps > t - 1)
        rows = []  # each step's (E y_{t-1}, h_t, z_t, alpha_t), for the captions still going
        for t in range(T):
            bt = int(running[t + 1])  # captions with more than t steps; sorted, so they are the first bt
            if bt < h.size(0):  # shrink only when a caption ends: each slice costs a full-size zero-fill in backward
                h, c, annotations, keys = h[:bt], c[:bt], annotations[:bt], keys[:bt]
            context, alpha = self.attend(h, annotations, keys)
            y, (h, c) = self.recur(inputs[:bt, t], context, (h, c))
            rows.append((y, h, context, alpha))
        # The output layer, once for the real words of all steps: larger matmuls and fewer operations than one call
        # per step, for the same function (its dropout draws all its masks at once, so a seeded run's random numbers
        # differ from those of one call per step). Then each word goes to its (step, caption) place; padding stays 0.
        y, h, context, alpha = (torch.cat(parts) for parts in zip(*rows, strict=True))  # (words,.), step by step
        logits = self.output(y, h, context)  # (words,V)
        real = torch.arange(T, device=steps.device).unsqueeze(1) < steps.unsqueeze(0)  # (T,B), in the loop's order
        padded_logits = memory.new_zeros(T, B, self.vocab_size)
        padded_logits[real] = logits.to(padded_logits.dtype)  # index_put needs one dtype (autocast may give another)
        alphas = memory.new_zeros(T, B, P)
        alphas[real] = alpha.to(alphas.dtype)
        inverse = order.argsort()
        return padded_logits.transpose(0, 1)[inverse], alphas.transpose(0, 1)[inverse]
