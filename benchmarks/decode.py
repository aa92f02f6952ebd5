"""Caption generation speed on annotations (images/s): greedy and beam 3, one image and 64 at once, at the shapes
sizes and the paper's, in each form the searches have, and against the tutorial's beam search.

    python benchmarks/decode.py                       # every table, on this machine's device (CUDA when present)
    python benchmarks/decode.py --tables tutorial     # some of them, by name (TABLES)
    python benchmarks/decode.py --smoke               # tiny sizes, a call or two: checks the script only

Tables:
- default: a random decoder at both sizes, in this device's default search;
- sync_free: the bundled model on 64 shapes test images (captions that end at different words): the shrinking search
  (the CPU's default) against the sync-free one (CUDA's), which reads whether every caption has ended every 8 words;
- compiled: the bundled model, eager against `compile_decoder=True` (`Captioner.load`), each searching as it does by
  default on this device;
- random_compiled: random decoders at both sizes, eager against compiled (`AttentionDecoder.compile_search`);
- tutorial: beam 3 at the paper's sizes (16 words an image), one image at a time and 64 at once: the tutorial's
  search (one image at a time, its beams shrinking as they end, a device-to-host copy at every word), and captioner's
  sync-free, shrinking and compiled forms (runs of 8 words a graph, the default; and the whole search one graph,
  `check_every=16`), each with whether its captions are the eager search's.

A random decoder never writes <end>, so every image gets 16 words. Each figure is a median of timed calls after
untimed ones (for the compiled forms, the calls that compile); forms measured together take turns call by call.
Compiled forms use CUDA graphs on CUDA (mode="reduce-overhead", as `Captioner` does) and Inductor on a CPU; with
--smoke, Dynamo's graphs under tests/cuda_graphs.py's stand-in (a CUDA graph's output lifetimes, no code generated).
Each row is printed, and written to --out, as soon as it is measured; a form that fails is a row with its error.
"""

from __future__ import annotations

import itertools
import statistics
import sys
from collections.abc import Callable

import torch
from common.harness import Script, one_line, take_turns, timed
from common.synthetic import SIZES, SPECIAL, TINY, annotations, random_decoder
from common.tutorial import tutorial_beam_search

from captioner.models.beam_search import beam_search
from captioner.models.decoding import greedy_search

MAX_LEN = 16
TABLES = ("default", "sync_free", "compiled", "random_compiled", "tutorial")


def compile_options(device: torch.device) -> dict:
    """As `Captioner` compiles: CUDA graphs on CUDA."""
    return {"mode": "reduce-overhead"} if device.type == "cuda" else {}


def search(decoder, a: torch.Tensor, beam: int, **options):
    if beam == 1:
        return greedy_search(decoder, a, max_len=MAX_LEN, **options, **SPECIAL)
    return beam_search(decoder, a, beam_size=beam, max_len=MAX_LEN, **options, **SPECIAL)


def in_turns(forms: dict[str, Callable[[], object]], calls: int, device) -> dict[str, float | BaseException]:
    """The median seconds a call of each form takes, over 3 x `calls` calls, the forms taking turns call by call after
    two untimed calls each (which compile the compiled ones); a form that fails, its error."""
    seconds = take_turns(forms, 3 * calls, warmup=2, device=device)
    return {name: s if isinstance(s, BaseException) else statistics.median(s) for name, s in seconds.items()}


def per_second(seconds: float | BaseException, images: int) -> str:
    return f"error: {one_line(seconds)}" if isinstance(seconds, BaseException) else f"{images / seconds:.1f}"


