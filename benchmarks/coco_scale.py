"""The data side of training at COCO's size, on a synthetic Karpathy split of its exact shape: 113,287 training images
(restval included), 5,000 val and 5,000 test, five captions each (`common.write_split`: captions, linked JPEGs).

    python benchmarks/coco_scale.py --size 1         # full size: ~15 minutes, 13.2 + 10.7 GiB of cache files
    python benchmarks/coco_scale.py                  # a twentieth of it (`make bench`'s size)

It times, with `configs/coco_lite0.yaml`'s data options:
- `setup("fit")` the first time (the encoded splits and the vocabulary built) and again (read), and `setup("test")`,
  with the peak memory of each (each in a new process);
- SCST's set-up, CIDEr-D over the training split's references (`captioner.cider.CiderD`), the first time (its document
  frequencies counted and written beside the data) and again (read), after a `setup("fit")` in the same process
  (its peak memory includes that setup's);
- `configs/coco_resnet101.yaml`'s image cache (its annotations do not fit on a 64 GiB disk): its build, its size, and
  the batches of 64 preprocessed images per second that 2 loader workers read from it and from the original files;
- the training loader's batches of 64 per second from a Lite0-shaped feature cache (49x1280 float16 rows, random
  values; every training image's row, unless --cache-rows caps it: 13.2 GiB at full size), in the main process,
  which is what a training step waits for. The file is read once in order first, so that the timed batches find it
  in the page cache, as the epochs after the first do on a machine whose memory holds it (a cold read of random rows
  is the disk's speed, not the loader's).

The data are written under --folder (default: a temporary folder, removed).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from common.harness import Script, in_own_process, python_result
from common.synthetic import COCO, write_split

SETUP = """
import json, sys, time
start = time.perf_counter()
from captioner.data.datamodules import CocoDataModule
module = CocoDataModule(sys.argv[1], format="karpathy", min_word_count=5, max_vocab_size=10000)
imported = time.perf_counter()
module.setup(sys.argv[2])
print("result: " + json.dumps({"seconds": time.perf_counter() - imported, "import": imported - start,
                              "vocab": len(module.vocab)}))
"""


SCST = """
import inspect, json, sys, time
from captioner.cider import CiderD
from captioner.data.datamodules import CocoDataModule
module = CocoDataModule(sys.argv[1], format="karpathy", min_word_count=5, max_vocab_size=10000)
module.setup("fit")
references = module.datasets["train"].references
start = time.perf_counter()
# What SCST's setup makes (captioner.objectives.SelfCritical); a checkout from before the file had no cache_dir
cached = "cache_dir" in inspect.signature(CiderD).parameters
CiderD(references, cache_dir=module.data_dir) if cached else CiderD(references)
print("result: " + json.dumps({"seconds": time.perf_counter() - start, "import": 0.0, "vocab": len(module.vocab)}))
"""


def setup_run(root: Path, stage: str, script: str = SETUP) -> dict:
    """`script` in a process of its own: what it measured, and the process's peak resident memory."""
    child = in_own_process(["-c", script, str(root), stage])
    return python_result(child) | {"peak_mib": child.peak_mib}


ROWS = {  # the feature cache's row of one image: (P, E), dtype
    "lite0": ((49, 1280), np.float16),  # configs/coco_lite0.yaml
    "paper": ((196, 2048), np.float16),  # configs/coco_resnet101.yaml, a pretrained encoder
    "paper32": ((196, 2048), np.float32),  # the same, annotations beyond float16's range (fit.py's untrained encoder)
}


def endless(loader):
    """The loader's batches, epoch after epoch: as many as a measurement takes (a small or capped split has few)."""
    while True:
        yield from loader


