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

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, Table, deadline, machine, out_folder, write_images

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


def summary(first_ms: float, later_ms: list[float]) -> dict:
    later = sorted(later_ms)
    return {
        "first caption, ms": f"{first_ms:.0f}",
        "later p50, ms": f"{statistics.median(later):.1f}",
        "later p95, ms": f"{later[min(len(later) - 1, round(0.95 * (len(later) - 1)))]:.1f}",
    }


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
                return {"threads": threads, **summary(times["first"], times["later"])}

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
            first = 1000 * (time.perf_counter() - start)
            later = []
            for _ in range(calls):
                start = time.perf_counter()
                captioner.caption([photo], beam_size=3)
                later.append(1000 * (time.perf_counter() - start))
            return summary(first, later)

        rows.measure({"model": model, "form": form}, measure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="shapes,ucm", help="bundled models (or checkpoints), comma-separated")
    parser.add_argument("--ort-dist", default=str(REPO / ".web" / "node_modules" / "onnxruntime-web" / "dist"))
    parser.add_argument("--calls", type=int, default=20, help="later captions timed per form")
    parser.add_argument("--smoke", action="store_true", help="a few calls: checks the script only")
    parser.add_argument("--out", help="a folder for the tables' rows (browser_*.jsonl as measured, browser_*.md)")
    parser.add_argument("--budget", type=float, help="seconds: a form not started by then is a row that says so")
    options = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("no chromium on this machine (Debian: apt-get install chromium)")
    calls = 3 if options.smoke else options.calls
    out, until = out_folder(options.out), deadline(options.budget)
    print(f"# browser.py on {machine()}", flush=True)
    if options.smoke:
        print("# smoke run: not a measurement", flush=True)
    sizes = Table("browser_size", "the web folder (`captioner export --format web --ort-dist`), MiB", out, until)
    speed = Table("browser_latency", f"a 640x480 JPEG, beam 3, CPU: the first caption, then {calls} more", out, until)
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
    sizes.finish()
    speed.finish()


def folder_sizes(model: str, site: Path, options: argparse.Namespace) -> dict:
    export_web(model, site, ort_dist=options.ort_dist)
    ort = sum((site / "ort" / name).stat().st_size for name, _ in ORT_FILES.values())
    total = folder_size(site)
    return {"folder": f"{total / 2**20:.1f}", "ONNX Runtime Web": f"{ort / 2**20:.1f}",
            "the rest (model, page)": f"{(total - ort) / 2**20:.1f}"}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