def default_table(script: Script, sizes: dict, device, calls: dict) -> None:
    rows = script.table("default", "images/s, this device's default search")
    for (size, dims), beam in itertools.product(sizes.items(), (1, 3)):
        decoder = random_decoder(dims).to(device)

        def measure(decoder=decoder, dims=dims, beam=beam):
            row = {}
            for batch in (1, 64):
                a = annotations(dims, batch).to(device)
                with torch.inference_mode():
                    seconds = timed(lambda a=a: search(decoder, a, beam), calls[batch], device=device)
                row[f"batch {batch}"] = f"{batch / seconds:.1f}"
            return row

        rows.measure({"sizes": size, "search": "greedy" if beam == 1 else f"beam {beam}"}, measure)
    rows.finish()


def bundled_table(script: Script, name: str, title: str, forms: dict[str, tuple], device, calls: dict) -> None:
    """The bundled model on 64 shapes test images, searched in each of `forms` (name -> the model and generate's
    options), taking turns; the last form against the first."""
    from captioner import Captioner
    from captioner.data.shapes import ShapesDataset

    model = Captioner.load("shapes", device=device).model
    test = ShapesDataset("test", 64, seed=0)
    transform = model.encoder.preprocessing.transforms()
    with torch.inference_mode():
        a = model.annotate(torch.stack([transform(test.load_image(i)) for i in range(len(test))]).to(device))
    rows = script.table(name, f"{title}, images/s, the median call, the forms taking turns")
    for beam, batch in itertools.product((1, 3), (1, 64)):
        images = [a[i : i + 1] for i in range(64)] if batch == 1 else [a]  # one call per image, or one for all

        def measure(beam=beam, batch=batch, images=images):
            fns = {}
            for form, (m, options) in forms.items():
                calls_of = itertools.cycle(images)
                fns[form] = lambda m=m, c=calls_of, o=options: m.generate(annotations=next(c), beam_size=beam, **o)
            with torch.inference_mode():
                medians = in_turns(fns, calls[batch], device)
            row = {form: per_second(seconds, batch) for form, seconds in medians.items()}
            first, last = medians[next(iter(forms))], medians[list(forms)[-1]]
            if not isinstance(first, BaseException) and not isinstance(last, BaseException):
                row["ratio"] = f"{first / last:.2f}x"
            return row

        rows.measure({"search": "greedy" if beam == 1 else f"beam {beam}", "batch": batch}, measure)
    rows.finish()


def random_compiled_table(script: Script, sizes: dict, device, calls: dict) -> None:
    title = "images/s: eager (this device's default search) and compiled, the median call, taking turns"
    rows = script.table("random_compiled", title)
    for size, dims in sizes.items():
        eager = random_decoder(dims).to(device)
        compiled = random_decoder(dims).to(device).compile_search(**compile_options(device))
        for beam, batch in itertools.product((1, 3), (1, 64)):

            def measure(beam=beam, batch=batch, dims=dims, eager=eager, compiled=compiled):
                a = annotations(dims, batch).to(device)
                forms = {"eager (default)": lambda: search(eager, a, beam)}
                forms["compiled"] = lambda: search(compiled, a, beam)
                with torch.inference_mode():
                    medians = in_turns(forms, calls[batch], device)
                row = {form: per_second(seconds, batch) for form, seconds in medians.items()}
                if not any(isinstance(s, BaseException) for s in medians.values()):
                    row["gain"] = f"{medians['eager (default)'] / medians['compiled']:.2f}x"
                return row

            rows.measure({"sizes": size, "search": "greedy" if beam == 1 else f"beam {beam}", "batch": batch}, measure)
    rows.finish()


