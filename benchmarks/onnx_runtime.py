"""The ONNX export on ONNX Runtime against torch, and what float16 and int8 cost: the files' sizes; the latency of one
640x480 JPEG and of 64 at once, from file to caption (beam 3); and, on a test split read from files, the share of
captions unchanged from torch's (and from the float export's), BLEU-4 and CIDEr-D (pycocoevalcap's, on captioner's
tokens; `captioner evaluate` tokenizes with the PTB tokenizer instead, so its figures differ a little).

Forms: torch (`captioner.Captioner`, eager), and `captioner export --format onnx` run by `captioner.onnx.Captioner`
(CPU execution provider, Pillow's resize): float, `--float16` (weights stored as float16), `--int8 step` (the
decoder's weights) and `--int8 all` (the encoder's convolutions too); and the float export with `resize="exact"`
(torchvision's pixels to the bit).

    python benchmarks/onnx_runtime.py             # the bundled model and its 500 test images
    python benchmarks/onnx_runtime.py --ucm-model checkpoints/ucm/best.ckpt --ucm-data data/ucm
                                                  # and a model fitted with configs/ucm.yaml, on UCM's test split
    python benchmarks/onnx_runtime.py --smoke     # a few images and calls: checks the script only

A profile of one JPEG, beam 3, phase by phase (the median of --calls calls each: read, resize, encoder, start, search,
and `caption()` whole), for torch and the float export; and the float export's latency under ONNX Runtime's thread
options (`threads`, `spinning`: `captioner.onnx.runtime.session_options`).

    python benchmarks/onnx_runtime.py --tables latency,profile   # some tables only
    python benchmarks/onnx_runtime.py --cuda      # on a GPU: ONNX Runtime's CUDA provider against torch on CUDA
                                                  # (benchmarks/gpu_check.py's onnx_cuda part; "not measured"
                                                  # without onnxruntime-gpu)

Rows are printed, and written to --out, as they are measured; a form that fails is a row with its error.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import onnxruntime
import torch
from common import Table, deadline, fail_if_asked, machine, one_line, out_folder, write_images

from captioner import Captioner
from captioner.data.coco import read_karpathy
from captioner.data.images import load_image
from captioner.data.shapes import ShapesDataset
from captioner.data.vocab import tokenize
from captioner.metrics import coco_caption_scores
from captioner.onnx import Captioner as OnnxCaptioner
from captioner.onnx_export import export_onnx
from captioner.web_export import folder_size

EXPORTS = {
    "onnx, float": {},
    "onnx, float16": {"float16": True},  # weights stored as float16 (`captioner export --format web`'s default)
    "onnx, int8 step": {"int8": "step"},
    "onnx, int8 all": {"int8": "all"},
}


def exports(checkpoint: str, folder: Path) -> dict[str, Path | str]:
    """The model's ONNX exports (or, for one that fails, its error)."""
    made: dict[str, Path | str] = {}
    for form, options in EXPORTS.items():
        try:
            fail_if_asked(form)
            made[form] = export_onnx(checkpoint, folder / form.replace(", ", "_").replace(" ", "_"), **options)
        except Exception as err:
            made[form] = "error: " + one_line(err)
    return made


def captioners(checkpoint: str, made: dict[str, Path | str]) -> dict[str, object]:
    """torch's, and each export's on the CPU provider (Pillow's resize, the default); the float export also with the
    exact resize (torchvision's pixels to the bit)."""
    forms: dict[str, object] = {"torch, eager": Captioner.load(checkpoint, device="cpu")}
    for form, folder in made.items():
        cpu = ["CPUExecutionProvider"]
        forms[form] = folder if isinstance(folder, str) else OnnxCaptioner(folder, cpu)
        if form == "onnx, float":
            forms["onnx, float, exact resize"] = (
                folder if isinstance(folder, str) else OnnxCaptioner(folder, cpu, resize="exact")
            )
    return forms


