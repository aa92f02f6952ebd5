"""The resizes of `captioner.onnx` (Pillow's, its default, and the exact numpy one, torchvision's pixels to the bit)
against torchvision's, on one large photo: time, and the peak memory a resize needs beyond the photo's own pixels.

A 12-megapixel JPEG (4000x3000: a phone's photo), decoded, then resized to the bundled model's 224x224 (bicubic,
antialiased, uint8, as `Preprocessing.transforms(normalize=False)` does) by each form, each in a process of its own:
the median time of --repeats calls, and the growth of the process's peak resident memory over the resize (the photo
is decoded beforehand, and its pixels read in one allocation), beside the photo's own uint8 size.

    python benchmarks/resize.py              # the table of docs/benchmarks.md
    python benchmarks/resize.py --smoke      # a small photo and two calls: checks the script only

Rows are printed, and written to --out, as they are measured; a form that fails is a row with its error.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from common.harness import Script, in_own_process, python_result
from PIL import Image

FORMS = ("numpy (captioner.onnx.resize)", "Pillow (Image.resize)", "torchvision (v2.Resize)")

MEASURE = """
import json, statistics, sys, time
import numpy as np

def high_water() -> int:  # VmHWM, in KiB: this process's peak resident memory (not ru_maxrss, which exec keeps)
    line = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    return int(line.split()[1])

form, path, size, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if form.startswith("numpy"):
    from captioner.onnx.resize import resize
    run = lambda pixels: resize(pixels, size, "bicubic")
elif form.startswith("Pillow"):  # as captioner.onnx.Captioner.preprocess: a PIL image in, an array out
    from PIL import Image
    run = lambda pixels: np.asarray(Image.fromarray(pixels).resize((size, size), Image.Resampling.BICUBIC))
else:
    import torch
    from torchvision.transforms import v2
    torch.set_num_threads(1)  # the numpy resize runs on one core
    transform = v2.Resize((size, size), interpolation=v2.InterpolationMode.BICUBIC, antialias=True)
    run = lambda pixels: transform(torch.from_numpy(pixels).permute(2, 0, 1)).permute(1, 2, 0).numpy()
pixels = np.load(path)  # the decoded photo, read in one allocation: the peak below is the resize's
out = run(pixels[:64, :64].copy())  # the code paths loaded, at a size that costs nothing
before = high_water()
times = []
for _ in range(repeats):
    start = time.perf_counter()
    out = run(pixels)
    times.append(time.perf_counter() - start)
peak = high_water()
print("result: " + json.dumps({"ms": 1000 * statistics.median(times), "extra_mib": (peak - before) / 1024,
                              "shape": list(out.shape)}))
"""


def photo(path: Path, width: int, height: int) -> Path:
    """A photo-like JPEG of width x height: scikit-image's astronaut, scaled up, with fine noise over it (so that the
    JPEG is as hard to compress as a real photo)."""
    from skimage import data

    image = Image.fromarray(data.astronaut()).resize((width, height), Image.Resampling.BICUBIC)
    noise = np.random.default_rng(0).integers(-8, 9, (height, width, 3))
    pixels = np.clip(np.asarray(image).astype(np.int16) + noise, 0, 255).astype(np.uint8)
    Image.fromarray(pixels).save(path, "JPEG", quality=92)
    return path


def measure(form: str, path: Path, size: int, repeats: int) -> dict:
    """`form`'s resize in a process of its own, which measures its own peak (the resize's growth of it)."""
    return python_result(in_own_process(["-c", MEASURE, form, str(path), str(size), str(repeats)], 600, peak=False))


def main() -> None:
    script = Script(__file__, __doc__, smoke="a 400x300 photo, two calls: checks the script only")
    script.option("--repeats", type=int, default=5, help="timed calls of each resize")
    script.option("--size", type=int, default=224, help="the model's input side")
    args = script.start()
    width, height = (400, 300) if args.smoke else (4000, 3000)
    repeats = 2 if args.smoke else args.repeats
    table = script.table("resize", f"Resize of one {width}x{height} JPEG to {args.size}x{args.size}, bicubic")
    photo_mib = width * height * 3 / 2**20
    with tempfile.TemporaryDirectory() as folder:
        with Image.open(photo(Path(folder) / "photo.jpg", width, height)) as image:
            path = Path(folder) / "photo.npy"  # decoded here: the measuring process reads its pixels only
            np.save(path, np.asarray(image.convert("RGB")))
        for form in FORMS:
            row = {"form": form, "photo, MiB (uint8)": round(photo_mib, 1)}
            table.measure(row, lambda form=form: rounded(measure(form, path, args.size, repeats), photo_mib))
    script.finish()


def rounded(result: dict, photo_mib: float) -> dict:
    return {
        "ms": round(result["ms"], 1),
        "peak extra, MiB": round(result["extra_mib"], 1),
        "extra / photo": round(result["extra_mib"] / photo_mib, 2),
    }


if __name__ == "__main__":
    main()
