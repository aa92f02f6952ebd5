"""The additive scorer, v . tanh(W a + U h): the textbook form against captioner's two forms.

    python benchmarks/attention.py

captioner updates the one (B,G,P,A) tensor of the step in place, and while decoding builds it a few images at a time
(captioner.models.attention.AdditiveAttention.score), computing either v . tanh(x) + b ("tanh" form) or the same
function as 2v . sigmoid(2x) + b - sum(v) ("sigmoid" form); which is the default depends on the CPU. This times one
scoring call each way: while decoding (batch 64, beam 3, inference mode) and while training (batch 64, forward +
backward). The forms take turns over three rounds; each figure is the fastest round's median call. The RESULT line
gives the speed-up of this CPU's default form over the textbook, and of the tanh form over the sigmoid form.

A second table does the same under CPU autocast to bfloat16 (bf16-mixed), where captioner computes everything but
the matmuls W a and U h in float32 (`AdditiveAttention.float32_under_cpu_autocast`): that, in this CPU's default
form, against plain autocast, which computes it all in bfloat16, in either form. Its RESULT keys start with bf16_.

A third table asks the same of whole steps rather than the scorer alone: bf16-mixed training steps (train_step.py's,
over its cycle of batches) and beam-3 searches (decode.py's, at batch 1 and 64) with the scorer in float32 and with
plain autocast, the two settings taking turns over ROUNDS rounds; each figure is the fastest round's median. It also
counts how many of the bundled shapes model's beam-3 captions of 256 test images are the same as float32's under
each setting. Its RESULT keys start with bf16_step_ and bf16_same_captions_.

On a CPU without native bfloat16 the second and third tables are left out unless BENCH_BF16=1
(common.bf16_timed_on_cpu): there they time oneDNN's emulation of bfloat16, and took most of this script's time.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
from unittest.mock import patch

import torch
from common import (
    SIZES,
    TextbookAdditiveAttention,
    bf16_skipped,
    bf16_timed_on_cpu,
    machine,
    result,
    same_bundled_captions,
    samples,
    table,
    timed,
)
from decode import call_seconds, random_decoder
from train_step import BATCHES, trainer

from captioner.models.attention import FORMS, AdditiveAttention
from captioner.models.decoder import AttentionDecoder
from captioner.runtime import cpu_vendor, keep_freed_memory, keep_more_onednn_kernels

BATCH = 64
ROUNDS = 3
RESULT_USES = (("decode, beam 3", "decode"), ("train", "train"))  # the tables' uses and their RESULT names


def milliseconds(attention, keys, h, train: bool, bf16: bool = False) -> float:
    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            if train:
                attention.score(keys, h).sum().backward()
            else:
                with torch.inference_mode():
                    attention.score(keys, h)

    return 1e3 * timed(run, repeats=30, warmup=3)


def bf16_table() -> tuple[list[dict], dict]:
    """Under bf16 autocast: captioner's float32 scorer (default form) against plain autocast in either form."""
    rows, figures = [], {}
    default = AdditiveAttention.form
    for sizes in ("shapes", "paper"):
        P, E, D, A, _, _ = SIZES[sizes]
        torch.manual_seed(0)
        attention = AdditiveAttention(E, D, A)
        for mode, G in (("decode, beam 3", 3), ("train", 1)):
            train = mode == "train"
            with torch.autocast("cpu", dtype=torch.bfloat16):  # keys as `project` gives them: bfloat16 when plain
                keys = {
                    flag: attention.W(torch.randn(BATCH, P, E)).to(torch.float32 if flag else torch.bfloat16).detach()
                    for flag in (True, False)
                }
            h = torch.randn(BATCH, G, D)
            for k in keys.values():
                k.requires_grad_(train)
            ways = {("float32", default): True, ("bfloat16", "tanh"): False, ("bfloat16", "sigmoid"): False}
            ms = dict.fromkeys(ways, float("inf"))
            for _ in range(ROUNDS):
                for (dtype, form), flag in ways.items():
                    attention.form, attention.float32_under_cpu_autocast = form, flag
                    ms[dtype, form] = min(ms[dtype, form], milliseconds(attention, keys[flag], h, train, bf16=True))
            ours, plain = ms["float32", default], ms["bfloat16", default]
            figures[sizes, mode] = (plain / ours, min(ms["bfloat16", "tanh"], ms["bfloat16", "sigmoid"]) / ours)
            rows.append(
                {
                    "sizes": sizes,
                    "use": mode,
                    f"float32 ({default}) ms": f"{ours:.2f}",
                    "bfloat16 tanh ms": f"{ms['bfloat16', 'tanh']:.2f}",
                    "bfloat16 sigmoid ms": f"{ms['bfloat16', 'sigmoid']:.2f}",
                    f"float32 over bfloat16 ({default})": f"{figures[sizes, mode][0]:.2f}x",
                    "over the faster bfloat16": f"{figures[sizes, mode][1]:.2f}x",
                }
            )
    return rows, figures