def latency_rows(model: str, forms: dict[str, object], image: Path, batch: list[Path], calls: int, rows: Table):
    """Each form in turn, alone (the forms do not take turns call by call: a runtime's threads spin on after its
    calls, and would slow the other's): one image, `calls` calls (p50, p95); the batch, the median of 3 calls. Each
    after two untimed calls."""
    for form, captioner in forms.items():
        row = {"model": model, "form": form}
        if isinstance(captioner, str):
            rows.add({**row, "error": captioner.removeprefix("error: ")})
            continue

        def measure(captioner=captioner) -> dict:
            one, many = [], []
            for calls_, images, times in ((calls, [image], one), (3, batch, many)):
                for i in range(2 + calls_):
                    start = time.perf_counter()
                    captioner.caption(images, beam_size=3, batch_size=len(images))
                    if i >= 2:
                        times.append(time.perf_counter() - start)
            ms = sorted(1000 * s for s in one)
            median = statistics.median(many)
            return {
                "1 image p50, ms": f"{statistics.median(ms):.1f}",
                "1 image p95, ms": f"{ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]:.1f}",
                f"{len(batch)} images, ms": f"{1000 * median:.0f}",
                "images/s": f"{len(batch) / median:.1f}",
            }

        rows.measure(row, measure)


def profile_rows(model: str, forms: dict[str, object], image: Path, calls: int, rows: Table):
    """One JPEG, beam 3, phase by phase: the median of `calls` calls of each phase, after two untimed ones. The search
    is `generate` less the start (ONNX: its own graph; torch: init_state and prepare, inside generate)."""
    for form in ("torch, eager", "onnx, float", "onnx, float, exact resize"):
        captioner = forms.get(form)
        row = {"model": model, "form": form}
        if not hasattr(captioner, "caption"):
            rows.add({**row, "error": str(captioner)})
            continue

        def measure(captioner=captioner, form=form) -> dict:
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

        rows.measure(row, measure)


def thread_rows(model: str, folder: Path | str, image: Path, batch: list[Path], calls: int, rows: Table):
    """The float export's latency under ONNX Runtime's thread options, each session set alone."""
    for threads in (1, 2):
        for spinning in (False, True):
            row = {"model": model, "threads": threads, "spinning": spinning}
            if isinstance(folder, str):
                rows.add({**row, "error": folder})
                continue

            def measure(threads=threads, spinning=spinning) -> dict:
                captioner = OnnxCaptioner(folder, ["CPUExecutionProvider"], threads=threads, spinning=spinning)
                one, many = [], []
                for calls_, images, times in ((calls, [image], one), (3, batch, many)):
                    for i in range(2 + calls_):
                        start = time.perf_counter()
                        captioner.caption(images, beam_size=3, batch_size=len(images))
                        if i >= 2:
                            times.append(1000 * (time.perf_counter() - start))
                return {"1 image p50, ms": f"{statistics.median(one):.1f}",
                        f"{len(batch)} images, ms": f"{statistics.median(many):.0f}"}  # fmt: skip

            rows.measure(row, measure)


def cuda_rows(out: Path | None, until: float | None, calls: int, folder: Path) -> None:
    """One JPEG and 64, beam 3, the bundled model: torch (eager) on CUDA against the float export on ONNX Runtime's
    CUDA execution provider, whose word graphs keep their state on the GPU between calls (`captioner.onnx.search`)."""
    rows = Table("onnx_cuda", f"CUDA: from file to caption, beam 3; 1 image: {calls} calls each", out, until)
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers() or not torch.cuda.is_available():
        reason = "no CUDA device" if not torch.cuda.is_available() else "onnxruntime has no CUDAExecutionProvider"
        rows.add({"form": "onnx, CUDA provider", "error": f"not measured: {reason} (pip install onnxruntime-gpu)"})
        rows.finish()
        return
    image = write_images(folder / "one", [], distinct=1)[0]
    batch = write_images(folder / "batch", [], distinct=64)
    exported = export_onnx("shapes", folder / "shapes_cuda")
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    forms = {
        "torch, eager, CUDA": Captioner.load("shapes", device="cuda"),
        "onnx, float, CUDA provider": OnnxCaptioner(exported, providers),
    }
    latency_rows("shapes (bundled)", forms, image, batch, calls, rows)
    rows.finish()


