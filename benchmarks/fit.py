"""`captioner fit --config configs/coco_resnet101.yaml` as users run it, at COCO's size, on one GPU: the paper's model
(ResNet-101 at 448 pixels pooled to 14x14x2048, a 512-d decoder, about 10,000 words) through the image cache, on a
synthetic Karpathy split of COCO's shape; each phase's seconds, the fit's share of the same steps run alone, and the
projected time of the paper's schedule.

    python benchmarks/fit.py                    # COCO's full size: 113,287 training images, 5,000 val (GPU: ~10 min)
    python benchmarks/fit.py --fraction 0.25    # a quarter of the training images; validation stays 5,000 images
    python benchmarks/fit.py --smoke            # tiny, on the CPU: checks the script; its figures mean nothing

The data (`common.write_split`, on this machine's disk): `dataset_coco.json` in Karpathy's layout, five captions an
image of COCO's lengths over a 10,000-word vocabulary, and JPEG files at COCO's sizes (eight distinct ones, linked
under every name: each is read and decoded as a real one would be).

The fit: the shipped config through the CLI, in a process of its own, for two epochs, with these changes:
- the image cache, also where the feature cache would fit (`--data.init_args.feature_cache=false`): at COCO's size
  the paper model's annotations (85 GiB in float16) do not fit a 64 GiB disk and the config falls back to it, so a
  fraction rehearses the same path (the encoder runs at every step on the cache's 448x448 JPEGs);
- an untrained encoder (`--model.pretrained=false`: torchvision's weights cannot be downloaded here; the speed is the
  same), under bf16-mixed rather than the config's 16-mixed: an untrained ResNet-101's annotations reach 10^5, beyond
  float16's range, and a first step under float16 autocast overflows, which a pretrained encoder's does not;
- as many loader workers as the machine has cores, up to 16 (the config's 4 are for a small machine).

Epoch 0 compiles the step's graphs and carries the instruments, so it is never timed, and is not validated
(`--trainer.check_val_every_n_epoch=2`: validation, of 5,000 images, after epoch 1 only): after its first 100 steps,
40 steps between two logging steps run under torch.cuda.set_sync_debug_mode("warn") (every operation that makes the
host wait for the GPU, with its line; on a CPU, tests/host_syncs.py's HostSyncs), and after the next logging step 40
more under torch.profiler (a `torch.profiler.schedule`: the wall and the device's busy milliseconds per step, and the
operators that take the most host and device time). Epoch 1 is the timed one. (Lightning's ThroughputMonitor would
time it, but it synchronizes the device at every step, the very wait this fit must not have; its Timer times a
stage whole, and here an epoch's training and validation interleave.) Before epoch 1, in the same process, the same
steps run alone on 16 of its own batches, already on the device (forward, loss, backward, clipping, Adam, under the
fit's precision, through the graphs epoch 0 compiled): what the fit would train at with no loader and no Lightning
loop. (Their few optimizer steps train the model on a little further; the speed of what follows is the same.)

Each phase's row is printed, and written to --out (fit.jsonl), as soon as it ends: a run stopped early keeps them.
The projection: the config's 20 epochs of the full training split (566,435 captions an epoch), each followed by a
validation of 5,000 images, plus the set-up, the image cache's build and the compiling, each scaled from what this
run measured to COCO's size where it grows with the data.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from common.harness import REPO, Script, Table, in_own_process, synchronize
from common.synthetic import COCO, write_split
from lightning.pytorch.callbacks import Callback

START = time.perf_counter()  # in the fit's process: imported as its config is read, before the data are read
EPOCHS = 20  # configs/coco_resnet101.yaml's max_epochs
FULL_CAPTIONS = 5 * (COCO["train"] + COCO["restval"])  # an epoch of the full training split


class FitPhases(Callback):
    """In the fit's process: each phase's seconds, as a row (`rows`: a folder for fit_phases.jsonl) and in a JSON
    record (`record`), written as each phase ends; at the fit's end, the same steps alone (`bare_steps`). The device
    is synchronized at each phase's end only (a few times an epoch)."""

    def __init__(self, record: str, rows: str, bare_batches: int = 16):
        self.path, self.bare_batches = Path(record), bare_batches
        self.rows = Table("fit_phases", "the fit's phases, as each ends", Path(rows))
        self.record: dict = {"phases": {}, "epochs": []}
        self.mark = START

    def _phase(self, pl_module, name: str, row: dict | None = None) -> float:
        synchronize(pl_module.device)
        now = time.perf_counter()
        seconds, self.mark = now - self.mark, now
        self.record["phases"][name] = seconds
        self.rows.add({"phase": name, "seconds": f"{seconds:.1f}", **(row or {})})
        self.path.write_text(json.dumps(self.record))
        return seconds

    def on_fit_start(self, trainer, pl_module):  # the datamodule is set up: the split read, the vocabulary built
        self._phase(pl_module, "setup: the split and the vocabulary")

    def on_sanity_check_start(self, trainer, pl_module):  # the val loader made: its image cache built
        self._phase(pl_module, "image cache: the val split")

    def on_sanity_check_end(self, trainer, pl_module):
        self._phase(pl_module, "sanity check: 2 val batches")

    def on_train_start(self, trainer, pl_module):  # the training loader made: its image cache built
        self._phase(pl_module, "image cache: the training split")

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:  # the graphs are compiled: the steps alone first, then the timed epoch
            self.rows.measure({"phase": "the same steps alone: the fit's batches, on the device"}, self.bare_steps)
        synchronize(pl_module.device)
        self.mark = self.step_end = time.perf_counter()
        self.epoch = {"training": 0.0, "captions": 0, "steps": 0, "in_step": 0.0, "between_steps": 0.0}
        self.epoch |= {"validation": 0.0, "images": 0}
        self.record["epochs"].append(self.epoch)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        # The host's time, no device read: from a step's end to the next one's start (the loader's next batch, its
        # copy to the device, the loop) and within the step (queueing its work, and any wait for the device in it)
        self.step_start = time.perf_counter()
        self.epoch["between_steps"] += self.step_start - self.step_end

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.step_end = time.perf_counter()
        self.epoch["in_step"] += self.step_end - self.step_start
        self.epoch["steps"] += 1
        if batch:
            self.epoch["captions"] += batch["captions"].size(0)  # a shape: no read of the device

    def on_validation_start(self, trainer, pl_module):
        if not trainer.sanity_checking and self.record["epochs"]:
            self._training_ends(pl_module)

    def on_train_epoch_end(self, trainer, pl_module):  # an epoch without validation
        if "training_row" not in self.epoch:
            self._training_ends(pl_module)

    def _training_ends(self, pl_module) -> None:
        i, epoch = len(self.record["epochs"]) - 1, self.epoch
        synchronize(pl_module.device)
        epoch["training"] = time.perf_counter() - self.mark
        per_step = {key: 1000 * epoch[key] / max(1, epoch["steps"]) for key in ("between_steps", "in_step")}
        name = f"epoch {i}: training" + (" (compiling; instrumented: not a rate)" if i == 0 else "")
        rate = f"{epoch['captions'] / epoch['training']:.0f} captions/s" if i else ""
        host = "{between_steps:.2f}, {in_step:.2f}".format(**per_step)
        row = {"steps": epoch["steps"], "figure": rate, "host ms a step: loader and loop, step": host}
        epoch["training_row"] = True
        self._phase(pl_module, name, row)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking and self.record["epochs"] and batch:
            self.epoch["images"] += batch["index"].numel()

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking and self.record["epochs"]:
            i, images = len(self.record["epochs"]) - 1, self.epoch["images"]
            synchronize(pl_module.device)
            self.epoch["validation"] = time.perf_counter() - self.mark
            figure = f"{1000 * self.epoch['validation'] / max(1, images):.2f} s per 1,000 images"
            self._phase(pl_module, f"epoch {i}: validation ({images:,} images)", {"figure": figure})

    def bare_steps(self) -> dict:
        """The fit's own step (`TeacherForcing` through the model, the graphs it compiled), its backward, clipping at
        the config's value and Adam, under its precision, on `bare_batches` of its training batches moved to the
        device first: a loop with no loader and no Lightning around it. And the decoder's part alone, on those
        batches' annotations (the encoder's output computed first)."""
        from captioner.objectives import TeacherForcing

        trainer, module = self.trainer, self.module
        model = module.model
        iterator = iter(trainer.datamodule.train_dataloader())
        batches = [trainer.strategy.batch_to_device(next(iterator)) for _ in range(self.bare_batches)]
        del iterator
        optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        clip = trainer.gradient_clip_val or 0.0
        objective = TeacherForcing()

        def step(batch):
            optimizer.zero_grad(set_to_none=True)
            with trainer.precision_plugin.forward_context():
                loss, _ = objective(model, batch)
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()

        def rate(data) -> float:
            for batch in data:  # a caption length not met in the fit compiles here, untimed
                step(batch)
            synchronize(module.device)
            start = time.perf_counter()
            for _ in range(3):
                for batch in data:
                    step(batch)
            synchronize(module.device)
            return 3 * sum(b["captions"].size(0) for b in data) / (time.perf_counter() - start)

        alone = rate(batches)
        with torch.no_grad(), trainer.precision_plugin.forward_context():
            annotated = [{**b, "images": None, "annotations": model.annotate(b["images"])} for b in batches]
        decoder = rate(annotated)
        self.record["bare"] = {"captions_per_s": alone, "decoder_captions_per_s": decoder}
        return {"figure": f"{alone:.0f} captions/s", "the decoder's part alone": f"{decoder:.0f} captions/s"}

    def setup(self, trainer, pl_module, stage):
        self.trainer, self.module = trainer, pl_module


