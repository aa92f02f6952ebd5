"""Does torch.compile help? Greedy decoding and a teacher-forced training step, eager vs the library's option,
`AttentionDecoder.compile_steps()` (`compile_decoder=True` in CaptioningModule and Captioner).

    python benchmarks/compile_step.py

Shapes sizes, batch 64, 16 decoding steps. The option compiles the decoder's per-word methods with dynamic shapes:
`step` (one graph, with the methods it calls), which the searches call, `attend` and `update`, which beam search calls
instead once a hypothesis has ended, and `attend`, `recur` and `output`, which teacher forcing calls (`output` once
for all words). The loops stay in Python. Compilation time is reported separately from the steady-state time.

A second table times decoding alone, greedy and beam 3 at batch 1 and 64 (`decode.py`'s setting), for four
variants: eager; `compile_steps()`; `compile_steps(options={"freezing": True})`, Inductor's option that treats the
weights as constants (safe under `torch.inference_mode`, where they cannot change, but not for training) so that it
can pre-pack them for oneDNN and fold them into its kernels; and `step` alone compiled with static shapes
(`dynamic=False`: one graph per batch size), as this script compiled it before the option existed. The variants and
batch sizes take turns over three rounds with the same number of calls each; every compiled variant is checked to
write the same captions as eager.

A third table does the same with the bundled shapes model on 64 test images, where captions end at different steps,
so the batch shrinks and the step meets many shapes: eager against `compile_steps()`.
"""

from __future__ import annotations

import copy
import time

import torch
from common import SIZES, machine, result, samples, table, timed
from decode import SPECIAL, bundled_model_inputs, search
from train_step import make_batch

from captioner.decoding import greedy_search
from captioner.lit_module import caption_loss
from captioner.models.decoder import RECOMPILE_LIMIT, AttentionDecoder

B, MAX_LEN = 64, 16
ROUNDS, CALLS = 3, 4  # second and third tables: timed calls per round, the same for every variant and setting
# RESULT key prefix -> the decoding table's compiled variant
VARIANT_TAGS = {
    "compiled": "compile_steps()",
    "frozen": "compile_steps(), freezing",
    "static_step": "step alone, static",
}


def build() -> AttentionDecoder:
    _, E, D, A, M, V = SIZES["shapes"]
    torch.manual_seed(0)
    decoder = AttentionDecoder(V, E, embed_dim=M, decoder_dim=D, attention_dim=A, dropout=0.0)
    decoder.L_o.bias.data[2] = -1e4  # never emit <end>: every decode runs MAX_LEN steps
    return decoder


def measure(compiled: bool) -> dict[str, float]:
    decoder = build()
    if compiled:
        decoder.compile_steps()
    P, E, *_, V = SIZES["shapes"]
    annotations = torch.randn(B, P, E)

    def decode():
        with torch.inference_mode():
            greedy_search(decoder.eval(), annotations, max_len=MAX_LEN, **SPECIAL)

    start = time.perf_counter()
    decode()  # the first call compiles
    first = time.perf_counter() - start
    decode_s = timed(decode, repeats=5, warmup=1)

    optimizer = torch.optim.Adam(decoder.parameters(), lr=4e-4)
    features, captions, lengths = make_batch(P, E, V)

    def train():
        decoder.train()
        logits, alphas = decoder(features, captions, lengths)
        loss, _, _ = caption_loss(logits, captions[:, 1 : 1 + logits.size(1)], alphas)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    start = time.perf_counter()
    train()  # compiles again: with autograd, and for the slices of the shrinking batch
    train_first = time.perf_counter() - start
    train_s = timed(train, repeats=3, warmup=1)
    return {"decode_first": first, "decode": decode_s, "train_first": train_first, "train": train_s}


def fresh_dynamo() -> None:
    """Empty dynamo's caches and raise its recompile limit, before each decoding table.

    Each variant and each setting of a method (batch 1 and 64, training, inference; the static step's batch sizes)
    is a cache entry of the same function: more than dynamo's default limit of 8, past which it runs eagerly, and
    than the 32 that compile_steps sets, since all the variants share the decoder's functions.
    """
    torch._dynamo.reset()
    setattr(torch._dynamo.config, RECOMPILE_LIMIT, 64)


def race(variants: dict[str, AttentionDecoder], settings: list[tuple], run) -> tuple[dict, dict, dict]:
    """Times `run(decoder, *setting)` for every variant and setting.

    Returns each variant's seconds for its first call of every setting (where compiling happens), whether its
    captions equal the first variant's (eager) in every setting, and the fastest of ROUNDS * CALLS timed calls per
    (variant, setting), with the settings and variants taking turns in every round.
    """
    first, reference, same = {}, {}, {}
    for name, decoder in variants.items():
        start = time.perf_counter()
        for setting in settings:
            tokens = run(decoder, *setting).tokens
            reference.setdefault(setting, tokens)  # the first variant's
            same[name] = same.get(name, True) and torch.equal(tokens, reference[setting])
        first[name] = time.perf_counter() - start
    seconds = {}
    for _ in range(ROUNDS):
        for setting in settings:
            for name, decoder in variants.items():
                calls = samples(lambda d=decoder, s=setting: run(d, *s), repeats=CALLS)
                seconds.setdefault((name, setting), []).extend(calls)
    return first, same, {key: min(calls) for key, calls in seconds.items()}


