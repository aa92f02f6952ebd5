"""One image from file to caption, as `Captioner.caption` does it for a script or the server: a 640x480 JPEG read,
decoded, resized, encoded, searched (beam 3) and its words decoded. Latency p50 and p95 over one-at-a-time calls, and
images/s one at a time, for the bundled model and a model at the paper's sizes (ResNet-101 at 448 pixels pooled to
14x14x2048, a 512-d decoder, 10,000 words; untrained: the speed is the same), eager, with `compile_decoder=True`, and
with `compile_encoder=True` as well (--smoke leaves out the last for the paper's model: minutes of compiling
ResNet-101 on a CPU).

    python benchmarks/one_image.py            # on this machine's device (CUDA when present)
    python benchmarks/one_image.py --smoke    # a few calls: checks the script

Each model's first calls (which compile, for the compiled rows) are not timed. The eager and compiled models take
turns, call by call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import machine, table
from fit import write_images

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


def captioners(name: str, smoke: bool) -> dict[str, Captioner]:
    skip = smoke and name == "paper"  # minutes of compiling ResNet-101 on a CPU
    forms = {form: options for form, options in FORMS.items() if not (skip and "compile_encoder" in options)}
    if name == "shapes":
        return {form: Captioner.load("shapes", **options) for form, options in forms.items()}
    return {form: Captioner(*paper_model(), **options) for form, options in forms.items()}


def latencies(models: dict[str, Captioner], image: Path, calls: int) -> dict[str, list[float]]:
    seconds: dict[str, list[float]] = {form: [] for form in models}
    for model in models.values():
        for _ in range(3):  # warm up: compiles the compiled word's two shapes and the encoder's one
            model.caption(image, beam_size=3)
    for _ in range(calls):
        for form, model in models.items():
            start = time.perf_counter()
            model.caption(image, beam_size=3)  # its caption is copied to the host: the device has finished
            seconds[form].append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few calls: checks the script only")
    parser.add_argument("--calls", type=int, default=50, help="timed calls per model")
    options = parser.parse_args()
    calls = 3 if options.smoke else options.calls
    device = "CUDA " + torch.cuda.get_device_name() if torch.cuda.is_available() else "the CPU"
    print(f"# one_image.py on {device}; {machine()}\n", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        write_images(Path(folder), [], distinct=1)  # source_0.jpg, 640x480
        image = Path(folder) / "source_0.jpg"
        for name in ("shapes", "paper"):
            for form, seconds in latencies(captioners(name, options.smoke), image, calls).items():
                ms = sorted(1000 * s for s in seconds)
                rows.append(
                    {
                        "model": name,
                        "form": form,
                        "p50, ms": f"{statistics.median(ms):.1f}",
                        "p95, ms": f"{ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]:.1f}",
                        "images/s one at a time": f"{len(ms) / (sum(ms) / 1000):.1f}",
                    }
                )
                print(rows[-1], flush=True)
    print(f"\none 640x480 JPEG from file to caption, beam 3, {calls} calls each{' (smoke run)' * options.smoke}\n")
    print(table(rows))


if __name__ == "__main__":
    sys.exit(main())