class Instruments(Callback):
    """In epoch 0, once `after` steps have run (the step's graphs compiled): `steps` steps from a logging step on
    under a watch for host waits, then `steps` more from the next logging step under torch.profiler; each stretch
    ends before the next logging step, whose reads are the loggers'. Writes `<folder>/waits.json` and
    `<folder>/profile.txt`."""

    def __init__(self, folder: str, after: int = 100, steps: int = 40):
        self.folder, self.after, self.steps = Path(folder), after, steps
        self.watch = self.profiler = None
        self.first: int | None = None
        self.profiled = False

    def _boundary(self, trainer) -> bool:
        every = trainer.log_every_n_steps
        if self.steps >= every:
            raise ValueError(f"a stretch of {self.steps} steps would hold a logging step (every {every})")
        return trainer.current_epoch == 0 and trainer.global_step >= self.after and trainer.global_step % every == 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.watch is None and self.first is None and self._boundary(trainer):
            self.first = trainer.global_step
            self._watch(trainer, pl_module)
        elif self.profiler is None and not self.profiled and self._after_the_watch(trainer):
            self._profile(pl_module)

    def _after_the_watch(self, trainer) -> bool:
        return self.first is not None and trainer.global_step > self.first and self._boundary(trainer)

    def _watch(self, trainer, pl_module) -> None:
        if pl_module.device.type == "cuda":
            self.caught = warnings.catch_warnings(record=True)
            self.seen = self.caught.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            self.watch = "cuda"
        else:
            sys.path.insert(0, str(REPO))
            from tests.host_syncs import HostSyncs

            optimizer = trainer.optimizers[0]

            def on_the_host():  # torch's Adam keeps its step counts there, FiniteLosses its copy of a loss
                return [state["step"] for state in optimizer.state.values()] + [pl_module.finite_losses.host]

            self.watch = HostSyncs(on_the_host)
            self.watch.__enter__()

    def _profile(self, pl_module) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if pl_module.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # the step that enters it is warm-up; then `steps` steps recorded, and the report written
        schedule = torch.profiler.schedule(wait=0, warmup=1, active=self.steps, repeat=1)
        self.profiler = torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=self._report)
        self.device = pl_module.device
        self.profiler.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.watch is not None and trainer.global_step - self.first == self.steps:
            self._stop_watch()
        if self.profiler is not None:
            if self.profiler.step_num == 0:  # the warm-up step ends: the recorded steps begin
                synchronize(self.device)
                self.start = time.perf_counter()
            self.profiler.step()  # after the last recorded step, writes the report (`_report`)
            if self.profiled:
                self.profiler.__exit__(None, None, None)
                self.profiler = None

    def _stop_watch(self) -> None:
        if self.watch == "cuda":
            torch.cuda.set_sync_debug_mode(0)
            # torch's text for a wait; not its warning that the debug mode is a prototype, caught here too
            waits = [w for w in self.seen if "called a synchronizing CUDA operation" in str(w.message)]
            lines = [f"{w.filename}:{w.lineno}: {w.message}" for w in waits]
            self.caught.__exit__(None, None, None)
        else:
            self.watch.__exit__(None, None, None)
            lines = [f"{where}: {what}" for what, where in self.watch.seen]
        self.watch = None
        record = {"first_step": self.first, "steps": self.steps, "waits": lines}
        (self.folder / "waits.json").write_text(json.dumps(record, indent=1))
        print(f"\n{len(lines)} host waits in {self.steps} steps from step {self.first}", flush=True)
        for line in sorted(set(lines))[:10]:  # where each kind of wait is, now: the run may be stopped before its end
            print(" ", line, flush=True)

    def _report(self, profiler) -> None:
        synchronize(self.device)
        wall = time.perf_counter() - self.start
        self.profiled = True
        events = profiler.key_averages()
        busy = sum(event.self_device_time_total for event in events) / 1e3  # microseconds to ms
        lines = [
            f"{self.steps} steps: wall {1000 * wall / self.steps:.2f} ms a step, device busy {busy / self.steps:.2f}"
            f" ms a step ({busy / (1000 * wall):.0%} of the wall)",
            "",
            "host time, most first:",
            events.table(sort_by="self_cpu_time_total", row_limit=20),
        ]
        if self.device.type == "cuda":
            lines += ["device time, most first:", events.table(sort_by="self_device_time_total", row_limit=20)]
        (self.folder / "profile.txt").write_text("\n".join(lines))
        print(lines[0], flush=True)

    def on_train_epoch_end(self, trainer, pl_module):  # an epoch too short for the stretches
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            self.profiler = None
        if self.watch is not None:
            self._stop_watch()