def median_step(step, batches: int) -> float:
    """Median seconds of a pass of training steps over train_step.py's cycle of `batches` batches."""
    return statistics.median(samples(step, batches, warmup=0))


def median_search(decoder, annotations: torch.Tensor, calls: int) -> float:
    """Median seconds of `calls` bf16-mixed beam-3 searches, as decode.py times them."""
    return statistics.median(call_seconds(decoder, annotations, 3, "bf16-mixed", calls=calls))


def float32_scorer(flag: bool):
    """AdditiveAttention.float32_under_cpu_autocast set to `flag` inside the block."""
    return patch.object(AdditiveAttention, "float32_under_cpu_autocast", flag)


@contextlib.contextmanager
def bf16_captioner(flag: bool, captioner):
    """The captioner in bf16-mixed inside the block, its scorer in float32 (flag True) or under plain autocast."""
    with float32_scorer(flag), patch.object(captioner, "precision", "bf16-mixed"):
        yield


STEP_USES = {"train": "train, batch 64", "beam3_b1": "beam 3, batch 1", "beam3_b64": "beam 3, batch 64"}


def bf16_step_table() -> tuple[list[dict], dict]:
    """Whole bf16-mixed training steps and beam-3 searches, with the scorer in float32 and under plain autocast."""
    settings = (True, False)
    rows, figures = [], {}
    for sizes in ("shapes", "paper"):
        P, E = SIZES[sizes][:2]
        batches = BATCHES[sizes]
        step = trainer(AttentionDecoder, sizes, "cpu", "bf16-mixed", batches)
        decoder = random_decoder(sizes)
        runs = {
            "train": functools.partial(median_step, step, batches),
            "beam3_b1": functools.partial(median_search, decoder, torch.randn(1, P, E), calls=12),
            "beam3_b64": functools.partial(median_search, decoder, torch.randn(64, P, E), calls=3),
        }
        for flag in settings:  # an untimed pass of each, so both settings start with their kernels built
            with float32_scorer(flag):
                for run in runs.values():
                    run()
        seconds = {(use, flag): float("inf") for use in runs for flag in settings}
        for _ in range(ROUNDS):
            for use, run in runs.items():
                for flag in settings:
                    with float32_scorer(flag):
                        seconds[use, flag] = min(seconds[use, flag], run())
        for use in runs:
            figures[f"{sizes}_{use}"] = ratio = seconds[use, False] / seconds[use, True]
            rows.append(
                {
                    "sizes": sizes,
                    "use": STEP_USES[use],
                    "float32 scorer ms": f"{1e3 * seconds[use, True]:.1f}",
                    "plain autocast ms": f"{1e3 * seconds[use, False]:.1f}",
                    "float32 scorer over plain": f"{ratio:.2f}x",
                }
            )
    for flag, name in ((True, "float32"), (False, "plain")):
        figures[f"same_{name}"] = same_bundled_captions(
            lambda _: contextlib.nullcontext(), functools.partial(bf16_captioner, flag), n=256, batch_size=64
        )
    return rows, figures


