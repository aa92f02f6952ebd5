"""One image from file to caption, as `Captioner.caption` does it for a script or the server: a 640x480 JPEG read,
decoded, resized, encoded, searched (beam 3) and its words decoded. Latency p50 and p95 over one-at-a-time calls, and
images/s one at a time, for the bundled model and a model at the paper's sizes (ResNet-101 at 448 pixels pooled to
14x14x2048, a 512-d decoder, 10,000 words; untrained: the speed is the same), eager, with `compile_decoder=True`, and
with `compile_encoder=True` as well.

    python benchmarks/one_image.py                    # on this machine's device (CUDA when present)
    python benchmarks/one_image.py --models shapes    # the bundled model only (on a CPU the paper's takes minutes)
    python benchmarks/one_image.py --smoke            # a few calls; compiled forms under tests/cuda_graphs.py

Each model's first calls (which compile, for the compiled rows) are not timed. A model's forms take turns, call by
call; its rows are printed, and written to --out, when its turns end. A form that fails is a row with its error.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import REPO, Table, deadline, fail_if_asked, machine, one_line, out_folder, write_images

from captioner import Captioner
from captioner.data.vocab import Vocabulary
from captioner.models.show_attend_tell import ShowAttendTell


def paper_model() -> tuple[ShowAttendTell, Vocabulary]:
    torch.manual_seed(0)
    vocab = Vocabulary(f"w{i}" for i in range(10_000 - len(Vocabulary.SPECIALS)))
    sizes = {"embed_dim": 512, "decoder_dim": 512, "attention_dim": 512}
    special = {"pad_index": vocab.pad_index, "start_index": vocab.start_index, "end_index": vocab.end_index}
    model = ShowAttendTell(len(vocab), "resnet101", pretrained=False, grid_size=14, image_size=448, **sizes, **special)
    return model, vocab


FORMS = {
    "eager": {},
    "compiled": {"compile_decoder": True},
    "compiled, encoder too": {"compile_decoder": True, "compile_encoder": True},
}


def captioner(name: str, options: dict) -> Captioner:
    if name == "shapes":
        return Captioner.load("shapes", **options)
    return Captioner(*paper_model(), **options)


def latencies(name: str, image: Path, calls: int) -> dict[str, list[float] | str]:
    """Seconds of each of `calls` calls per form, the forms taking turns; a form that fails, its error instead."""
    models: dict[str, Captioner] = {}
    seconds: dict[str, list[float] | str] = {}
    for form, options in FORMS.items():
        try:
            fail_if_asked(form)
            models[form] = captioner(name, options)
            for _ in range(3):  # warm up: compiles the compiled search's runs of words and the encoder's graph
                models[form].caption(image, beam_size=3)
            seconds[form] = []
        except Exception as err:
            seconds[form] = "error: " + one_line(err)
    for _ in range(calls):
        for form, model in models.items():
            if isinstance(seconds[form], str):
                continue
            try:
                start = time.perf_counter()
                model.caption(image, beam_size=3)  # its caption is copied to the host: the device has finished
                seconds[form].append(time.perf_counter() - start)
            except Exception as err:
                seconds[form] = "error: " + one_line(err)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few calls: checks the script only")
    parser.add_argument("--calls", type=int, default=50, help="timed calls per model")
    parser.add_argument("--models", default="shapes,paper", help="comma-separated: shapes (the bundled), paper")
    parser.add_argument("--out", help="a folder for the table's rows (one_image.jsonl as measured, one_image.md)")
    parser.add_argument("--budget", type=float, help="seconds: a model not started by then is a row that says so")
    options = parser.parse_args()
    calls = 3 if options.smoke else options.calls
    print(f"# one_image.py on {machine()}{' (smoke run: not a measurement)' * options.smoke}", flush=True)
    title = f"one 640x480 JPEG from file to caption, beam 3, {calls} calls each"
    rows = Table("one_image", title, out_folder(options.out), deadline(options.budget))
    stand_in = contextlib.nullcontext()
    if options.smoke:  # compiled forms as CUDA graphs would treat them, without generating code
        sys.path.insert(0, str(REPO))
        from tests.cuda_graphs import cuda_graph_stand_in

        stand_in = cuda_graph_stand_in()
    with stand_in, tempfile.TemporaryDirectory() as folder:
        image = write_images(Path(folder), [], distinct=1)[0]  # 640x480
        for name in options.models.split(","):
            if rows.deadline is not None and time.monotonic() > rows.deadline:
                measured = {form: "error: not run: the part's time budget was spent" for form in FORMS}
            else:
                try:
                    measured = latencies(name, image, calls)
                except Exception as err:
                    measured = {form: "error: " + one_line(err) for form in FORMS}
            for form, seconds in measured.items():
                row = {"model": name, "form": form}
                if isinstance(seconds, str):
                    rows.add({**row, "error": seconds.removeprefix("error: ")})
                    continue
                ms = sorted(1000 * s for s in seconds)
                rows.add(
                    {
                        **row,
                        "p50, ms": f"{statistics.median(ms):.1f}",
                        "p95, ms": f"{ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]:.1f}",
                        "images/s one at a time": f"{len(ms) / (sum(ms) / 1000):.1f}",
                    }
                )
    rows.finish()


if __name__ == "__main__":
    sys.exit(main())
