"""What the ONNX export costs and where its time goes: on a test split read from files, each form's captions beside
torch's (the share unchanged, and unchanged from the float export's), BLEU-4 and CIDEr-D (pycocoevalcap's, on
captioner's tokens; `captioner evaluate` tokenizes with the PTB tokenizer instead, so its figures differ a little),
with the files' size; one JPEG's time phase by phase (read, resize, encoder, start, search, and `caption()` whole),
for torch and the float export; and the float export's latency under ONNX Runtime's thread options (`threads`,
`spinning`: `captioner.onnx.runtime.session_options`). The forms' latency, beside torch's compiled ones: one_image.py.

Forms: torch (`captioner.Captioner`, eager), and `captioner export --format onnx` run by `captioner.onnx.Captioner`
(CPU execution provider, Pillow's resize): float, `--float16` (weights stored as float16), `--int8 step` (the
decoder's weights) and `--int8 all` (the encoder's convolutions too); and the float export with `resize="exact"`
(torchvision's pixels to the bit).

    python benchmarks/onnx_runtime.py             # the bundled model and its 500 test images
    python benchmarks/onnx_runtime.py --ucm-model ucm --ucm-data data/ucm
                                                  # and the bundled ucm (or a checkpoint fitted with configs/ucm.yaml)
                                                  # on UCM's test split
    python benchmarks/onnx_runtime.py --tables profile,threads   # some tables only
    python benchmarks/onnx_runtime.py --smoke     # a few images and calls: checks the script only

Rows are printed, and written to --out, as they are measured; a form that fails is a row with its error.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import onnxruntime
import torch
from common.forms import ONNX, captioners, exports_of
from common.forms import captioner as build
from common.harness import Script, Table, latency, one_line, timings
from common.synthetic import write_images

from captioner.data.coco import read_karpathy
from captioner.data.images import load_image
from captioner.data.shapes import ShapesDataset
from captioner.data.vocab import tokenize
from captioner.metrics import coco_caption_scores
from captioner.onnx import Captioner as OnnxCaptioner
from captioner.web_export import folder_size

FORMS = ["torch, eager", *ONNX]  # torch, then the exports (float, its exact resize, float16, int8)


def profile(captioner, form: str, image: Path, calls: int) -> dict:
    """One JPEG, beam 3, phase by phase: the median of `calls` calls of each phase, after two untimed ones. The search
    is `generate` less the start (ONNX: its own graph; torch: init_state and prepare, inside generate)."""
    times: dict[str, list[float]] = {}

    def timed(phase, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        times.setdefault(phase, []).append(1000 * (time.perf_counter() - start))
        return out

    for _ in range(2 + calls):
        picture = timed("read", load_image, image)
        if form == "torch, eager":
            x = timed("resize", lambda p: captioner.transform(p)[None], picture)
            annotations = timed("encoder", captioner.model.annotate, x)
            decoder = captioner.model.decoder
            timed("start", lambda a, d=decoder: (d.init_state(a), d.prepare(a)), annotations)
            timed("generate", lambda a: captioner.model.generate(annotations=a, beam_size=3), annotations)
        else:
            x = timed("resize", lambda p: captioner.preprocess(p)[None], picture)
            annotations = timed("encoder", captioner.annotate, x)
            timed("start", lambda a: captioner.sessions["start"].run(None, {"annotations": a}), annotations)
            timed("generate", lambda a: captioner.generate(a, beam_size=3), annotations)
        timed("caption()", captioner.caption, [image])
    median = {phase: statistics.median(t[2:]) for phase, t in times.items()}
    median["search"] = median.pop("generate") - median["start"]
    parts = ("read", "resize", "encoder", "start", "search")
    return {**{f"{p}, ms": f"{median[p]:.1f}" for p in (*parts, "caption()")},
            "sum of phases, ms": f"{sum(median[p] for p in parts):.1f}"}  # fmt: skip


def thread_latency(folder: Path, threads: int, spinning: bool, image: Path, batch: list[Path], calls: int) -> dict:
    """The float export's latency with a session of these thread options: one image, `calls` calls; the batch, the
    median of 3; each after two untimed calls."""
    captioner = OnnxCaptioner(folder, ["CPUExecutionProvider"], threads=threads, spinning=spinning)
    one = timings(lambda: captioner.caption([image], beam_size=3), calls, warmup=2)
    many = timings(lambda: captioner.caption(batch, beam_size=3, batch_size=len(batch)), 3, warmup=2)
    return {**latency(one, "1 image "), f"{len(batch)} images, ms": f"{1000 * statistics.median(many):.0f}"}


def alone(spec: dict, calls: int) -> dict:
    """In a process of its own (`Script.measure_alone`): a profile row or a thread options row."""
    image, batch = Path(spec["image"]), [Path(file) for file in spec["batch"]]
    exports = {name: Path(folder) for name, folder in spec["exports"].items()}
    if spec["table"] == "threads":
        return thread_latency(exports["onnx, float"], spec["threads"], spec["spinning"], image, batch, calls)
    model = build(spec["model"], spec["form"], torch.device("cpu"), exports)
    return profile(model, spec["form"], image, calls)


def quality_rows(model: str, forms: dict[str, object], sizes: dict[str, str], paths, references, rows: Table):
    """Captions of the split's files (beam 3) by each form: unchanged from torch's and from the float export's, BLEU-4,
    CIDEr-D."""
    want, float_export = None, None
    for form, captioner in forms.items():
        row = {"model": model, "form": form, "files, MiB": sizes.get(form, "")}
        if isinstance(captioner, BaseException):
            rows.add({**row, "error": one_line(captioner)})
            continue

        def measure(captioner=captioner, form=form) -> dict:
            nonlocal want, float_export
            got = [r.tokens for r in captioner.caption(paths, beam_size=3, batch_size=50)]
            if form == "torch, eager":
                want = got
            if form == "onnx, float":
                float_export = got

            def unchanged(reference: list | None) -> str:
                if reference is None:
                    return ""
                return f"{sum(a == b for a, b in zip(reference, got, strict=True)) / len(got):.3f}"

            hypotheses = {i: " ".join(words) for i, words in enumerate(got)}
            scores = coco_caption_scores(hypotheses, references, meteor=False, tokenized=True)
            return {
                "captions unchanged": unchanged(want),
                "as the float export's": unchanged(float_export),
                "BLEU-4": f"{scores['Bleu_4']:.4f}",
                "CIDEr-D": f"{scores['CIDEr']:.4f}",
            }

        rows.measure(row, measure)


def file_sizes(checkpoint: str, exports: dict[str, Path | BaseException]) -> dict[str, str]:
    from captioner.checkpoints import resolve

    sizes = {"torch, eager": f"{resolve(checkpoint).stat().st_size / 2**20:.1f}"}
    exports = {**exports, "onnx, float, exact resize": exports.get("onnx, float", RuntimeError())}
    for form, folder in exports.items():
        if not isinstance(folder, BaseException):
            sizes[form] = f"{folder_size(folder) / 2**20:.1f}"
    return sizes


def main() -> None:
    smoke = "a few images and calls: checks the script only"
    script = Script(__file__, __doc__, smoke=smoke, budget=True, alone=True)
    script.option("--calls", type=int, default=30, help="timed one-image calls per form")
    script.option("--images", type=int, default=500, help="the bundled model's test images to caption")
    script.option("--ucm-model", help="the bundled ucm, or a checkpoint or model file fitted with configs/ucm.yaml")
    script.option("--ucm-data", help="UCM's folder (dataset.json, images/), as data/README.md says")
    script.option("--tables", default="profile,threads,quality", help="the tables to measure, comma-separated")
    options = script.start(f", onnxruntime {onnxruntime.__version__}")
    calls, images = (3, 8) if options.smoke else (options.calls, options.images)
    if script.alone is not None:
        return script.report(alone(script.alone, calls))
    tables = set(options.tables.split(","))
    models = {"shapes": "shapes"}
    if options.ucm_model:
        models[options.ucm_model] = options.ucm_model
    profiles = script.table(
        "onnx_profile", f"one JPEG, beam 3, per phase: the median of {calls} calls, each form alone"
    )
    threads = script.table("onnx_threads", "the float export under ONNX Runtime's thread options, each alone")
    quality = script.table("onnx_quality", "test split from files, beam 3: captions and scores")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        image = write_images(folder / "one", [], distinct=1)[0]
        batch = write_images(folder / "batch", [], distinct=8 if options.smoke else 64)
        for model, checkpoint in models.items():
            if script.deadline is not None and time.monotonic() > script.deadline:
                break
            exports = exports_of(checkpoint, FORMS, folder / model.replace("/", "_"))
            made = {name: str(path) for name, path in exports.items() if isinstance(path, Path)}
            spec = {"model": checkpoint, "image": str(image), "batch": [str(file) for file in batch], "exports": made}
            if "profile" in tables:
                for form in ("torch, eager", "onnx, float", "onnx, float, exact resize"):
                    error = exports.get(ONNX[form][0]) if form in ONNX else None
                    if isinstance(error, BaseException):
                        profiles.add({"model": model, "form": form, "error": one_line(error)})
                        continue
                    row_spec = {**spec, "table": "profile", "form": form}
                    profiles.measure({"model": model, "form": form}, lambda s=row_spec: script.measure_alone(s))
            if "threads" in tables:
                for count, spinning in itertools.product((1, 2), (False, True)):
                    row = {"model": model, "threads": count, "spinning": spinning}
                    if isinstance(exports["onnx, float"], BaseException):
                        threads.add({**row, "error": one_line(exports["onnx, float"])})
                        continue
                    row_spec = {**spec, "table": "threads", "threads": count, "spinning": spinning}
                    threads.measure(row, lambda s=row_spec: script.measure_alone(s))
            if "quality" not in tables:
                continue
            if checkpoint == "shapes":
                split = ShapesDataset("test", images, seed=0)
                paths = [folder / f"shapes_{i:03d}.png" for i in range(len(split))]
                for i, path in enumerate(paths):
                    split.load_image(i).save(path)
                references = {i: [" ".join(tokenize(c)) for c in split.captions(i)] for i in range(len(split))}
            elif options.ucm_data:
                data = Path(options.ucm_data)
                records = read_karpathy(data / "dataset.json", data / "images", "test")[:images]
                paths = [r.image for r in records]
                references = {i: [" ".join(tokenize(c)) for c in r.captions] for i, r in enumerate(records)}
            else:
                continue
            forms = captioners(checkpoint, FORMS, torch.device("cpu"), exports)
            quality_rows(model, forms, file_sizes(checkpoint, exports), paths, references, quality)
    script.finish()


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