def quality_rows(model: str, forms: dict[str, object], sizes: dict[str, str], paths, references, rows: Table):
    """Captions of the split's files (beam 3) by each form: unchanged from torch's and from the float export's, BLEU-4,
    CIDEr-D."""
    want, float_export = None, None
    for form, captioner in forms.items():
        row = {"model": model, "form": form, "files, MiB": sizes.get(form, "")}
        if isinstance(captioner, str):
            rows.add({**row, "error": captioner.removeprefix("error: ")})
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


def file_sizes(checkpoint: str, made: dict[str, Path | str]) -> dict[str, str]:
    from captioner.checkpoints import resolve

    sizes = {"torch, eager": f"{resolve(checkpoint).stat().st_size / 2**20:.1f}"}
    made = {**made, "onnx, float, exact resize": made.get("onnx, float", "")}
    for form, folder in made.items():
        if not isinstance(folder, str):
            sizes[form] = f"{folder_size(folder) / 2**20:.1f}"
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few images and calls: checks the script only")
    parser.add_argument("--calls", type=int, default=30, help="timed one-image calls per form")
    parser.add_argument("--images", type=int, default=500, help="the bundled model's test images to caption")
    parser.add_argument("--ucm-model", help="a checkpoint or model file fitted with configs/ucm.yaml")
    parser.add_argument("--ucm-data", help="UCM's folder (dataset.json, images/), as data/README.md says")
    parser.add_argument("--out", help="a folder for the tables' rows (onnx_*.jsonl as measured, onnx_*.md)")
    parser.add_argument("--budget", type=float, help="seconds: a form not started by then is a row that says so")
    parser.add_argument("--tables", default="latency,profile,threads,quality", help="the tables to measure")
    parser.add_argument("--cuda", action="store_true", help="CUDA's provider against torch on CUDA, nothing else")
    options = parser.parse_args()
    tables = set(options.tables.split(","))
    calls, images = (3, 8) if options.smoke else (options.calls, options.images)
    out, until = out_folder(options.out), deadline(options.budget)
    print(f"# onnx_runtime.py on {machine()}, onnxruntime {onnxruntime.__version__}", flush=True)
    if options.smoke:
        print("# smoke run: not a measurement", flush=True)
    if options.cuda:
        with tempfile.TemporaryDirectory() as tmp:
            cuda_rows(out, until, calls, Path(tmp))
        return
    models = {"shapes (bundled)": "shapes"}
    if options.ucm_model:
        models["UCM (configs/ucm.yaml)"] = options.ucm_model
    speed = Table("onnx_latency", f"from file to caption, beam 3, CPU; 1 image: {calls} calls each", out, until)
    quality = Table("onnx_quality", "test split from files, beam 3: captions and scores", out, until)
    profile = Table("onnx_profile", f"one JPEG, beam 3, per phase: the median of {calls} calls", out, until)
    threads = Table("onnx_threads", "the float export under ONNX Runtime's thread options", out, until)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        image = write_images(folder / "one", [], distinct=1)[0]
        batch = write_images(folder / "batch", [], distinct=8 if options.smoke else 64)
        for model, checkpoint in models.items():
            made = exports(checkpoint, folder / model.split()[0])
            forms = captioners(checkpoint, made)
            if "latency" in tables:
                latency_rows(model, forms, image, batch, calls, speed)
            if "profile" in tables:
                profile_rows(model, forms, image, calls, profile)
            if "threads" in tables:
                thread_rows(model, made["onnx, float"], image, batch, calls, threads)
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
            quality_rows(model, forms, file_sizes(checkpoint, made), paths, references, quality)
    for table in (speed, profile, threads, quality):
        table.finish()


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