# The CLI, with the compiled step under tests/cuda_graphs.py's stand-in (--smoke: as CUDA graphs would treat it)
SMOKE_CLI = """
import sys
sys.path.insert(0, sys.argv.pop(1))
from tests.cuda_graphs import cuda_graph_stand_in
from captioner.cli import main
with cuda_graph_stand_in("eager"):
    main(sys.argv[1:])
"""


def fit_command(root: Path, smoke: bool, *extra: str) -> list[str]:
    """`captioner fit --config configs/coco_resnet101.yaml` on the data in `root`, with this script's changes (its
    docstring says why) and `extra` arguments."""
    cli = ["-c", SMOKE_CLI, str(REPO)] if smoke else ["-m", "captioner.cli"]
    command = [
        *cli,
        "fit",
        f"--config={REPO / 'configs' / 'coco_resnet101.yaml'}",
        "--model.pretrained=false",
        "--data.init_args.download=false",
        f"--data.init_args.data_dir={root}",
        "--data.init_args.feature_cache=false",
        f"--data.init_args.num_workers={2 if smoke else min(16, os.cpu_count() or 1)}",
        "--trainer.max_epochs=2",
        "--trainer.check_val_every_n_epoch=2",  # validation after the timed epoch only
        f"--trainer.precision={'32-true' if smoke else 'bf16-mixed'}",
    ]
    if smoke:  # minutes of ResNet-101 at 448 and of the paper's decoder on a CPU otherwise
        command += ["--model.image_size=224", "--data.init_args.batch_size=4", "--trainer.log_every_n_steps=5"]
        command += ["--model.embed_dim=32", "--model.decoder_dim=32", "--model.attention_dim=32"]
        command.append("--model.compile=true")  # the GPU's default: the fixed-shape step, compiled
    return [*command, *extra]