def tutorial_table(script: Script, dims: tuple, sizes: str, device, calls: dict) -> None:
    """Beam 3 at `dims`: the tutorial's search against captioner's forms, at batch 1 and 64 (one row per form,
    measured one form at a time so that a failing one costs only its row)."""
    decoder = random_decoder(dims).to(device)
    compiled = random_decoder(dims).to(device).compile_search(**compile_options(device))
    images = annotations(dims, 64).to(device)
    rows = script.table("tutorial", f"beam 3, images/s at the {sizes} sizes ({MAX_LEN} words an image)")
    with torch.inference_mode():
        reference = search(decoder, images, 3, sync_free=True).tokens

    def tutorial(a: torch.Tensor) -> None:
        for i in range(a.size(0)):  # one image at a time, as the tutorial's caption.py does
            tutorial_beam_search(decoder, a[i : i + 1], 3, MAX_LEN)

    forms = {
        "tutorial, one image at a time": (tutorial, None),
        "captioner, sync-free (CUDA's default)": (lambda a: search(decoder, a, 3, sync_free=True), decoder),
        "captioner, shrinking (the CPU's default)": (lambda a: search(decoder, a, 3, sync_free=False), decoder),
        "compile_decoder, a graph per 8 words (its default)": (lambda a: search(compiled, a, 3), compiled),
        "compile_decoder, the whole search one graph (check_every=16)": (
            lambda a: search(compiled, a, 3, check_every=MAX_LEN),
            compiled,
        ),
    }
    base: dict[int, float] = {}
    for name, (fn, model) in forms.items():

        def measure(fn=fn, model=model, name=name):
            row = {}
            for batch in (1, 64):
                picks = itertools.cycle(range(64))

                def call(batch=batch, picks=picks):
                    i = next(picks)
                    return fn(images[i : i + 1] if batch == 1 else images)

                with torch.inference_mode():
                    seconds = timed(call, calls[batch], warmup=2, device=device)
                rate = batch / seconds
                if model is None:  # the tutorial's: what the other rows are compared with
                    base[batch] = rate
                ratio = f" ({rate / base[batch]:.2f}x)" if batch in base else ""
                row[f"batch {batch}"] = f"{rate:.1f}{ratio}"
            if model is not None:  # the same captions as the eager sync-free search, for all 64 images
                with torch.inference_mode():
                    got = fn(images)
                row["captions as eager"] = "same" if torch.equal(got.tokens, reference) else "DIFFERENT"
            return row

        rows.measure({"beam 3": name}, measure)
    rows.finish()


def main() -> None:
    script = Script(__file__, __doc__, smoke="tiny sizes, a call or two: checks the script only", budget=True)
    script.option("--tables", default=",".join(TABLES), help=f"comma-separated, of {', '.join(TABLES)}")
    options = script.start()
    tables = options.tables.split(",")
    if unknown := set(tables) - set(TABLES):
        script.parser.error(f"no table named {', '.join(sorted(unknown))}")
    device = torch.device("cuda" if torch.cuda.is_available() and not options.smoke else "cpu")
    sizes = {"tiny": TINY} if options.smoke else SIZES
    calls = {1: 1, 64: 1} if options.smoke else {1: 20, 64: 3} if device.type == "cuda" else {1: 9, 64: 5}
    with script.compiled_forms():
        if "default" in tables:
            default_table(script, sizes, device, calls)
        if "sync_free" in tables:
            forms = {"shrinking": {"sync_free": False}, "sync-free": {"sync_free": True, "check_every": 8}}
            from captioner import Captioner

            model = Captioner.load("shapes", device=device).model
            title = "the bundled model on 64 shapes test images: shrinking (the CPU's default), sync-free (CUDA's)"
            bundled_table(script, "sync_free", title, {k: (model, o) for k, o in forms.items()}, device, calls)
        if "compiled" in tables:
            from captioner import Captioner

            forms = {
                "eager (default)": (Captioner.load("shapes", device=device).model, {}),
                "compile_decoder": (Captioner.load("shapes", device=device, compile_decoder=True).model, {}),
            }
            title = "the bundled model on 64 shapes test images: eager and compile_decoder"
            bundled_table(script, "compiled", title, forms, device, calls)
        if "random_compiled" in tables:
            random_compiled_table(script, sizes, device, calls)
        if "tutorial" in tables:
            dims, name = (TINY, "tiny") if options.smoke else (SIZES["paper"], "paper's")
            tutorial_table(script, dims, name, device, calls)
    script.finish()


if __name__ == "__main__":
    sys.exit(main())
