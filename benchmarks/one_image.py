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

Each form is measured alone, in a process of its own (`Script.measure_alone`): the forms of a model measured in one
process slowed one another (torch eager's 64 images took 2.5x as long beside the seven other forms as alone), so each
finds the machine as it would on its own. There, after three untimed calls (which compile the compiled forms), the
one-image calls, then the 64 images three times after one untimed call. Each row is printed, and written to --out,
as it is measured; a form that fails is a row with its error. With --smoke: compiled forms as CUDA graphs would
treat them (tests/cuda_graphs.py's stand-in, no code generated).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch
from common.forms import ONNX, PAPER, TORCH, captioner, exports_of, forms_named
from common.harness import Script, latency, one_line, timings
from common.synthetic import write_images


def measure(spec: dict, calls: int) -> dict:
    """In the form's own process: one image's latency, then the batch's time."""
    device = torch.device(spec["device"])
    model = captioner(spec["model"], spec["form"], device, {k: Path(v) for k, v in spec["exports"].items()})
    image, batch = Path(spec["image"]), [Path(file) for file in spec["batch"]]
    one = timings(lambda: model.caption([image], beam_size=3), calls, warmup=3, device=device)
    values = {**latency(one, "1 image "), "images/s one at a time": f"{len(one) / sum(one):.1f}"}
    if batch:
        many = timings(lambda: model.caption(batch, beam_size=3, batch_size=len(batch)), 3, warmup=1, device=device)
        median = sorted(many)[1]
        values |= {f"{len(batch)} images, ms": f"{1000 * median:.0f}", "images/s at once": f"{len(batch) / median:.1f}"}
    return values


def main() -> None:
    smoke = "a few calls and 8 images: checks the script only"
    script = Script(__file__, __doc__, smoke=smoke, budget=True, alone=True)
    script.option("--models", default="shapes,ucm", help="bundled models, checkpoints or `paper`, comma-separated")
    script.option("--forms", default="all", help="forms or groups (torch, onnx, all), separated by |")
    script.option("--calls", type=int, default=50, help="timed one-image calls per form")
    script.option("--batch", type=int, default=64, help="images captioned at once (0: not measured)")
    script.option("--device", choices=("cpu", "cuda"), help="default: CUDA where there is one")
    script.option("--table", default="one_image", help="the table's name (its files' under --out)")
    options = script.start()
    calls, batch = (3, min(options.batch, 8)) if options.smoke else (options.calls, options.batch)
    if script.alone is not None:
        with script.compiled_forms():
            return script.report(measure(script.alone, calls))
    forms = forms_named(options.forms)
    device = torch.device(options.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    title = f"one 640x480 JPEG from file to caption, beam 3, {device.type}: {calls} calls each, each form alone"
    rows = script.table(options.table, title + (f"; {batch} at once, the median of 3 calls" if batch else ""))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        image = write_images(folder / "one", [], distinct=1)[0]
        files = write_images(folder / "batch", [], distinct=batch) if batch else []
        for model in options.models.split(","):
            chosen = [form for form in forms if model != PAPER or form in TORCH]
            if device.type == "cuda" and not torch.cuda.is_available():
                for form in chosen:
                    rows.add({"model": model, "form": form, "error": "not measured: no CUDA device"})
                continue
            exports = {}
            if not (script.deadline is not None and time.monotonic() > script.deadline):
                exports = exports_of(model, chosen, folder / model.replace("/", "_"))
            for form in chosen:
                row = {"model": model, "form": form}
                export = exports.get(ONNX[form][0]) if form in ONNX else None
                if isinstance(export, BaseException):
                    rows.add({**row, "error": one_line(export)})
                    continue
                made = {name: str(path) for name, path in exports.items() if isinstance(path, Path)}
                spec = {"model": model, "form": form, "device": device.type, "image": str(image)}
                spec |= {"batch": [str(file) for file in files], "exports": made}
                rows.measure(row, lambda spec=spec: script.measure_alone(spec))
    script.finish()


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
