"""A fused decoding step, measured and not adopted: what merging the decoder's small operations would give.

    python benchmarks/fused_step.py

The library's step (captioner/models/decoder.py) runs each map of the paper as its own module, as the paper writes
it. `FusedDecoder` below computes the same function with fewer, larger operations:

- one matmul for everything that reads h_{t-1}: the LSTM's W_hh, the scorer's U and the gate's f_beta;
- one matmul for everything that reads z_t: the LSTM's W_ih (which also reads y) and the output layer's L_z (with a
  zero block for y);
- the scorer's factor 2 (tanh(x) = 2 sigmoid(2x) - 1) folded into the keys and into U, which removes one pass over
  the (B,G,P,A) tensor;
- the gate beta applied to alpha (B,G,P) before the context bmm, instead of to the context (B,G,E).

The merged weights are built by `prepare`, once per search call, and that time is counted. It covers the default
decoder only (additive scoring, scalar gate), with or without the position embedding. It always uses the scorer's
sigmoid form, which the library uses on AMD CPUs only (captioner.models.attention): on other CPUs the comparison
also sets the library's tanh form against the sigmoid one.

First table: beam 3 in decode.py's setting (random decoder, `<end>` suppressed, 16 steps) at batch 1 and 64, the
library's step against the fused one; three rounds in which the two take turns, the same number of calls for each;
fastest and median call. Second: the bundled shapes model on 64 test images, beam 3: how many captions are identical,
and the largest difference in the log-probabilities of one step. The fused step replaces a whole step only: in the steps
where some hypotheses have ended, beam search runs the decoder's `attend` and `update` instead (captioner.decoding),
which here are the library's, so the one-step comparison is what checks the fused arithmetic.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F
from common import SIZES, machine, result, table
from decode import MAX_LEN, bundled_model_inputs, call_seconds, random_decoder

from captioner.decoding import beam_search
from captioner.models.attention import AdditiveAttention
from captioner.models.decoder import AttentionDecoder
from captioner.models.onednn import linear

ROUNDS = 3


class FusedDecoder(AttentionDecoder):
    """The same decoder, with the inference step described in the module docstring (inference only)."""

    @classmethod
    def of(cls, decoder: AttentionDecoder) -> FusedDecoder:
        """A FusedDecoder with the parameters of `decoder` (shared, not copied)."""
        assert isinstance(decoder.attention, AdditiveAttention) and decoder.f_beta.out_features == 1
        fused = cls.__new__(cls)
        fused.__dict__.update(decoder.__dict__)
        return fused

    def prepare(self, annotations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        annotations, keys = super().prepare(annotations)
        att, lstm, D = self.attention, self.lstm, self.lstm.hidden_size
        M, A = self.embedding.embedding_dim, att.U.out_features
        self.sizes = (D, A)
        self.h_weight = torch.cat([lstm.weight_hh, 2 * att.U.weight, self.f_beta.weight])  # (4D+A+1, D)
        self.h_bias = torch.cat([lstm.bias_hh, lstm.bias_hh.new_zeros(A), self.f_beta.bias])
        L_z = torch.cat([self.L_z.weight.new_zeros(M, M), self.L_z.weight], dim=1)  # (M, M+E): zero for y
        self.z_weight = torch.cat([lstm.weight_ih, L_z])  # (4D+M, M+E)
        self.z_bias = torch.cat([lstm.bias_ih, self.L_z.bias])
        self.v2 = 2 * att.v.weight.squeeze(0)  # (A,)
        self.v_shift = att.v.bias - att.v.weight.sum()  # (1,)
        return annotations, 2 * keys

    def step(self, tokens, state, annotations, keys):
        (h, c), (D, A) = state, self.sizes
        B, P, E = annotations.shape
        N = h.size(0)
        G = N // B
        y = self.embedding(tokens)  # (N,M)
        from_h = linear(h, self.h_weight, self.h_bias)  # (N, 4D+A+1)
        uh = from_h[:, 4 * D : 4 * D + A].view(B, G, A)  # 2 U h
        step = max(1, self.attention.chunk_elements // (G * P * A))
        pieces = [
            (keys[i : i + step].unsqueeze(1) + uh[i : i + step].unsqueeze(2)).sigmoid_() @ self.v2
            for i in range(0, B, step)
        ]  # (b,G,P) each
        alpha = F.softmax((pieces[0] if len(pieces) == 1 else torch.cat(pieces)) + self.v_shift, dim=-1)  # (B,G,P)
        gated = alpha * torch.sigmoid(from_h[:, 4 * D + A :]).view(B, G, 1)  # beta * alpha
        context = torch.bmm(gated, annotations).view(N, E)  # z = beta * sum_i alpha_i a_i
        if self.position is not None:
            context = context + gated.view(N, P) @ self.position
        from_z = linear(torch.cat([y, context], dim=1), self.z_weight, self.z_bias)  # (N, 4D+M)
        i, f, g, o = from_z[:, : 4 * D].add_(from_h[:, : 4 * D]).chunk(4, dim=1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        logits = self.L_o(y + self.L_h(h) + from_z[:, 4 * D :])
        return logits, (h, c), alpha.view(N, P)

    def attend(self, h, annotations, keys):
        """The library's attention half of a step, on this class's keys (2 W a: halving them is exact)."""
        return super().attend(h, annotations, keys / 2)


def speed(sizes: str) -> tuple[list[dict], dict]:
    P, E = SIZES[sizes][:2]
    library = random_decoder(sizes)
    decoders = {"library": library, "fused": FusedDecoder.of(library)}
    inputs = {batch: torch.randn(batch, P, E) for batch in (1, 64)}
    times = {(name, batch): [] for name in decoders for batch in inputs}
    for _ in range(ROUNDS):
        for batch, batch_inputs in inputs.items():
            for name, decoder in decoders.items():
                times[name, batch] += call_seconds(decoder, batch_inputs, beam=3)
    rows, figures = [], {}
    for (name, batch), seconds in times.items():
        figures[name, batch] = min(seconds), statistics.median(seconds)
        rows.append(
            {
                "sizes": sizes,
                "step": name,
                "batch": batch,
                "images/s, fastest call": f"{batch / min(seconds):.1f}",
                "images/s, median call": f"{batch / statistics.median(seconds):.1f}",
            }
        )
    return rows, figures


def agreement(batch: int = 64) -> dict:
    model, annotations, special = bundled_model_inputs(batch)
    library, fused = model.decoder, FusedDecoder.of(model.decoder)
    with torch.inference_mode():
        outputs = [beam_search(d, annotations, beam_size=3, max_len=30, **special) for d in (library, fused)]
        tokens = torch.full((batch,), model.start_index)
        steps = []
        for decoder in (library, fused):
            a, keys = decoder.prepare(annotations)
            logits, _, _ = decoder.step(tokens, decoder.init_state(annotations), a, keys)
            steps.append(F.log_softmax(logits, dim=-1))
    same = sum(
        x[: int(n)].tolist() == y[: int(m)].tolist()
        for x, y, n, m in zip(outputs[0].tokens, outputs[1].tokens, outputs[0].lengths, outputs[1].lengths, strict=True)
    )
    difference = (steps[0] - steps[1]).abs().max()
    return {"same captions": f"{same}/{batch}", "largest log-prob difference": f"{difference:.1e}"}


def main() -> None:
    rows, figures = [], {}
    for sizes in ("shapes", "paper"):
        sizes_rows, sizes_figures = speed(sizes)
        rows += sizes_rows
        figures.update({(sizes, *key): value for key, value in sizes_figures.items()})
    print(f"beam 3, {MAX_LEN} steps, {ROUNDS * 4} timed calls per configuration; {machine()}\n")
    print(table(rows))
    check = agreement()
    print("\nbundled shapes model, 64 test images, beam 3:\n" + table([check]))

    def gain(sizes, batch, which=0):
        return figures[sizes, "library", batch][which] / figures[sizes, "fused", batch][which]

    def ratio(sizes, name):
        return 64 * figures[sizes, name, 1][0] / figures[sizes, name, 64][0]

    print(
        "\n"
        + result(
            shapes_b1_speedup=f"{gain('shapes', 1):.2f}",
            shapes_b64_speedup=f"{gain('shapes', 64):.2f}",
            shapes_b1_speedup_median=f"{gain('shapes', 1, 1):.2f}",
            shapes_b64_speedup_median=f"{gain('shapes', 64, 1):.2f}",
            paper_b1_speedup=f"{gain('paper', 1):.2f}",
            paper_b64_speedup=f"{gain('paper', 64):.2f}",
            shapes_beam3_b64_over_b1_library=f"{ratio('shapes', 'library'):.1f}",
            shapes_beam3_b64_over_b1_fused=f"{ratio('shapes', 'fused'):.1f}",
            same_captions=check["same captions"],
        )
    )


if __name__ == "__main__":
    main()