def run_fit(root: Path, smoke: bool, rows: Path) -> dict:
    """The fit in `root`, where the data are, with FitPhases (its rows to `rows`/fit_phases.jsonl) and Instruments:
    what they recorded, and the fit's rows."""
    record = root / "phases.json"
    phases = {"record": str(record), "rows": str(rows), "bare_batches": 4 if smoke else 16}
    instruments = {"folder": str(root), "after": 0 if smoke else 100, "steps": 3 if smoke else 40}
    extra = [f"--trainer.callbacks+={json.dumps({'class_path': 'fit.FitPhases', 'init_args': phases})}"]
    extra.append(f"--trainer.callbacks+={json.dumps({'class_path': 'fit.Instruments', 'init_args': instruments})}")
    # benchmarks/ importable for the callbacks; relative entries of PYTHONPATH made absolute (the folder changes)
    paths = [str(Path(__file__).resolve().parent)]
    paths += [str(Path(p).resolve()) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    status = in_own_process(fit_command(root, smoke, *extra), cwd=root, env=env, echo=True, peak=False).status
    result = json.loads(record.read_text()) if record.exists() else {"phases": {}, "epochs": []}
    waits, profile = root / "waits.json", root / "profile.txt"
    result["waits"] = json.loads(waits.read_text()) if waits.exists() else None
    result["profile"] = profile.read_text() if profile.exists() else None
    written = rows / "fit_phases.jsonl"
    result["rows"] = [json.loads(line) for line in written.read_text().splitlines()] if written.exists() else []
    return result | {"status": status}


def projection(record: dict, counts: dict[str, int]) -> dict | None:
    """The paper's schedule at COCO's size, from what this run measured: None until epoch 1 and its validation have
    run. Returns its parts' seconds: each epoch's and validation's, and once the set-up (split, vocabulary), the image
    cache's build and the compiling (epoch 0's time beyond its steps at epoch 1's rate)."""
    phases, epochs = record["phases"], record["epochs"]
    if len(epochs) < 2 or not epochs[1]["validation"] or not epochs[1]["captions"]:
        return None
    scale = FULL_CAPTIONS / (5 * (counts["train"] + counts["restval"]))  # this run's training split to COCO's
    images = sum(counts.values())
    setup = phases.get("setup: the split and the vocabulary", 0.0) * sum(COCO.values()) / images
    cache = phases.get("image cache: the training split", 0.0) * scale + phases.get("image cache: the val split", 0.0)
    per_step = epochs[1]["training"] / epochs[1]["steps"]
    compiling = max(0.0, epochs[0]["training"] - per_step * epochs[0]["steps"])
    epoch = FULL_CAPTIONS / (epochs[1]["captions"] / epochs[1]["training"])
    validation = epochs[1]["validation"] * 5000 / max(1, epochs[1]["images"])
    total = setup + cache + compiling + EPOCHS * (epoch + validation)
    parts = {"setup": setup, "image cache": cache, "compiling": compiling, "epoch": epoch, "validation": validation}
    return parts | {"total": total}


def main() -> None:
    script = Script(__file__, __doc__, smoke="tiny, on the CPU: checks the script only")
    script.option("--fraction", type=float, default=1.0, help="of COCO's training images (val: 5,000 always)")
    script.option("--folder", help="where to write the data and run (default: a temporary folder, removed)")
    options = script.start()
    if not options.smoke and not torch.cuda.is_available():
        print("fit.py: no CUDA device here; it measures a GPU's fit (--smoke checks the script on a CPU)")
        return
    if options.smoke:
        counts = {"train": 64, "restval": 16, "val": 8, "test": 8}
    else:
        counts = {split: round(n * options.fraction) for split, n in COCO.items() if split in ("train", "restval")}
        counts |= {"val": COCO["val"], "test": COCO["test"]}
    print(f"images: {counts}", flush=True)
    out = script.out
    rows = script.table("fit", "`captioner fit --config configs/coco_resnet101.yaml`")
    with tempfile.TemporaryDirectory() as temporary:
        root = Path(options.folder or temporary).resolve()
        root.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        total = write_split(root, counts)
        seconds = f"{time.perf_counter() - start:.1f}"
        rows.add({"phase": f"data written: {total:,} images' split and files", "seconds": seconds})
        record = run_fit(root, options.smoke, out or root)
    rows.rows += record["rows"]  # the fit's own, printed (and written) as each phase ended
    epochs, bare = record["epochs"], record.get("bare")
    if len(epochs) > 1 and epochs[1]["training"] and bare:
        ratio = epochs[1]["captions"] / epochs[1]["training"] / bare["captions_per_s"]
        rows.add({"phase": "the fit's epoch 1 against the same steps alone", "figure": f"{ratio:.2f}x"})
    plan = projection(record, counts)
    if plan is not None:
        parts = ", ".join(f"{k} {v / 60:.1f} min" for k, v in plan.items() if k != "total")
        rows.add(
            {
                "phase": f"projected: the paper's schedule at COCO's size ({EPOCHS} epochs of {FULL_CAPTIONS:,} "
                f"captions, each with a 5,000-image validation)",
                "seconds": f"{plan['total']:.0f}",
                "figure": f"{plan['total'] / 60:.1f} min ({parts} an epoch)",
            }
        )
    if record["waits"] is not None:
        waits = record["waits"]
        print(f"\n{len(waits['waits'])} host waits in {waits['steps']} steps from step {waits['first_step']}:")
        for line in waits["waits"]:
            print(" ", line)
    if record["profile"]:
        print(f"\nprofile of epoch 0 (instrumented, after compiling):\n{record['profile']}", flush=True)
    if out is not None:
        for name in ("waits", "profile"):
            if record[name] is not None:
                text = record[name] if isinstance(record[name], str) else json.dumps(record[name], indent=1)
                (out / f"fit_{name}.{'txt' if name == 'profile' else 'json'}").write_text(text)
    size = "smoke run" if options.smoke else f"at {options.fraction:g} of COCO's training images"
    script.finish(f", {size}, 2 epochs (the fit's exit status: {record['status']})")
    if record["status"]:
        sys.exit(record["status"])


if __name__ == "__main__":
    sys.exit(main())
