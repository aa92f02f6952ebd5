"""The LSTM decoder with soft or hard attention (paper §3.1.2, §4.1, §4.2.1).

Per step t, with annotations a (B,P,E), previous word y_{t-1} and state (h, c):
    alpha_t   = softmax_i(score(a_i, h_{t-1}))               attention.py
    beta_t    = sigmoid(f_beta(h_{t-1}))                      the gate, a scalar as in the paper (§4.2.1)
    z_t       = beta_t * sum_i alpha_ti a_i
    h_t, c_t  = LSTMCell([E y_{t-1}; z_t], (h_{t-1}, c_{t-1}))
    logits_t  = L_o(dropout(E y_{t-1} + L_h h_t + L_z z_t))   the deep output layer (eq. 7)
`step` is `attend` (the first three lines) then `update`, which is `recur` (the LSTM) then `output` (the deep output
layer). The output layer does not feed the recurrence, so teacher forcing (`forward`) runs it once, on every word of
every step together.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import nn

from captioner.errors import ConfigError, check_choice
from captioner.models.attention import Scorer, attend, build_scorer
from captioner.models.compiling import compile_function

Gate = Literal["scalar", "channel", "none"]  # a type: LightningCLI refuses other values and lists these in --help
GATES = get_args(Gate)
InitialState = Literal["mean", "zeros"]
INITIAL_STATES = get_args(InitialState)
State = tuple[torch.Tensor, torch.Tensor]  # h, c: (N,D) each


class AttentionDecoder(nn.Module):
    """Show-Attend-Tell decoder.

    Args:
        vocab_size: V, the special tokens included.
        encoder_dim: E, channels of the annotation vectors.
        num_pixels: P, annotations per image (for `position_embedding`).
        embed_dim: word embedding size M.
        decoder_dim: LSTM size D.
        attention_dim: size A of the additive scorer.
        attention: the scorer: "additive" (the paper's), "dot" or "general".
        dropout: dropout before the deep output layer.
        gate: "scalar" (the paper's beta), "channel" (one beta per annotation channel) or "none".
        initial_state: "mean", the LSTM's h0 and c0 from the mean annotation through f_init_h and f_init_c (the
            paper's, §3.1.2), or "zeros" (not the paper's): the LSTM starts from nothing, so the image reaches it only
            through attention's contexts.
        position_embedding: add a learned embedding of each grid position to the annotations. Not in the paper: it
            tells the decoder where it attended, which words like "left of" need.
        pad_index: index of <pad>, whose embedding stays zero.
    """

    def __init__(
        self,
        vocab_size: int,
        encoder_dim: int,
        num_pixels: int,
        embed_dim: int = 512,
        decoder_dim: int = 512,
        attention_dim: int = 512,
        attention: Scorer = "additive",
        dropout: float = 0.5,
        gate: Gate = "scalar",
        initial_state: InitialState = "mean",
        position_embedding: bool = False,
        pad_index: int = 0,
    ):
        super().__init__()
        check_choice("gate", gate, GATES)
        check_choice("initial_state", initial_state, INITIAL_STATES)
        if not 0 <= dropout < 1:
            raise ConfigError(f"dropout must be in [0, 1), got {dropout}")
        self.vocab_size = vocab_size
        self.attention = build_scorer(attention, encoder_dim, decoder_dim, attention_dim)
        self.position = nn.Parameter(0.1 * torch.randn(num_pixels, encoder_dim)) if position_embedding else None
        self.embedding = nn.Embedding(vocab_size, embed_dim, padding_idx=pad_index)
        self.decoder_dim = decoder_dim
        from_mean = initial_state == "mean"
        self.init_h = nn.Linear(encoder_dim, decoder_dim) if from_mean else None
        self.init_c = nn.Linear(encoder_dim, decoder_dim) if from_mean else None
        self.f_beta = None if gate == "none" else nn.Linear(decoder_dim, 1 if gate == "scalar" else encoder_dim)
        self.lstm = nn.LSTMCell(embed_dim + encoder_dim, decoder_dim)
        self.L_h = nn.Linear(decoder_dim, embed_dim)
        self.L_z = nn.Linear(encoder_dim, embed_dim)
        self.L_o = nn.Linear(embed_dim, vocab_size)
        self.dropout = nn.Dropout(dropout)
        self.compiled = False  # whether `compile_search` compiled it

    # The position embedding p is added to the annotations: a'_i = a_i + p_i. Everything downstream is linear in a'
    # (the keys are an affine map of it, the context and the mean are weighted sums), so p is added to each of them
    # instead, and the big (B,P,E) annotations never enter the autograd graph.

    def prepare(self, annotations: torch.Tensor) -> torch.Tensor:
        """The attention keys (B,P,K) of the annotations (B,P,E): work done once per batch, not once per word."""
        keys = self.attention.project(annotations)  # (B,P,K)
        if self.position is not None:
            project = self.attention.project
            keys = keys + project(self.position) - project(torch.zeros_like(self.position[:1]))  # + W p_i: (P,K)
        return keys

    def init_state(self, annotations: torch.Tensor) -> State:
        """h0 = tanh(f_init_h(mean_i a_i)), c0 = tanh(f_init_c(mean_i a_i)) (§3.1.2), or zeros (`initial_state`)."""
        if self.init_h is None:
            shape = (annotations.shape[0], self.decoder_dim)
            return annotations.new_zeros(shape), annotations.new_zeros(shape)  # (B,D), (B,D)
        mean = annotations.mean(dim=1)  # (B,E)
        if self.position is not None:
            mean = mean + self.position.mean(dim=0)
        return torch.tanh(self.init_h(mean)), torch.tanh(self.init_c(mean))  # (B,D), (B,D)

    def step(
        self, tokens: torch.Tensor, state: State, annotations: torch.Tensor, keys: torch.Tensor
    ) -> tuple[torch.Tensor, State, torch.Tensor]:
        """One word: tokens y_{t-1} (N,), state (N,D)x2 -> logits (N,V), the new state, alpha (N,P).

        N is B, or B*G in beam search (the G hypotheses of each image adjacent), with annotations and keys (B,P,.).
        """
        context, alpha = self.attend(state[0], annotations, keys)
        logits, state = self.update(tokens, context, state)
        return logits, state, alpha

    def attend(
        self,
        h: torch.Tensor,
        annotations: torch.Tensor,
        keys: torch.Tensor,
        sample: bool = False,
        location: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """The first half of a step, from h_{t-1} (N,D): the gated context z_t (N,E) and alpha_t (N,P).

        Soft attention (eq. 13) takes the expected context sum_i alpha_ti a_i. With `sample`, hard attention (§4.1,
        eq. 8-9): a location s_t ~ Multinoulli(alpha_t) is drawn (or `location` (N,) is taken as drawn) and the
        context is its one annotation a_{s_t}; the locations (N,) are returned third.
        """
        B, P, E = annotations.shape
        h3 = h.view(B, -1, h.size(-1))  # (B,G,D): the G hypotheses of each image
        context, alpha = attend(self.attention(keys, h3), annotations)  # (B,G,E), (B,G,P)
        context, alpha = context.view(-1, E), alpha.view(-1, P)  # (N,E), (N,P)
        weights = alpha
        if sample:
            if location is None:
                location = torch.multinomial(alpha.detach(), 1).squeeze(1)  # (N,)
            # (N,P): s_t as a one-hot vector. Not F.one_hot, which reads the locations' range back to the host.
            weights = torch.zeros_like(alpha).scatter_(1, location.unsqueeze(1), 1.0)
            context = torch.bmm(weights.view(B, -1, P), annotations).view(-1, E)  # a_{s_t}
        if self.position is not None:
            context = context + weights @ self.position  # sum_i w_i (a_i + p_i): (N,P) @ (P,E)
        if self.f_beta is not None:
            context = torch.sigmoid(self.f_beta(h)) * context  # z_t = beta_t * context: (N,1 or E) * (N,E)
        return (context, alpha, location) if sample else (context, alpha)

    def update(self, tokens: torch.Tensor, context: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        """The second half of a step: the LSTM and the deep output layer -> logits (N,V), the new state (N,D)x2.
        Each row depends on its own inputs only, so beam search runs it on the hypotheses still being written."""
        y, state = self.recur(tokens, context, state)
        return self.output(y, state[0], context), state

    def recur(self, tokens: torch.Tensor, context: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        """The LSTM: y_{t-1} (N,), z_t (N,E), state -> the embedded words E y_{t-1} (N,M) and the new state."""
        y = self.embedding(tokens)  # (N,M)
        return y, self.lstm(torch.cat([y, context], dim=1), state)

    def output(self, y: torch.Tensor, h: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """The deep output layer (eq. 7): E y_{t-1} (N,M), h_t (N,D), z_t (N,E) -> logits (N,V)."""
        return self.L_o(self.dropout(y + self.L_h(h) + self.L_z(context)))

    def forward(
        self,
        annotations: torch.Tensor,
        captions: torch.Tensor,
        lengths: torch.Tensor | None = None,
        sample: bool = False,
        locations: torch.Tensor | None = None,
        captions_per_image: int = 1,
    ) -> tuple[torch.Tensor, ...]:
        """Teacher forcing, in one of two forms that compute the same on every real word:
        - with `lengths`, the shrinking batch (the CPU's: fewest FLOPs, 1.18x faster there, docs/benchmarks.md). The
          batch is sorted by length and each step runs only the captions still going; padded steps compute nothing
          and their outputs are zero.
        - without (the GPU's, `ShowAttendTell.compile_training_step`), fixed shapes: every caption runs all T-1 steps,
          in the batch's order; padded steps' alphas and locations are zeroed, their logits left as computed (the loss
          ignores them). Nothing depends on the data but the values: no host sync, one shape per (B,T), so the step
          can be compiled whole and captured as a CUDA graph. The LSTM fed a padding word after a caption's end
          changes no earlier step; the real words are `captions[:, 1:] != pad`.

        Args:
            annotations: (B,P,E); with `captions_per_image` k > 1 (fixed shapes only), (B/k,P,E): captions k*i to
                k*i+k-1 are image i's, and each image's keys are projected once and attended by its k captions (the
                shrinking batch sorts captions by length, which mixes images: give it each caption's row).
            captions: (B,T) token ids, `<start> w1 ... wn <end>` then padding.
            lengths: (B,) real length of each caption, <start> and <end> included; None: fixed shapes.
            sample: hard attention: each step attends to one sampled location (`attend`).
            locations: with `sample`, (B,T-1) locations to take as drawn instead of drawing them (tests).

        Returns:
            logits (B,T-1,V) predicting captions[:, 1:], alphas (B,T-1,P) and, with `sample`, the sampled locations
            (B,T-1) (0 at padded steps).
        """
        B, T = captions.size(0), captions.size(1) - 1
        P = annotations.size(1)
        if lengths is not None and captions_per_image != 1:
            raise ValueError(
                f"{captions_per_image} captions an image need fixed shapes (lengths=None): the shrinking batch sorts "
                "captions by length, which mixes images; repeat each image's annotations for it instead"
            )
        if captions_per_image * annotations.size(0) != B:
            raise ValueError(f"{B} captions for {annotations.size(0)} images at {captions_per_image} an image")
        if lengths is not None:
            steps = lengths.to(annotations.device) - 1  # (B,) words to predict, <end> included
            order = steps.argsort(descending=True)
            steps, annotations, captions = steps[order], annotations[order], captions[order]
            locations = locations[order] if locations is not None else None
            T = int(steps[0])
            running = torch.bincount(steps, minlength=T + 1).flip(0).cumsum(0).flip(0)  # running[t] = #(steps > t-1)
        keys = self.prepare(annotations)  # (B/k,P,K): once per image
        h, c = self.init_state(annotations)  # (B/k,D) each
        if captions_per_image > 1:  # each image's start, for each of its captions: (B,D)
            h, c = (x.repeat_interleave(captions_per_image, dim=0, output_size=B) for x in (h, c))
        memory, rows = annotations, []  # each step's (E y_{t-1}, h_t, z_t, alpha_t[, s_t]), for the captions going
        for t in range(T):
            bt = int(running[t + 1]) if lengths is not None else B  # captions with more than t steps: the first bt
            if bt < h.size(0):  # shrink only when a caption ends: a slice costs a full-size zero-fill in backward
                h, c, memory, keys = h[:bt], c[:bt], memory[:bt], keys[:bt]
            location = locations[:bt, t] if sample and locations is not None else None
            context, alpha, *location = self.attend(h, memory, keys, sample, location)
            y, (h, c) = self.recur(captions[:bt, t], context, (h, c))
            rows.append((y, h, context, alpha, *location))
        if lengths is None:
            y, h, context, alpha, *location = (torch.stack(parts, dim=1) for parts in zip(*rows, strict=True))
            real = captions[:, 1:] != self.embedding.padding_idx  # (B,T-1)
            return self.output(y, h, context), alpha * real.unsqueeze(-1), *(s * real for s in location)
        # The output layer once, on the real words of all steps: larger matmuls than one call per step. Then each
        # word goes to its (step, caption) place; padding stays zero.
        y, h, context, alpha, *location = (torch.cat(parts) for parts in zip(*rows, strict=True))  # (words,.)
        real = torch.arange(T, device=steps.device).unsqueeze(1) < steps.unsqueeze(0)  # (T,B), in the loop's order
        logits = annotations.new_zeros(T, B, self.vocab_size)
        logits[real] = self.output(y, h, context).to(logits.dtype)  # autocast may give another dtype
        alphas = annotations.new_zeros(T, B, P)
        alphas[real] = alpha.to(alphas.dtype)
        outputs = [logits, alphas]  # (T,B,V), (T,B,P)
        if sample:
            outputs.append(steps.new_zeros(T, B))
            outputs[-1][real] = location[0]  # (T,B)
        inverse = order.argsort()
        return tuple(x.transpose(0, 1)[inverse] for x in outputs)

    def compile_search(self, **options) -> AttentionDecoder:
        """Compile the searches' work at fixed shapes with `torch.compile(**options)`: `step`, in place, and through
        `compiled_function` each sync-free search's run of words between two reads of whether every caption has ended
        (`captioner.models.decoding`: the steps, the choices of words and, in beam search, the beams' reordering, for
        `check_every` words: one graph, on CUDA one CUDA graph, rather than a few dozen operations a word launched one
        by one). Each call's outputs are copies (`compile_function`), so that a CUDA graph's next replay cannot
        overwrite the state that the next call takes.

        Static shapes by default: a graph per shape (the number of images, the beam size, the words per call, whether
        the call holds the search's first word, and the powers of two below the number of images that beam search's
        batch shrinks to as images end), compiled at its first call and then run with no recompiling whatever the
        images or the captions' lengths. With `mode="reduce-overhead"` (on CUDA, `Captioner`'s choice) each graph is
        captured as a CUDA graph and replayed. The searches run sync-free with a compiled decoder: the shrinking
        batch's shapes change with the data, and would compile at every new shape. Not in the paper, and off by
        default: `Captioner.load(..., compile_decoder=True)` turns it on for captioning (docs/benchmarks.md). On a
        CPU, Inductor needs a C++ compiler. Returns the decoder; calling it again does nothing."""
        if not self.compiled:
            self._compile_options = {"dynamic": False} | options
            self._compiled_functions: dict = {}
            self.step = compile_function(self.step, **self._compile_options)  # an instance attribute hides the method
            self.compiled = True
        return self

    def compiled_function(self, function):
        """`function` compiled with `compile_search`'s options (once per decoder and function), or `function` itself
        when this decoder is not compiled."""
        if not self.compiled:
            return function
        if function not in self._compiled_functions:
            self._compiled_functions[function] = compile_function(function, **self._compile_options)
        return self._compiled_functions[function]
