"""One image from file to caption, as `Captioner.caption` does it for a script or the server: a 640x480 JPEG read,
decoded, resized, encoded, searched (beam 3) and its words decoded, in each form captioner runs in. Latency p50 and
p95 over one-at-a-time calls and the images a second they make, and the time of 64 images captioned at once.

Forms (--forms: forms or the groups torch, onnx and all, separated by |; default all):
- torch, eager; torch, compiled (`compile_decoder=True`); torch, compiled, encoder too (`compile_encoder=True` too);
- onnx, float; onnx, float, exact resize; onnx, float16; onnx, int8 step; onnx, int8 all: `captioner export --format
  onnx` (with `--float16`, `--int8 step`, `--int8 all`) run by `captioner.onnx.Captioner`, with Pillow's resize (the
  default) or torchvision's pixels to the bit (`resize="exact"`); on CUDA, ONNX Runtime's CUDA execution provider
  (onnxruntime-gpu; without it, a row that says "not measured").

Models (--models): the bundled `shapes` and `ucm`, a checkpoint or model file, or `paper`: an untrained model at the
paper's sizes (ResNet-101 at 448 pixels pooled to 14x14x2048, a 512-d decoder, 10,000 words; the speed is the same),
in torch's forms only (it has no file to export).

    python benchmarks/one_image.py                                   # both bundled models, every form
    python benchmarks/one_image.py --models shapes,paper --forms torch --batch 0   # benchmarks/gpu_check.py's
    python benchmarks/one_image.py --smoke                           # a few calls; compiled forms under a stand-in

A model's forms take turns call by call, after three untimed calls each (which compile the compiled forms); then the
64 images, three calls each in turn after one untimed. ONNX Runtime's threads do not spin between calls (the
default of `captioner.onnx`), so a form's calls do not slow the next one's. Rows are printed, and written to --out,
as each model's turns end; a form that fails is a row with its error. With --smoke: compiled forms as CUDA graphs
would treat them (tests/cuda_graphs.py's stand-in, no code generated).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch
from common.forms import PAPER, TORCH, captioners, forms_named
from common.harness import Script, latency, one_line, take_turns
from common.synthetic import write_images


def measure_model(model: str, forms: list[str], device, images: dict, calls: int, folder: Path) -> dict[str, dict]:
    """Each form's columns: one image's latency, then the batch's time; a form that fails, its error."""
    built, _ = captioners(model, forms, device, folder)
    ready = {form: c for form, c in built.items() if not isinstance(c, BaseException)}
    columns: dict[str, dict] = {form: {"error": one_line(c)} for form, c in built.items() if form not in ready}

    def calls_of(files: list[Path]) -> dict:
        return {form: lambda c=c: c.caption(files, beam_size=3, batch_size=len(files)) for form, c in ready.items()}

    one = take_turns(calls_of([images["one"]]), calls, warmup=3, device=device)
    batch = take_turns(calls_of(images["batch"]), 3, warmup=1, device=device) if images["batch"] else {}
    for form in ready:
        if isinstance(one[form], BaseException):
            columns[form] = {"error": one_line(one[form])}
            continue
        columns[form] = latency(one[form], "1 image ")
        columns[form]["images/s one at a time"] = f"{len(one[form]) / sum(one[form]):.1f}"
        if form in batch and isinstance(batch[form], BaseException):
            columns[form]["error"] = f"{len(images['batch'])} images: {one_line(batch[form])}"
        elif form in batch:
            median = sorted(batch[form])[len(batch[form]) // 2]
            columns[form] |= {f"{len(images['batch'])} images, ms": f"{1000 * median:.0f}",
                              "images/s at once": f"{len(images['batch']) / median:.1f}"}  # fmt: skip
    return {form: columns[form] for form in forms if form in columns}


def main() -> None:
    script = Script(__file__, __doc__, smoke="a few calls and 8 images: checks the script only", budget=True)
    script.option("--models", default="shapes,ucm", help="bundled models, checkpoints or `paper`, comma-separated")
    script.option("--forms", default="all", help="forms or groups (torch, onnx, all), separated by |")
    script.option("--calls", type=int, default=50, help="timed one-image calls per form")
    script.option("--batch", type=int, default=64, help="images captioned at once (0: not measured)")
    script.option("--device", choices=("cpu", "cuda"), help="default: CUDA where there is one")
    script.option("--table", default="one_image", help="the table's name (its files' under --out)")
    options = script.start()
    forms = forms_named(options.forms)
    device = torch.device(options.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    calls, batch = (3, min(options.batch, 8)) if options.smoke else (options.calls, options.batch)
    title = f"one 640x480 JPEG from file to caption, beam 3, {device.type}: {calls} calls each, taking turns"
    rows = script.table(options.table, title + (f"; {batch} at once, the median of 3 calls" if batch else ""))
    with script.compiled_forms(), tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        images = {"one": write_images(folder / "one", [], distinct=1)[0]}
        images["batch"] = write_images(folder / "batch", [], distinct=batch) if batch else []
        for model in options.models.split(","):
            chosen = [form for form in forms if model != PAPER or form in TORCH]
            if device.type == "cuda" and not torch.cuda.is_available():
                measured = {form: {"error": "not measured: no CUDA device"} for form in chosen}
            elif script.deadline is not None and time.monotonic() > script.deadline:
                measured = {form: {"error": "not run: the part's time budget was spent"} for form in chosen}
            else:
                try:
                    measured = measure_model(model, chosen, device, images, calls, folder / model.replace("/", "_"))
                except Exception as err:  # a model that cannot be loaded: each of its forms a row that says why
                    measured = {form: {"error": one_line(err)} for form in chosen}
            for form, values in measured.items():
                rows.add({"model": model, "form": form, **values})
    script.finish()


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