def main() -> None:
    keep_freed_memory()  # as the `captioner` command starts: bf16-mixed training needs the room for oneDNN kernels
    keep_more_onednn_kernels()
    rows, figures = [], {}
    for sizes in ("shapes", "paper"):
        P, E, D, A, _, _ = SIZES[sizes]
        torch.manual_seed(0)
        captioner = AdditiveAttention(E, D, A)
        textbook = TextbookAdditiveAttention(E, D, A)
        textbook.load_state_dict(captioner.state_dict())
        for mode, G in (("decode, beam 3", 3), ("train", 1)):
            train = mode == "train"
            keys = torch.randn(BATCH, P, A, requires_grad=train)
            h = torch.randn(BATCH, G, D, requires_grad=train)
            ms = {name: float("inf") for name in ("textbook", *FORMS)}
            for _ in range(ROUNDS):
                ms["textbook"] = min(ms["textbook"], milliseconds(textbook, keys, h, train))
                for form in FORMS:
                    captioner.form = form
                    ms[form] = min(ms[form], milliseconds(captioner, keys, h, train))
            default = AdditiveAttention.form
            figures[sizes, mode] = (ms["textbook"] / ms[default], ms["sigmoid"] / ms["tanh"])
            rows.append(
                {
                    "sizes": sizes,
                    "use": mode,
                    "textbook ms": f"{ms['textbook']:.2f}",
                    "tanh form ms": f"{ms['tanh']:.2f}",
                    "sigmoid form ms": f"{ms['sigmoid']:.2f}",
                    f"default ({default}) over textbook": f"{figures[sizes, mode][0]:.1f}x",
                    "tanh over sigmoid": f"{figures[sizes, mode][1]:.2f}x",
                }
            )
    vendor = cpu_vendor() or "unknown"
    print(f"one scoring call, batch {BATCH}; {machine()}; vendor {vendor}, default form {AdditiveAttention.form}\n")
    print(table(rows))
    values = {
        "default_form": AdditiveAttention.form,
        **{
            f"{sizes}_{short}_speedup": f"{figures[sizes, mode][0]:.1f}"
            for sizes in ("shapes", "paper")
            for mode, short in RESULT_USES
        },
        **{
            f"{sizes}_{short}_tanh_over_sigmoid": f"{figures[sizes, mode][1]:.2f}"
            for sizes in ("shapes", "paper")
            for mode, short in RESULT_USES
        },
    }
    if bf16_timed_on_cpu():
        values.update(bf16_tables())
    else:
        print(f"\n{bf16_skipped()}")
    print(result(**values))


def bf16_tables() -> dict[str, str]:
    """Print the second and third tables; their RESULT figures."""
    bf16_rows, bf16 = bf16_table()
    print("\nthe same under CPU autocast to bfloat16 (bf16-mixed)\n")
    print(table(bf16_rows))
    step_rows, steps = bf16_step_table()
    print(
        f"\nwhole bf16-mixed steps, the scorer in float32 against plain autocast (default here: "
        f"{'float32' if AdditiveAttention.float32_under_cpu_autocast else 'plain'}); the bundled model's beam-3 "
        f"captions of 256 images the same as float32's: {steps['same_float32']} with the float32 scorer, "
        f"{steps['same_plain']} with plain autocast\n"
    )
    print(table(step_rows))
    return {
        **{
            f"bf16_{sizes}_{short}_float32_speedup": f"{bf16[sizes, mode][0]:.2f}"
            for sizes in ("shapes", "paper")
            for mode, short in RESULT_USES
        },
        **{
            f"bf16_step_{key}_float32_speedup": f"{value:.2f}"
            for key, value in steps.items()
            if not key.startswith("same")
        },
        "bf16_same_captions_float32": steps["same_float32"],
        "bf16_same_captions_plain": steps["same_plain"],
    }


if __name__ == "__main__":
    main()
