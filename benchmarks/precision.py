"""bf16-mixed against float32 for captioning on this CPU: speed, and how many captions change.

    python benchmarks/precision.py

First table: the bundled shapes model on 256 shapes test images, batch 64, beam 3, in the two parts that
`Captioner` (and `captioner caption --precision`) runs: the encoder on preprocessed tensors, then the search on the
annotations it gave (bfloat16 ones under bf16-mixed), each batch in its own `captioner.precision.decoding` block as
`Captioner` runs it. Each figure is the fastest of ROUNDS rounds in which the precisions take turns.
BLEU-4 (nltk, the same as test/bleu4) is against the five references of each image, "same captions" counts the
captions identical to float32's, and "largest |sum alpha - 1|" is how far the attention weights of a generated word
(the overlays' weights) are from summing to 1, at worst.

Second table: decode.py's setting (random decoder, `<end>` suppressed, 16 steps, float32 annotations as from the
feature cache), beam 3 at batch 1 and 64 under each precision, and the per-image gain of batch 64: the fastest of
the same number of calls for each.

On a CPU without native bfloat16, bf16-mixed is left out unless BENCH_BF16=1 (common.bf16_timed_on_cpu): the tables
then give float32 alone, and the second table is one more measurement of decode.py's batching gain.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import torch
from common import SIZES, bf16_skipped, bf16_timed_on_cpu, machine, result, table
from decode import MAX_LEN, call_seconds, random_decoder

from captioner.api import Captioner
from captioner.data.shapes import ShapesDataset
from captioner.data.vocab import tokenize
from captioner.decoding import beam_search
from captioner.metrics import bleu
from captioner.precision import decoding

N, BATCH, BEAM, ROUNDS = 256, 64, 3, 3
PRECISIONS = ("32-true", "bf16-mixed")


def native_bf16() -> str:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "unknown"
    return ", ".join(sorted(flags & {"avx512_bf16", "amx_bf16"})) or "none"


def clock(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def alpha_sum_error(generations: list) -> float:
    """The largest |sum_i alpha_ti - 1| over the words generated (not the padding after each caption's end)."""
    errors = []
    for g in generations:
        words = torch.arange(g.alphas.size(1)) < g.lengths.unsqueeze(1)  # (B,T)
        errors.append((g.alphas.sum(-1) - 1).abs()[words])
    return float(torch.cat(errors).max())


def trained_model(precisions: tuple[str, ...]) -> tuple[list[dict], dict]:
    captioner = Captioner.load("shapes", device="cpu")
    model = captioner.model
    dataset = ShapesDataset("test", N, seed=0)
    batches = torch.stack([captioner.transform(dataset.load_image(i)) for i in range(N)]).split(BATCH)
    references = [[tokenize(text) for text in dataset.captions(i)] for i in range(N)]
    special = {"start_index": model.start_index, "end_index": model.end_index, "pad_index": model.pad_index}

    def encode(precision: str) -> list[torch.Tensor]:
        """The encoder on each batch, in a block of its own, as `Captioner` runs it."""
        encoded = []
        for x in batches:
            with decoding(precision, "cpu"):
                encoded.append(model.annotate(images=x))
        return encoded

    def search(precision: str, encoded: list[torch.Tensor]) -> list:
        out = []
        for a in encoded:
            with decoding(precision, "cpu"):
                out.append(beam_search(model.decoder, a, beam_size=BEAM, **special))
        return out

    encode_s, search_s = dict.fromkeys(precisions, float("inf")), dict.fromkeys(precisions, float("inf"))
    captions, alpha_errors = {}, {}
    for _ in range(ROUNDS):
        for precision in precisions:
            seconds, encoded = clock(partial(encode, precision))
            encode_s[precision] = min(encode_s[precision], seconds)
            seconds, out = clock(partial(search, precision, encoded))
            search_s[precision] = min(search_s[precision], seconds)
            captions[precision] = [captioner.vocab.decode_tokens(t) for g in out for t in g.tokens.tolist()]
            alpha_errors[precision] = alpha_sum_error(out)
    rows = []
    for precision in precisions:
        same = sum(a == b for a, b in zip(captions[precision], captions["32-true"], strict=True))
        rows.append(
            {
                "precision": precision,
                "encoder images/s": f"{N / encode_s[precision]:.1f}",
                "search images/s": f"{N / search_s[precision]:.1f}",
                "both images/s": f"{N / (encode_s[precision] + search_s[precision]):.1f}",
                "BLEU-4": f"{bleu(captions[precision], references):.4f}",
                "same captions": f"{same}/{N}",
                "largest |sum alpha - 1|": f"{alpha_errors[precision]:.1e}",
            }
        )
    if "bf16-mixed" not in precisions:
        return rows, {}
    return rows, {
        "bf16_encoder_speedup": f"{encode_s['32-true'] / encode_s['bf16-mixed']:.2f}",
        "bf16_search_speedup": f"{search_s['32-true'] / search_s['bf16-mixed']:.2f}",
        "bf16_same_captions": rows[1]["same captions"],
        "bf16_alpha_sum_error": rows[1]["largest |sum alpha - 1|"],
    }


def batching_gain(sizes: str, precisions: tuple[str, ...]) -> tuple[list[dict], dict]:
    P, E = SIZES[sizes][:2]
    decoder = random_decoder(sizes)
    inputs = {1: torch.randn(1, P, E), 64: torch.randn(64, P, E)}
    best = {}
    for _ in range(ROUNDS):
        for precision in precisions:
            for batch, encoded in inputs.items():
                seconds = min(call_seconds(decoder, encoded, BEAM, precision))
                best[precision, batch] = min(best.get((precision, batch), float("inf")), seconds)
    rows, gains = [], {}
    for precision in precisions:
        gains[precision] = 64 * best[precision, 1] / best[precision, 64]
        rows.append(
            {
                "sizes": sizes,
                "precision": precision,
                "batch 1 images/s": f"{1 / best[precision, 1]:.1f}",
                "batch 64 images/s": f"{64 / best[precision, 64]:.1f}",
                "batch 64 over batch 1": f"{gains[precision]:.1f}",
            }
        )
    return rows, gains


def main() -> None:
    bf16_timed = bf16_timed_on_cpu()
    precisions = PRECISIONS if bf16_timed else PRECISIONS[:1]
    print(f"{machine()}; native bf16: {native_bf16()}\n")
    if not bf16_timed:
        print(f"{bf16_skipped()}\n")
    rows, values = trained_model(precisions)
    print(f"Bundled shapes model, {N} test images, batch {BATCH}, beam {BEAM}:\n")
    print(table(rows))
    gain_rows = []
    for sizes in ("shapes", "paper"):
        more, gains = batching_gain(sizes, precisions)
        gain_rows += more
        for precision in precisions:
            short = {"32-true": "32", "bf16-mixed": "bf16"}[precision]
            values[f"{sizes}_beam3_b64_over_b1_{short}"] = f"{gains[precision]:.1f}"
    print(f"\nRandom decoder, beam {BEAM}, {MAX_LEN} steps (decode.py's setting):\n")
    print(table(gain_rows))
    print(result(**values))


if __name__ == "__main__":
    main()