def loader_rate(
    root: Path, cache_rows: int | None, rows_of: str = "lite0", batches: int = 300, step_ms: float = 6.0
) -> dict[str, float]:
    """The training loader over a cache of `ROWS[rows_of]` rows, read in the main process: batches of 64 per second
    read when asked (prefetch 0: all of it on the step's time), and with the default prefetching thread, the
    milliseconds the main process waits per batch when each batch is followed by a step of `step_ms` (a sleep, as
    the host's wait for the device; the compiled step on one GPU takes about 6 ms a batch)."""
    import torch

    from captioner.data.datamodules import CocoDataModule
    from captioner.data.inputs import Inputs

    module = CocoDataModule(str(root), format="karpathy", min_word_count=5, max_vocab_size=10000, num_workers=0)
    module.setup("fit")
    dataset = module.datasets["train"]
    rows = len(dataset.source) if cache_rows is None else min(cache_rows, len(dataset.source))
    shape, dtype = ROWS[rows_of]
    path = root / f"{rows_of}_rows.npy"
    if not path.exists() or np.load(path, mmap_mode="r").shape != (rows, *shape):  # a later run reuses it
        array = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=(rows, *shape))
        generator = np.random.default_rng(0)
        block = max(1, 2**27 // array[0].nbytes)
        for start in range(0, rows, block):  # random values, written in blocks
            array[start : start + block] = generator.standard_normal((min(block, rows - start), *shape), np.float32)
        array.flush()
        del array
    with path.open("rb") as file:  # read once in order: the timed reads find it in the page cache, as in training
        while file.read(1 << 26):
            pass
    rows_file = SimpleNamespace(kind="feature cache", bad=(), dir=root, load=lambda: np.load(path, mmap_mode="r"))
    dataset.inputs = Inputs(dataset.source, None, features=rows_file)  # the random rows stand for the cache
    if rows < len(dataset.source):  # only the cached images' items
        keep = [i for i, (image, _) in enumerate(dataset.items) if image < rows]
        dataset.items = [dataset.items[i] for i in keep]
    torch.manual_seed(0)
    result = {}
    for prefetch in (0, module.prefetch):
        module.prefetch = prefetch
        loader = module._loader("train", shuffle=True)
        iterator = endless(loader)
        for _ in range(20):  # warm up: the first batches fault the rows' pages in
            next(iterator)
        waited, start = 0.0, time.perf_counter()
        for _ in range(batches):
            asked = time.perf_counter()
            next(iterator)
            waited += time.perf_counter() - asked
            if prefetch:
                time.sleep(step_ms / 1000)
        if prefetch:
            result |= {"prefetch": prefetch, "wait_ms": 1000 * waited / batches, "step_ms": step_ms}
        else:
            result["rate"] = batches / (time.perf_counter() - start)
        iterator.close()
    return result | {"rows": rows}


CONFIG = Path(__file__).resolve().parent.parent / "configs" / "coco_resnet101.yaml"


def image_cache_rates(root: Path, batches: int = 60, workers: int = 2) -> dict[str, float]:
    """`configs/coco_resnet101.yaml`'s input path without its encoder: the training split's image cache built (images
    per second, its size on disk); then training batches per second with `workers` loader workers: the config's own
    (its `batch_size` images, each with `captions_per_image` captions), and batches of 64 images with a caption each
    (`train_captions: all`) from the cache and from the original files; and how far the cache's JPEG moves a pixel
    (mean absolute difference in levels of 255, over 32 images)."""
    import numpy as np
    import torch
    import yaml

    from captioner.data.datamodules import CocoDataModule
    from captioner.models.encoder import Encoder

    config = yaml.safe_load(CONFIG.read_text())
    data, model = config["data"]["init_args"], config["model"]
    encoder = Encoder(model["backbone"], pretrained=False, image_size=model["image_size"])
    result = {"size": model["image_size"], "batch_size": data["batch_size"], "k": data["captions_per_image"]}
    runs = {  # name: (image cache, train_captions, batch_size)
        "config": (True, data["train_captions"], data["batch_size"]),
        "cache_rate": (True, "all", 64),
        "file_rate": (False, "all", 64),
    }
    for name, (cached, captions, batch_size) in runs.items():
        module = CocoDataModule(
            str(root),
            format="karpathy",
            min_word_count=5,
            max_vocab_size=10000,
            num_workers=workers,
            feature_cache=False,
            image_cache=cached,
            train_captions=captions,
            captions_per_image=data["captions_per_image"],
            batch_size=batch_size,
        )
        module.set_encoder(encoder)
        module.setup("fit")
        start = time.perf_counter()
        loader = module.train_dataloader()
        images = module.datasets["train"].inputs.images
        if cached and "build_s" not in result:
            result["build_s"] = time.perf_counter() - start
            result["images"] = len(images.source)
            result["gib"] = images.data.stat().st_size / 2**30
            resize = encoder.preprocessing.transforms().transforms[1]
            picks = np.linspace(0, len(images.source) - 1, 32).astype(int)
            levels = [
                np.abs(
                    np.asarray(images.read(int(i)), np.float32)
                    - np.asarray(resize(images.source.load_image(int(i))), np.float32)
                ).mean()
                for i in picks
            ]
            result["levels"] = float(np.mean(levels))
        torch.manual_seed(0)
        iterator = endless(loader)
        for _ in range(3):  # the workers start
            next(iterator)
        start = time.perf_counter()
        captions = 0
        for _ in range(batches):
            captions += len(next(iterator)["lengths"])
        seconds = time.perf_counter() - start
        result[name], result[f"{name}_captions"] = batches / seconds, captions / seconds
        del iterator
    return result


def main() -> None:
    script = Script(__file__, __doc__)
    script.option("--size", type=float, default=0.05, help="a fraction of COCO's size (1: full size)")
    script.option("--cache-rows", type=int, default=None, help="cap the loader's cache at this many images")
    script.option("--rows", choices=sorted(ROWS), default="lite0", help="the loader's cache rows (see ROWS)")
    script.option("--loader-only", action="store_true", help="leave out the setup table")
    script.option("--no-image-cache", action="store_true", help="leave out the paper model's image cache")
    script.option("--folder", help="where to write the data (default: a temporary folder)")
    options = script.start()
    counts = {split: max(1, round(n * options.size)) for split, n in COCO.items()}
    print(f"images: {counts}", flush=True)
    setups = script.table("coco_scale", f"setup at {options.size:g} of COCO's size (import time excluded)")
    shape, dtype = ROWS[options.rows]
    title = f"the training loader: batches of 64 from a feature cache of {'x'.join(map(str, shape))} "
    loader = script.table("coco_scale_loader", title + f"{np.dtype(dtype).name} rows ({options.rows}), main process")
    images = script.table("coco_scale_image_cache", "configs/coco_resnet101.yaml's image cache, 2 loader workers")
    with tempfile.TemporaryDirectory() as temporary:
        root = Path(options.folder or temporary).resolve()
        root.mkdir(parents=True, exist_ok=True)
        if not (root / "dataset_coco.json").exists():
            start = time.perf_counter()
            write_split(root, counts)
            print(f"wrote the split and its files in {time.perf_counter() - start:.0f} s", flush=True)
        for made in [*root.glob("vocab-*.json"), *root.glob("splits/*.npz")]:
            made.unlink()  # the first setup builds them: the vocabulary, the encoded splits
        shutil.rmtree(root / "image_cache", ignore_errors=True)  # its build is timed
        for cached in root.glob("cider-*.npz"):
            cached.unlink()  # the first SCST setup counts the document frequencies
        runs = [("fit, first", "fit", SETUP), ("fit, again", "fit", SETUP), ("test", "test", SETUP)]
        runs += [("SCST's CIDEr-D, first", "", SCST), ("SCST's CIDEr-D, again", "", SCST)]
        for name, stage, code in [] if options.loader_only else runs:

            def setup(stage=stage, code=code) -> dict:
                record = setup_run(root, stage, code)
                return {
                    "seconds": f"{record['seconds']:.1f}",
                    "peak memory, MiB": f"{record['peak_mib']:.0f}",
                    "vocabulary": record["vocab"],
                }

            setups.measure({"setup": name}, setup)
        loader.measure({"cache rows": options.cache_rows or "all"}, lambda: loader_row(root, options))
        if not options.no_image_cache:
            images.measure({"size": "the training split"}, lambda: image_cache_row(root))
    script.finish()


def loader_row(root: Path, options) -> dict:
    loader = loader_rate(root, options.cache_rows, options.rows)
    return {
        "images' rows": loader["rows"],
        "batches/s, read when asked": f"{loader['rate']:.0f}",
        f"wait a batch between steps of {loader['step_ms']:g} ms, read ahead (prefetch {loader['prefetch']})":
            f"{loader['wait_ms']:.3f} ms",
        "batches/s of its own time, read ahead": f"{1000 / max(loader['wait_ms'], 1e-9):,.0f}",
    }  # fmt: skip


def image_cache_row(root: Path) -> dict:
    images = image_cache_rates(root)
    return {
        "JPEG (quality 95)": f"{images['size']}x{images['size']}",
        "built, s": f"{images['build_s']:.0f}",
        "images/s built": f"{images['images'] / images['build_s']:.0f}",
        "GiB": f"{images['gib']:.2f}",
        "images": images["images"],
        "a pixel moves, levels of 255": f"{images['levels']:.2f}",
        f"the config's batches/s ({images['batch_size']} images x {images['k']} captions)": f"{images['config']:.1f}",
        "its captions/s": f"{images['config_captions']:.0f}",
        "64 images a batch, batches/s from the cache": f"{images['cache_rate']:.1f}",
        "from the original files": f"{images['file_rate']:.1f}",
    }


if __name__ == "__main__":
    sys.exit(main())
