"""`captioner export --format web`'s page in headless Chromium, beside Python on the same photo: a 640x480 JPEG,
beam 3. For each model, the web folder's size (the model's files, ONNX Runtime Web's), then:

- the page (served by a loopback static server, ONNX Runtime Web copied in with --ort-dist), without and with
  cross-origin isolation (one thread, or several): its first caption, from the page's navigation to the caption
  (the page, ONNX Runtime Web's WebAssembly, the graphs' sessions, the caption), and later captions (p50, p95);
- `captioner.onnx.Captioner` on the same folder (ONNX Runtime in Python, float16 weights as the page has them): its
  first caption (the sessions and the caption) and later ones;
- torch eager (`captioner.Captioner`): the same.

    python benchmarks/browser.py                       # the bundled models shapes and ucm
    python benchmarks/browser.py --models shapes --smoke   # a few calls: checks the script only

Needs Chromium (Debian: apt-get install chromium) and npm's onnxruntime-web (npm install --prefix .web
onnxruntime-web@<captioner.web_export.ORT_WEB>; or --ort-dist). Rows are printed, and written to --out, as they are
measured; a form that fails is a row with its error.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

from common.harness import REPO, Script, Table, latency, timings
from common.synthetic import write_images

from captioner import Captioner
from captioner.onnx import Captioner as OnnxCaptioner
from captioner.web_export import ISOLATION, ORT_FILES, export_web, folder_size, static_server

# In the page: its first caption (from the navigation's start, performance.now()'s origin), then `calls` more
CAPTIONS = """async ([beam, calls]) => {
  const source = await import("./source.js");
  const blob = await (await fetch("photo.jpg")).blob();
  await source.caption(blob, "photo.jpg", beam);
  const first = performance.now(), later = [];
  for (let i = 0; i < calls; i++) {
    const start = performance.now();
    await source.caption(blob, "photo.jpg", beam);
    later.push(performance.now() - start);
  }
  return {first, later};
}"""


def summary(first_s: float, later_s: list[float]) -> dict:
    return {"first caption, ms": f"{1000 * first_s:.0f}", **latency(later_s, "later ")}


def page_rows(model: str, site: Path, chromium: str, calls: int, rows: Table) -> None:
    from playwright.sync_api import sync_playwright

    flags = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=flags)
        for headers in ({}, ISOLATION):
            form = "browser, " + ("cross-origin isolated" if headers else "not isolated")

            def measure(headers=headers) -> dict:
                with static_server(site, headers) as address:
                    page = browser.new_page()
                    try:
                        page.goto(address)
                        times = page.evaluate(CAPTIONS, [3, calls])
                        threads = page.evaluate("crossOriginIsolated ? Math.min(4, navigator.hardwareConcurrency) : 1")
                    finally:
                        page.close()
                return {"threads": threads, **summary(times["first"] / 1000, [t / 1000 for t in times["later"]])}

            rows.measure({"model": model, "form": form}, measure)
        browser.close()


def python_rows(model: str, checkpoint: str, site: Path, photo: Path, calls: int, rows: Table) -> None:
    loaders = {
        "captioner.onnx (ONNX Runtime, Python)": lambda: OnnxCaptioner(site, ["CPUExecutionProvider"]),
        "torch, eager": lambda: Captioner.load(checkpoint, device="cpu"),
    }
    for form, load in loaders.items():

        def measure(load=load) -> dict:
            start = time.perf_counter()
            captioner = load()
            captioner.caption([photo], beam_size=3)
            first = time.perf_counter() - start
            return summary(first, timings(lambda: captioner.caption([photo], beam_size=3), calls, warmup=0))

        rows.measure({"model": model, "form": form}, measure)


def main() -> None:
    script = Script(__file__, __doc__, smoke="a few calls: checks the script only", budget=True)
    script.option("--models", default="shapes,ucm", help="bundled models (or checkpoints), comma-separated")
    script.option("--ort-dist", default=str(REPO / ".web" / "node_modules" / "onnxruntime-web" / "dist"))
    script.option("--calls", type=int, default=20, help="later captions timed per form")
    options = script.start()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("no chromium on this machine (Debian: apt-get install chromium)")
    calls = 3 if options.smoke else options.calls
    sizes = script.table("browser_size", "the web folder (`captioner export --format web --ort-dist`), MiB")
    speed = script.table("browser_latency", f"a 640x480 JPEG, beam 3, CPU: the first caption, then {calls} more")
    with tempfile.TemporaryDirectory() as tmp:
        photo = write_images(Path(tmp) / "photo", [], distinct=1)[0]
        for model in options.models.split(","):
            site = Path(tmp) / model.replace("/", "_")
            made = sizes.measure({"model": model}, lambda model=model, site=site: folder_sizes(model, site, options))
            if "error" in made:
                continue
            shutil.copy(photo, site / "photo.jpg")
            page_rows(model, site, chromium, calls, speed)
            python_rows(model, model, site, photo, calls, speed)
    script.finish()


def folder_sizes(model: str, site: Path, options) -> dict:
    export_web(model, site, ort_dist=options.ort_dist)
    ort = sum((site / "ort" / name).stat().st_size for name, _ in ORT_FILES.values())
    total = folder_size(site)
    return {"folder": f"{total / 2**20:.1f}", "ONNX Runtime Web": f"{ort / 2**20:.1f}",
            "the rest (model, page)": f"{(total - ort) / 2**20:.1f}"}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
