"""Caption generation speed on annotations (images/s): greedy and beam 3, for one image and for 64 at once, at the
shapes sizes and the paper's; and what compiling the decoder's step gives (`Captioner.load(..., compile_decoder=True)`,
`AttentionDecoder.compile_steps`: fixed shapes, sync-free search) against the default search on this device.

    python benchmarks/decode.py                   # every table
    python benchmarks/decode.py --compiled-only   # the last: eager against compiled

A random decoder that never writes <end> writes 16 words for every image, under torch.inference_mode as Captioner
decodes. Each figure is the median of several timed calls, after untimed ones (for the compiled rows, the calls that
compile). The first table's batch-64 beam-3 rows are the figures to compare across versions.
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch
from common import SIZES, SPECIAL, annotations, machine, random_decoder, table, timed

from captioner.models.decoding import beam_search, greedy_search

MAX_LEN = 16


def images_per_second(
    decoder, size: str, batch: int, beam: int, warmup: int = 1, sync_free: bool | None = None
) -> float:
    a = annotations(size, batch)

    def search():
        if beam == 1:
            return greedy_search(decoder, a, max_len=MAX_LEN, sync_free=sync_free, **SPECIAL)
        return beam_search(decoder, a, beam_size=beam, max_len=MAX_LEN, sync_free=sync_free, **SPECIAL)

    with torch.inference_mode():
        seconds = timed(search, calls=9 if batch == 1 else 5, warmup=warmup)
    return batch / seconds


def bundled_table(forms: dict[str, dict], title: str) -> str:
    """The bundled model on 64 shapes test images, whose captions end at different words, searched in each of `forms`
    (name -> the model and generate's options), which take turns over three rounds; the last is compared with the
    first."""
    from captioner import Captioner
    from captioner.data.shapes import ShapesDataset

    model = Captioner.load("shapes").model
    test = ShapesDataset("test", 64, seed=0)
    transform = model.encoder.preprocessing.transforms()
    with torch.inference_mode():
        a = model.annotate(torch.stack([transform(test.load_image(i)) for i in range(len(test))]))  # (64,P,E)
    rows = []
    for beam in (1, 3):
        for batch in (1, 64):
            images = [a[i : i + 1] for i in range(64)] if batch == 1 else [a]  # one call per image, or one for all
            rates = {form: [] for form in forms}
            with torch.inference_mode():
                for m, options in forms.values():  # untimed: compiles a compiled model's shapes
                    for x in images[:2]:
                        m.generate(annotations=x, beam_size=beam, **options)
                for _ in range(3):  # the forms take turns
                    for form, (m, options) in forms.items():
                        calls, kwargs = itertools.cycle(images), {"beam_size": beam, **options}
                        seconds = timed(lambda c=calls, m=m, k=kwargs: m.generate(annotations=next(c), **k), calls=9)
                        rates[form].append(batch / seconds)
            medians = {form: statistics.median(values) for form, values in rates.items()}
            first, last = medians[next(iter(forms))], medians[list(forms)[-1]]
            row = {"search": "greedy" if beam == 1 else f"beam {beam}", "batch": batch}
            row |= {form: f"{value:.1f}" for form, value in medians.items()} | {"ratio": f"{last / first:.2f}x"}
            rows.append(row)
    return f"{title}, median of 3 rounds\n\n{table(rows)}"


def sync_free_table() -> str:
    """The shrinking search (the CPU's default) against the sync-free one (CUDA's), which runs every caption to the
    last one's end, reading whether all have ended every CHECK_EVERY words as on a GPU."""
    from captioner import Captioner

    model = Captioner.load("shapes").model
    forms = {"shrinking": (model, {"sync_free": False}), "sync-free": (model, {"sync_free": True, "check_every": 8})}
    title = "the bundled model on 64 shapes test images, images/s: shrinking (the CPU's default) and sync-free (CUDA's)"
    return bundled_table(forms, title)


def compiled_table() -> str:
    """`Captioner.load("shapes")` against `Captioner.load("shapes", compile_decoder=True)`, each searching as it does
    by default on this device."""
    from captioner import Captioner

    forms = {
        "eager (default)": (Captioner.load("shapes").model, {}),
        "compile_decoder": (Captioner.load("shapes", compile_decoder=True).model, {}),
    }
    return bundled_table(forms, "the bundled model on 64 shapes test images, images/s: eager and compile_decoder")


def random_compiled_table() -> str:
    """Random decoders at both sizes: eager (this device's default search) against `compile_steps` (the word compiled
    at fixed shapes, sync-free search), taking turns over three rounds."""
    rows = []
    for size in SIZES:
        eager, compiled = random_decoder(size), random_decoder(size).compile_steps()
        for beam, batch in itertools.product((1, 3), (1, 64)):
            images_per_second(compiled, size, batch, beam, warmup=3)  # compiles: one or two graphs per shape
            rates = {"eager": [], "compiled": []}
            for _ in range(3):  # the two take turns, so that a slow spell of the machine hits both
                rates["eager"].append(images_per_second(eager, size, batch, beam))
                rates["compiled"].append(images_per_second(compiled, size, batch, beam))
            before, after = (statistics.median(rates[name]) for name in ("eager", "compiled"))
            rows.append(
                {
                    "sizes": size,
                    "search": "greedy" if beam == 1 else f"beam {beam}",
                    "batch": batch,
                    "eager (default)": f"{before:.1f}",
                    "compiled": f"{after:.1f}",
                    "gain": f"{after / before:.2f}x",
                }
            )
    return (
        "images/s: the decoder eager (this device's default search) and compiled with torch.compile at fixed shapes "
        f"(sync-free search), median of 3 rounds\n\n{table(rows)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compiled-only", action="store_true", help="only the last table (eager against compiled)")
    args = parser.parse_args()
    print(f"# decode.py on {machine()}\n")
    if not args.compiled_only:
        rows = []
        for size in SIZES:
            decoder = random_decoder(size)
            for beam in (1, 3):
                single, batched = (images_per_second(decoder, size, batch, beam) for batch in (1, 64))
                search = "greedy" if beam == 1 else f"beam {beam}"
                rows.append({"sizes": size, "search": search, "batch 1": f"{single:.1f}", "batch 64": f"{batched:.1f}"})
        print("images/s\n")
        print(table(rows))
        print("\n" + sync_free_table())
        print("\n" + compiled_table() + "\n")
    print(random_compiled_table())


if __name__ == "__main__":
    main()
