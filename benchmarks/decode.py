"""Caption generation speed on annotations (images/s): greedy and beam 3, for one image and for 64 at once, at the
shapes sizes and the paper's; and what compiling the decoder's step gives (`Captioner.load(..., compile_decoder=True)`,
`AttentionDecoder.compile_steps`: fixed shapes, sync-free search) against the default search on this device.

    python benchmarks/decode.py

A random decoder that never writes <end> writes 16 words for every image, under torch.inference_mode as Captioner
decodes. Each figure is the median of several timed calls, after untimed ones (for the compiled rows, the calls that
compile). The first table's batch-64 beam-3 rows are the figures to compare across versions.
"""

from __future__ import annotations

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


def sync_free_table() -> str:
    """The bundled model on 64 shapes test images, whose captions end at different words: the shrinking search (the
    CPU's default) against the sync-free one (CUDA's default), which runs every caption to the last one's end."""
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
            rates = {"shrinking": [], "sync-free": []}
            with torch.inference_mode():
                for _ in range(3):  # the two take turns
                    for form in rates:
                        calls, options = itertools.cycle(images), {"beam_size": beam, "sync_free": form == "sync-free"}
                        seconds = timed(lambda c=calls, o=options: model.generate(annotations=next(c), **o), calls=9)
                        rates[form].append(batch / seconds)
            shrinking, sync_free = (statistics.median(rates[form]) for form in rates)
            rows.append(
                {
                    "search": "greedy" if beam == 1 else f"beam {beam}",
                    "batch": batch,
                    "shrinking": f"{shrinking:.1f}",
                    "sync-free": f"{sync_free:.1f}",
                    "ratio": f"{sync_free / shrinking:.2f}x",
                }
            )
    title = "the bundled model on 64 shapes test images, images/s: shrinking (the CPU's default) and sync-free (CUDA's)"
    return f"{title}, median of 3 rounds\n\n{table(rows)}"


def main() -> None:
    print(f"# decode.py on {machine()}\n")
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
    print(
        "\nimages/s: the decoder eager (this device's default search) and its step compiled with torch.compile at "
        "fixed shapes (sync-free search), median of 3 rounds\n"
    )
    print(table(rows))


if __name__ == "__main__":
    main()
