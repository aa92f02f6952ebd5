"""`captioner fit` as users run it on COCO: the shipped `configs/coco_resnet101.yaml` (the paper's sizes: ResNet-101 at
448 pixels pooled to 14x14x2048, a 512-d decoder, a vocabulary of about 10,000 words; frozen encoder, feature cache,
clipping, both loggers, checkpoints, early stopping, the progress bar), run through the CLI in a new process, on a
synthetic Karpathy split of COCO's shape. And, in the same run, the compiled training step alone.

    python benchmarks/fit.py                   # on a CUDA machine: 5,000 training images, 300 val, 3 epochs
    python benchmarks/fit.py --images 20000    # larger (the feature cache takes 157 KiB per image in float16)
    python benchmarks/fit.py --smoke           # tiny, on the CPU: checks the script; its figures mean nothing

The data: `dataset_coco.json` with COCO's Karpathy layout (splits train/restval/val/test, five captions per image);
caption lengths of 7 + Poisson(3.5) words (COCO's mean, about 10.5); words drawn from a Zipf distribution over 10,000
types, each type used at least five times so that the vocabulary (min_word_count 5) has COCO's 10,000 words. Images
are JPEG files at COCO's sizes (640x480, 480x640, 640x427, 500x375, 427x640), eight distinct ones of smooth noise,
linked under every file name: every image is read and decoded as a real one would be.

It reports:
- setup: from the reading of the config to the first training batch (reading the split, the vocabulary, building the
  feature cache of the training and validation images), and the images cached per second of it;
- training captions/s of each epoch (the first compiles the step's shapes; the later ones are the figure), and where
  the host's time goes per step: between steps (the loader's next batch, its copy to the device, Lightning's loop) and
  within (the step's queueing, and any wait for the device);
- validation: seconds per 1,000 images (the loss and a greedy decode of every image, then the corpus scores);
- the compiled step alone at the same sizes and precision (forward, loss, backward, clipping at 5, Adam, under
  bfloat16 autocast, as Lightning's bf16-mixed runs it), captions/s, on batches of the fit's shape (16 images x 5
  captions of COCO's lengths: mostly 16 or 24 steps once bucketed), and the fit's share of it; and on gpu.py's
  batches (64 captions of 8-16 tokens: 16 steps), the figure of earlier runs.

Two changes to the shipped config, both forced by the machines it is meant for, which have no internet: the encoder
is untrained (`--model.pretrained=false`: torchvision's weights cannot be downloaded), and the precision is bf16-mixed
rather than the config's 16-mixed. An untrained ResNet-101's annotations reach 10^5, beyond float16's range (65,504):
under float16 autocast the first projection overflows and the run stops on an infinite loss, which a pretrained
encoder's annotations do not do. bfloat16 has float32's range. (So the cache is float32 too, as a log line says: twice
the disk of a pretrained encoder's float16 cache, and slower to read. 16-mixed would also add a read of the
GradScaler's overflow flag at every step, which bf16-mixed does not have.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from common import machine, table
from lightning.pytorch.callbacks import Callback
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
SIZES = [(640, 480), (480, 640), (640, 427), (500, 375), (427, 640)]  # COCO's commonest image sizes
TYPES = 10_000  # word types: COCO's vocabulary at min_word_count 5 is about this size
START = time.perf_counter()  # in the fit's process: imported as its config is read, before the data are read


def write_images(folder: Path, names: list[str], distinct: int = 8, seed: int = 0) -> None:
    """JPEG files at COCO's sizes under `names`: `distinct` different ones, the rest links to them."""
    folder.mkdir(parents=True, exist_ok=True)
    generator = np.random.default_rng(seed)
    sources = []
    for i in range(distinct):
        width, height = SIZES[i % len(SIZES)]
        coarse = generator.integers(0, 256, (height // 16 + 1, width // 16 + 1, 3), dtype=np.uint8)
        smooth = Image.fromarray(coarse).resize((width, height), Image.BICUBIC)
        noise = generator.normal(0, 12, (height, width, 3))
        pixels = np.clip(np.asarray(smooth, dtype=np.float32) + noise, 0, 255).astype(np.uint8)
        source = folder / f"source_{i}.jpg"
        Image.fromarray(pixels).save(source, quality=90)
        sources.append(source)
    for i, name in enumerate(names):
        os.symlink(sources[i % distinct].name, folder / name)


def write_split(root: Path, counts: dict[str, int], seed: int = 0) -> int:
    """`root/dataset_coco.json` and the images under root/train2014 and root/val2014; returns the images' count."""
    generator = np.random.default_rng(seed)
    total = sum(counts.values())
    lengths = 7 + generator.poisson(3.5, (total, 5))
    ranks = 1.0 / np.arange(1, TYPES + 1)
    words = generator.choice(TYPES, size=int(lengths.sum()), p=ranks / ranks.sum())
    train_words = int(lengths[: counts["train"] + counts["restval"]].sum())
    covered = min(train_words, 5 * TYPES)  # each type five times in the training captions, where there is room
    words[generator.permutation(train_words)[:covered]] = np.arange(covered) % TYPES
    vocabulary = [f"w{i}" for i in range(TYPES)]
    images, position, index = [], 0, 0
    folders = {"train": "train2014", "restval": "val2014", "val": "val2014", "test": "val2014"}
    names: dict[str, list[str]] = {"train2014": [], "val2014": []}
    for split, count in counts.items():
        for _ in range(count):
            sentences = []
            for length in lengths[index]:
                tokens = [vocabulary[w] for w in words[position : position + length]]
                position += length
                sentences.append({"tokens": tokens, "raw": " ".join(tokens)})
            name = f"COCO_{folders[split]}_{index:012d}.jpg"
            names[folders[split]].append(name)
            images.append(
                {"filepath": folders[split], "filename": name, "split": split, "cocoid": index, "sentences": sentences}
            )
            index += 1
    for folder, files in names.items():
        write_images(root / folder, files)
    (root / "dataset_coco.json").write_text(json.dumps({"images": images, "dataset": "coco"}))
    return total


class FitTimes(Callback):
    """The fit's phases, written as JSON at its end: setup seconds (the config's reading to the first batch), and per
    epoch the training seconds and captions, and the validation seconds and images. The device is synchronized at
    each phase's end only (a few times an epoch), so that the times are the device's, not the host's queueing."""

    def __init__(self, output: str):
        self.output = output
        self.record: dict = {"setup": None, "epochs": []}
        self.since = 0.0

    def _now(self, pl_module) -> float:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        return time.perf_counter()

    def on_train_epoch_start(self, trainer, pl_module):
        now = self._now(pl_module)
        if self.record["setup"] is None:
            self.record["setup"] = now - START
        self.record["epochs"].append({"training": 0.0, "captions": 0, "validation": 0.0, "images": 0})
        self.record["epochs"][-1] |= {"steps": 0, "in_step": 0.0, "between_steps": 0.0}
        self.since = self.step_end = now

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        # The host's time, no device read: from a step's end to the next one's start (the loader's next batch, its
        # copy to the device, the loop) and within the step (queueing its work, and any wait for the device in it)
        self.step_start = time.perf_counter()
        self.record["epochs"][-1]["between_steps"] += self.step_start - self.step_end

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.step_end = time.perf_counter()
        epoch = self.record["epochs"][-1]
        epoch["in_step"] += self.step_end - self.step_start
        epoch["steps"] += 1
        if batch:
            epoch["captions"] += batch["captions"].size(0)  # a shape: no read of the device

    def on_validation_start(self, trainer, pl_module):
        if self.record["epochs"] and not trainer.sanity_checking:
            now = self._now(pl_module)
            self.record["epochs"][-1]["training"] += now - self.since
            self.since = now

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if self.record["epochs"] and not trainer.sanity_checking and batch:
            self.record["epochs"][-1]["images"] += batch["index"].numel()

    def on_validation_end(self, trainer, pl_module):
        if self.record["epochs"] and not trainer.sanity_checking:
            now = self._now(pl_module)
            self.record["epochs"][-1]["validation"] += now - self.since
            self.since = now
            self._report()

    def _report(self) -> None:
        """Each epoch's figures as soon as it ends, and the record so far: a run stopped early keeps them."""
        print(f"\nFitTimes: setup {self.record['setup']:.1f} s; {self.record['epochs'][-1]}", flush=True)
        Path(self.output).write_text(json.dumps(self.record))

    def on_train_epoch_end(self, trainer, pl_module):
        if not trainer.val_dataloaders or trainer.limit_val_batches == 0:  # no validation closed the segment
            now = self._now(pl_module)
            self.record["epochs"][-1]["training"] += now - self.since
            self._report()

    def on_fit_end(self, trainer, pl_module):
        Path(self.output).write_text(json.dumps(self.record))


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
            # torch's text for a wait; not its warning that the debug mode is a prototype, caught here too
            waits = [w for w in self.caught if "called a synchronizing CUDA operation" in str(w.message)]
            self.seen = [f"{w.filename}:{w.lineno}: {w.message}" for w in waits]
            self.watch.__exit__(None, None, None)
        else:
            self.watch.__exit__(None, None, None)
            self.seen = [f"{where}: {what}" for what, where in self.watch.seen]
        self.watch = None
        record = {"first_step": self.first, "steps": self.steps, "waits": self.seen}
        Path(self.output).write_text(json.dumps(record, indent=1))


class ProfileStretch(Callback):
    """Profiles `steps` training steps of epoch `epoch` with torch.profiler, from its second logging step on (after
    SyncStretch's stretch, so that the two do not overlap; again a stretch without a logging step), and writes to
    `output` where the time goes: the wall and the device's busy milliseconds per step (the device's share of the
    wall says whether the GPU waits for the host), and the operators that take the most host time and device time."""

    def __init__(self, output: str, epoch: int = 1, steps: int = 20, rows: int = 20):
        self.output, self.epoch, self.steps, self.rows = output, epoch, steps, rows
        self.boundaries = 0
        self.first: int | None = None
        self.profiler = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        every = trainer.log_every_n_steps
        if self.first is None and trainer.current_epoch == self.epoch and trainer.global_step % every == 0:
            self.boundaries += 1
            if self.boundaries == 2:
                if self.steps >= every:
                    raise ValueError(f"a stretch of {self.steps} steps would include a logging step (every {every})")
                self.first = trainer.global_step
                activities = [torch.profiler.ProfilerActivity.CPU]
                if pl_module.device.type == "cuda":
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                    torch.cuda.synchronize(pl_module.device)
                self.profiler = torch.profiler.profile(activities=activities)
                self.profiler.__enter__()
                self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.profiler is None or trainer.global_step - self.first < self.steps:
            return
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        wall = time.perf_counter() - self.start
        self.profiler.__exit__(None, None, None)
        events = self.profiler.key_averages()
        self.profiler = None
        busy = sum(event.self_device_time_total for event in events) / 1e3  # microseconds to ms
        lines = [
            f"{self.steps} steps from step {self.first}: wall {1000 * wall / self.steps:.2f} ms per step, device busy"
            f" {busy / self.steps:.2f} ms per step ({busy / (1000 * wall):.0%} of the wall)",
            "",
            "host time, most first:",
            events.table(sort_by="self_cpu_time_total", row_limit=self.rows),
        ]
        if pl_module.device.type == "cuda":
            lines += ["device time, most first:", events.table(sort_by="self_device_time_total", row_limit=self.rows)]
        Path(self.output).write_text("\n".join(lines))


def fit_command(root: Path, epochs: int, smoke: bool, *extra: str) -> list[str]:
    """`captioner fit --config configs/coco_resnet101.yaml` on the data in `root`, with the two changes this script
    makes (its docstring says why), and `extra` arguments."""
    command = [
        sys.executable,
        "-m",
        "captioner.cli",
        "fit",
        f"--config={REPO / 'configs' / 'coco_resnet101.yaml'}",
        "--model.pretrained=false",  # torchvision's weights cannot be downloaded here (the speed is the same)
        "--data.init_args.download=false",
        f"--data.init_args.data_dir={root}",
        f"--trainer.max_epochs={epochs}",
        f"--trainer.precision={'32-true' if smoke else 'bf16-mixed'}",
    ]
    if smoke:  # minutes of ResNet-101 and of the paper's decoder on a CPU otherwise
        command += ["--model.image_size=224", "--data.init_args.batch_size=4"]  # 4 images x 5 captions: 10 steps
        command += ["--model.embed_dim=32", "--model.decoder_dim=32", "--model.attention_dim=32"]
    return [*command, *extra]


def run_in(root: Path, command: list[str]) -> None:
    """Runs `command` in `root` (where the config's checkpoints and logs land), with benchmarks/ importable for the
    callbacks its arguments name. Relative entries of PYTHONPATH are made absolute first: the folder changes."""
    paths = [str(Path(__file__).resolve().parent)]
    paths += [str(Path(p).resolve()) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    subprocess.run(command, cwd=root, env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)}, check=True)


def run_fit(root: Path, epochs: int, smoke: bool, sync_stretch: bool = False) -> dict:
    """The fit in `root`, where the data are, with FitTimes (and SyncStretch and ProfileStretch in its second epoch):
    what they recorded."""
    times = root / "times.json"
    timer = json.dumps({"class_path": "fit.FitTimes", "init_args": {"output": str(times)}})
    extra = [f"--trainer.callbacks+={timer}"]
    if sync_stretch:
        steps, every = (3, 5) if smoke else (40, 50)
        watch = {"class_path": "fit.SyncStretch", "init_args": {"output": str(root / "stretch.json"), "steps": steps}}
        profile = {"class_path": "fit.ProfileStretch", "init_args": {"output": str(root / "profile.txt")}}
        profile["init_args"]["steps"] = steps
        extra += [f"--trainer.callbacks+={json.dumps(watch)}", f"--trainer.log_every_n_steps={every}"]
        extra += [f"--trainer.callbacks+={json.dumps(profile)}"]
        if smoke:  # the fixed-shape step, as on CUDA (Dynamo's capture without code generation)
            extra += ["--model.compile=true", "--model.compile_backend=eager"]
    run_in(root, fit_command(root, epochs, smoke, *extra))
    record = json.loads(times.read_text())
    if sync_stretch:
        record["stretch"] = json.loads((root / "stretch.json").read_text())
        profiled = root / "profile.txt"
        record["profile"] = profiled.read_text() if profiled.exists() else "(not reached: the epoch is too short)"
    return record


def fit_batches(sizes: dict, device: torch.device, count: int = 8, seed: int = 0) -> list[tuple]:
    """`count` batches of the fit's shape: 16 images' annotations (16,P,E) with 5 captions each (80 captions, the
    config's grouped batches), of write_split's lengths (7 + Poisson(3.5) words, then <start> and <end>), padded to
    the batch's longest as the loader pads them; the step pads them further to its bucket (`bucket_steps`)."""
    from gpu import SPECIAL

    generator = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        lengths = torch.from_numpy(7 + generator.poisson(3.5, 80) + 2)  # tokens, <start> and <end> included
        T = int(lengths.max())
        captions = torch.from_numpy(generator.integers(3, sizes["V"], (80, T)))
        captions[:, 0] = SPECIAL["start_index"]
        captions[torch.arange(80), lengths - 1] = SPECIAL["end_index"]
        captions[torch.arange(T) >= lengths.unsqueeze(1)] = SPECIAL["pad_index"]
        a = torch.from_numpy(generator.standard_normal((16, sizes["P"], sizes["E"]), dtype=np.float32)).relu()
        out.append((a.to(device), captions.to(device), lengths.to(device), 5))
    return out


def isolated_step(device: torch.device, smoke: bool) -> dict[str, float]:
    """Captions/s of the compiled step alone at the paper's sizes, as Lightning's bf16-mixed runs it on CUDA: bfloat16
    autocast, clipping at 5, Adam; on gpu.py's batches (64 captions of 8 to 16 tokens, each its own image's: the
    figure of earlier runs) and on batches of the fit's shape (`fit_batches`: 80 captions, 16 images, COCO's lengths,
    so mostly 16 or 24 steps after bucketing: the figure to compare the fit with). (--smoke: tiny sizes, float32,
    Dynamo's capture without code generation.)"""
    from gpu import PAPER, TINY, batches, model

    sizes = TINY if smoke else PAPER
    torch.compiler.reset()
    m = model(sizes, device)
    m.compile_step(**({"mode": "reduce-overhead"} if device.type == "cuda" else {"backend": "aot_eager"}))
    optimizer = torch.optim.Adam(m.parameters(), lr=4e-4)

    def step(a, captions, lengths, per_image=1):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = m(captions, lengths, annotations=a, captions_per_image=per_image).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 5.0)
        optimizer.step()

    rates = {}
    forms = {"B=64": [(*batch, 1) for batch in batches(sizes, 64, device, count=8)], "fit": fit_batches(sizes, device)}
    for name, data in forms.items():
        for batch in data * 2:  # compiles each caption length's graph
            step(*batch)
        rounds = 1 if smoke else 20
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(rounds):
            for batch in data:
                step(*batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        rates[name] = rounds * sum(batch[1].size(0) for batch in data) / (time.perf_counter() - start)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=5000, help="training images (a fifth of them as restval)")
    parser.add_argument("--val", type=int, default=300, help="validation images (as many test images are written)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs: the first compiles, the later ones are timed")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: checks the script only")
    parser.add_argument(
        "--sync-stretch",
        action="store_true",
        help="list the host's waits for the device in 40 steps of epoch 1, and profile 40 more",
    )
    parser.add_argument("--folder", help="where to write the data and run (default: a temporary folder, removed)")
    options = parser.parse_args()
    if options.smoke:
        options.images, options.val, options.epochs = 40, 8, 2
    elif not torch.cuda.is_available():
        print("fit.py: no CUDA device here; it measures a GPU's fit (--smoke checks the script on a CPU)")
        return
    device = torch.device("cuda" if torch.cuda.is_available() and not options.smoke else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (smoke run: not a measurement)"
    print(f"# fit.py on {name}; {machine()}\n", flush=True)

    steps = isolated_step(device, options.smoke)  # first: its figures are kept if the fit runs out of time
    print(f"the compiled step alone: {steps['B=64']:.0f} captions/s at B=64, {steps['fit']:.0f} on the fit's batches")
    with tempfile.TemporaryDirectory() as temporary:
        root = Path(options.folder or temporary).resolve()
        root.mkdir(parents=True, exist_ok=True)
        restval = options.images // 5
        counts = {"train": options.images - restval, "restval": restval, "val": options.val, "test": options.val}
        start = time.perf_counter()
        total = write_split(root, counts)
        print(f"wrote {total} images' split and files in {time.perf_counter() - start:.1f} s", flush=True)
        record = run_fit(root, options.epochs, options.smoke, options.sync_stretch)

    cached = options.images + options.val
    rows = [{"phase": "setup (split, vocabulary, feature cache)", "seconds": f"{record['setup']:.1f}"}]
    rows[0]["figure"] = f"{cached / record['setup']:.0f} images cached/s"
    for i, epoch in enumerate(record["epochs"]):
        rate = epoch["captions"] / epoch["training"] if epoch["training"] else float("nan")
        note = " (compiling)" if i == 0 else ""
        per_step = {key: 1000 * epoch[key] / max(1, epoch["steps"]) for key in ("between_steps", "in_step")}
        rows.append(
            {
                "phase": f"epoch {i}: training{note}",
                "seconds": f"{epoch['training']:.1f}",
                "figure": f"{rate:.0f} captions/s",
                "host ms per step: loader and loop, step": "{between_steps:.1f}, {in_step:.1f}".format(**per_step),
            }
        )
        if epoch["images"]:
            per_thousand = 1000 * epoch["validation"] / epoch["images"]
            rows.append(
                {
                    "phase": f"epoch {i}: validation",
                    "seconds": f"{epoch['validation']:.1f}",
                    "figure": f"{per_thousand:.1f} s per 1,000 images",
                }
            )
    last = record["epochs"][-1]
    fit_rate = last["captions"] / last["training"]
    rows.append({"phase": "the compiled step alone, B=64 of 8-16 tokens", "figure": f"{steps['B=64']:.0f} captions/s"})
    rows.append({"phase": "the compiled step alone, the fit's batches", "figure": f"{steps['fit']:.0f} captions/s"})
    print(f"\n`captioner fit --config configs/coco_resnet101.yaml`, {options.images} training images\n")
    print(table(rows))
    print(
        f"\nthe fit's last epoch trains at {fit_rate / steps['fit']:.2f}x the compiled step alone on batches of its"
        f" shape ({fit_rate / steps['B=64']:.2f}x the step at B=64)",
        flush=True,
    )
    if "stretch" in record:
        stretch = record["stretch"]
        print(f"\n{len(stretch['waits'])} host waits in {stretch['steps']} steps from step {stretch['first_step']}:")
        for line in stretch["waits"]:
            print(" ", line)
        print(f"\nprofile of the fit (ProfileStretch):\n{record['profile']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