def decoding_variants() -> tuple[list[dict], dict[str, float]]:
    """Greedy and beam 3 at batch 1 and 64: eager, compile_steps(), compile_steps with freezing, and `step` alone
    compiled with static shapes (one decoder each)."""
    fresh_dynamo()
    variants = {
        "eager": build().eval(),
        "compile_steps()": build().eval().compile_steps(),
        "compile_steps(), freezing": build().eval().compile_steps(options={"freezing": True}),
        "step alone, static": build().eval(),
    }
    static = variants["step alone, static"]
    static.step = torch.compile(static.step, dynamic=False)
    P, E = SIZES["shapes"][:2]
    torch.manual_seed(1)
    inputs = {64: torch.randn(64, P, E)}
    inputs[1] = inputs[64][:1].clone()
    settings = [(beam, batch) for beam in (1, 3) for batch in (1, 64)]
    first, same, fastest = race(variants, settings, lambda decoder, beam, batch: search(decoder, inputs[batch], beam))

    rows = []
    for name in variants:
        row = {"step": name, "first calls s": f"{first[name]:.1f}"}
        for beam, batch in settings:
            row[f"{'greedy' if beam == 1 else f'beam {beam}'} b{batch}"] = (
                f"{batch / fastest[(name, (beam, batch))]:.1f}"
            )
        row["beam 3 b64 over b1"] = f"{64 * fastest[(name, (3, 1))] / fastest[(name, (3, 64))]:.1f}"
        row["same captions"] = "-" if name == "eager" else ("yes" if same[name] else "NO")
        rows.append(row)
    figures = {
        f"{tag}_{'greedy' if beam == 1 else f'beam{beam}'}_b{batch}_speedup": fastest[("eager", (beam, batch))]
        / fastest[(name, (beam, batch))]
        for tag, name in VARIANT_TAGS.items()
        for beam, batch in settings
    }
    for tag, name in [*VARIANT_TAGS.items(), ("eager", "eager")]:
        figures[f"{tag}_beam3_b64_over_b1"] = 64 * fastest[(name, (3, 1))] / fastest[(name, (3, 64))]
    figures["same_captions"] = all(same.values())
    return rows, figures


def bundled_model_variants() -> tuple[list[dict], dict[str, float]]:
    """Greedy and beam 3 with the bundled model on 64 test images, up to 30 words: eager vs compile_steps()."""
    fresh_dynamo()
    model, annotations, special = bundled_model_inputs(64)
    compiled = copy.deepcopy(model.decoder).compile_steps()
    variants = {"eager": model.decoder, "compile_steps()": compiled}
    first, same, fastest = race(
        variants, [(1,), (3,)], lambda decoder, beam: search(decoder, annotations, beam, max_len=30, special=special)
    )
    rows = [
        {
            "step": name,
            "first calls s": f"{first[name]:.1f}",
            "greedy b64": f"{64 / fastest[(name, (1,))]:.0f}",
            "beam 3 b64": f"{64 / fastest[(name, (3,))]:.0f}",
            "same captions": "-" if name == "eager" else ("yes" if same[name] else "NO"),
        }
        for name in variants
    ]
    figures = {
        f"bundled_{'greedy' if beam == 1 else 'beam3'}_speedup": fastest[("eager", (beam,))]
        / fastest[("compile_steps()", (beam,))]
        for beam in (1, 3)
    }
    figures["bundled_same_captions"] = same["compile_steps()"]
    return rows, figures


def main() -> None:
    eager, compiled = measure(False), measure(True)
    rows = [
        {
            "run": name,
            "greedy b64 first call s": f"{m['decode_first']:.2f}",
            "greedy b64 s": f"{m['decode']:.3f}",
            "train step first call s": f"{m['train_first']:.1f}",
            "train step s": f"{m['train']:.3f}",
        }
        for name, m in (("eager", eager), ("compile_steps()", compiled))
    ]
    print(f"shapes sizes, batch {B}; {machine()}\n")
    print(table(rows))
    decode_rows, figures = decoding_variants()
    print(f"\nDecoding, images/s by the fastest of {ROUNDS * CALLS} calls, shapes sizes, {MAX_LEN} steps\n")
    print(table(decode_rows))
    bundled_rows, bundled = bundled_model_variants()
    print(f"\nThe bundled model on 64 test images, images/s by the fastest of {ROUNDS * CALLS} calls\n")
    print(table(bundled_rows))
    figures.update(bundled)
    print(
        result(
            decode_speedup=f"{eager['decode'] / compiled['decode']:.2f}",
            train_speedup=f"{eager['train'] / compiled['train']:.2f}",
            compile_s=f"{compiled['decode_first'] + compiled['train_first']:.0f}",
            **{k: (f"{v:.2f}" if isinstance(v, float) else v) for k, v in figures.items()},
        )
    )


if __name__ == "__main__":
    main()
