"""How a benchmark script runs and measures, written once for all of them:

- `Script`: the options every script takes (--out; --smoke and --budget where it has them), its own beside them, and
  the line that says where it ran; its tables, each finished the same way at its end; `measure_alone`: one form
  measured by the script again, in a process of its own;
- timing: `timed` (the median of calls), `take_turns` (forms measured call by call in turn, so that a machine's drift
  falls on all of them), `latency` (p50, p95 and images/s of one-at-a-time calls);
- `in_own_process`: a program run in a process of its own, with its output, seconds and peak resident memory, stopped
  past a time limit;
- `Table`: rows printed, and appended to `<out>/<table>.jsonl`, as they are measured; a form that fails is a row with
  its error in one line, and the table goes on."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

REPO = Path(__file__).resolve().parent.parent.parent
CHILD = Path(__file__).with_name("child.py")


def machine() -> str:
    """The device, the CPU model, torch's threads and version: the figures depend on all of them."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line]
        cpu = names[0] if names else cpu
    device = f"CUDA {torch.cuda.get_device_name()}; " if torch.cuda.is_available() else ""
    return f"{device}{cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


# --- a script's run ----------------------------------------------------------------------------------------------


class Script:
    """One run of a benchmark script: its options, the line that says where it ran, and its tables.

        script = Script(__file__, __doc__, smoke="a few calls: checks the script only", budget=True)
        script.option("--calls", type=int, default=30, help="timed calls per form")
        options = script.start()                     # parses, prints "# name.py on <machine>"
        rows = script.table("name", "title")         # rows to <out>/name.jsonl as they are measured
        rows.measure({"form": "eager"}, lambda: {"ms": ...})
        script.finish()                              # every table whole: printed, and to <out>/name.md

    The description in --help is the docstring's first paragraph; `smoke`, where given, is what --smoke does; with
    `alone`, the script can measure a form in a process of its own (`measure_alone`)."""

    def __init__(self, file: str, doc: str | None, smoke: str | None = None, budget: bool = False, alone: bool = False):
        self.file, self.name = Path(file).resolve(), Path(file).name
        self.parser = argparse.ArgumentParser(prog=self.name, description=(doc or "").split("\n\n")[0])
        self.parser.add_argument("--out", help="a folder for the tables: <table>.jsonl, each row as it is measured, "
                                 "and <table>.md, the table whole at the end")  # fmt: skip
        if smoke:
            self.parser.add_argument("--smoke", action="store_true", help=smoke)
        if budget:
            self.parser.add_argument("--budget", type=float, help="seconds: a form not started by then is a row that "
                                     "says so (benchmarks/gpu_check.py's parts)")  # fmt: skip
        if alone:  # what `measure_alone` gives the script again: one thing to measure, as JSON
            self.parser.add_argument("--alone", help=argparse.SUPPRESS)
        self.tables: list[Table] = []
        self.options = argparse.Namespace()

    def option(self, *names: str, **kwargs) -> None:
        self.parser.add_argument(*names, **kwargs)

    @property
    def smoke(self) -> bool:
        return bool(getattr(self.options, "smoke", False))

    @property
    def out(self) -> Path | None:
        return out_folder(self.options.out)

    def start(self, note: str = "") -> argparse.Namespace:
        """The options, parsed; prints the line that says where the figures come from (`note` after it)."""
        self.options = self.parser.parse_args()
        self.deadline = deadline(getattr(self.options, "budget", None))
        print(f"# {self.name} on {machine()}{note}{' (smoke run: not a measurement)' * self.smoke}", flush=True)
        return self.options

    def table(self, name: str, title: str) -> Table:
        table = Table(name, title, self.out, self.deadline)
        self.tables.append(table)
        return table

    def finish(self, note: str = "") -> None:
        """Each table not yet finished that has rows, whole: printed, and written to <out>/<table>.md."""
        for table in self.tables:
            if table.rows and not table.finished:
                table.finish(note)

    @property
    def alone(self) -> dict | None:
        """In a process that `measure_alone` started: what it is to measure."""
        spec = getattr(self.options, "alone", None)
        return None if spec is None else json.loads(spec)

    def measure_alone(self, spec: dict, timeout: float | None = None) -> dict:
        """What the script measures of `spec` (a dict that names, say, a model and a form), in a process of its own:
        the script again, with this run's options and `--alone <spec>`, which prints its figures as its result
        (`report`). There a form measures what it would alone on the machine: no other form's threads, memory,
        sessions or compiled code are in the process."""
        command = [str(self.file), *sys.argv[1:], "--alone", json.dumps(spec)]
        return python_result(in_own_process(command, timeout, peak=False))

    @staticmethod
    def report(values: dict) -> None:
        """In a process that `measure_alone` started: its figures, as the result it hands back."""
        print("result: " + json.dumps(values), flush=True)

    def compiled_forms(self) -> contextlib.AbstractContextManager:
        """Where compiled forms run: as they are; with --smoke, Dynamo's graphs under tests/cuda_graphs.py's stand-in
        (a CUDA graph's output lifetimes, no code generated), so that a CPU checks what a GPU will run."""
        if not self.smoke:
            return contextlib.nullcontext()
        sys.path.insert(0, str(REPO))
        from tests.cuda_graphs import cuda_graph_stand_in

        return cuda_graph_stand_in()


# --- timing ------------------------------------------------------------------------------------------------------


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (a timer's end on CUDA; nothing to wait for on a CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timings(fn: Callable[[], object], calls: int, warmup: int = 1, device: torch.device | str = "cpu") -> list[float]:
    """The seconds of each of `calls` calls of fn, after `warmup` untimed ones; the device's queue is drained before
    and after each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def timed(fn: Callable[[], object], calls: int, warmup: int = 1, device: torch.device | str = "cpu") -> float:
    """The median seconds of `calls` calls of fn, after `warmup` untimed ones (`timings`)."""
    return statistics.median(timings(fn, calls, warmup, device))


def take_turns(
    forms: dict[str, Callable[[], object]], calls: int, warmup: int = 1, device: torch.device | str = "cpu"
) -> dict[str, list[float] | BaseException]:
    """The seconds of each call of each form, the forms taking turns call by call (after `warmup` untimed calls
    each), so that the machine's drift falls on all of them alike. A form that fails (BENCHMARKS_FAIL may name it)
    is left out of the turns that follow, and its error is its entry."""
    seconds: dict[str, list[float] | BaseException] = {}
    for name, fn in forms.items():
        try:
            fail_if_asked(name)
            for _ in range(warmup):
                fn()
            seconds[name] = []
        except Exception as err:
            seconds[name] = err
    for _ in range(calls):
        for name, fn in forms.items():
            if isinstance(seconds[name], list):
                try:
                    seconds[name].append(timings(fn, 1, 0, device)[0])
                except Exception as err:
                    seconds[name] = err
    return seconds


def latency(seconds: list[float], prefix: str = "") -> dict[str, str]:
    """p50 and p95 (ms) of one-at-a-time calls, and the images a second they make."""
    ms = sorted(1000 * s for s in seconds)
    return {
        f"{prefix}p50, ms": f"{statistics.median(ms):.1f}",
        f"{prefix}p95, ms": f"{ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]:.1f}",
    }


# --- errors ------------------------------------------------------------------------------------------------------


def one_line(error: BaseException) -> str:
    """An error as one line: its type and the first line of its message, cut at 300 characters."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def fail_if_asked(*labels: object) -> None:
    """Raises where the environment's BENCHMARKS_FAIL (labels separated by "|") names one of `labels`: how a test
    makes a form fail, to see its table go on (tests/test_benchmarks.py)."""
    asked = [label for label in os.environ.get("BENCHMARKS_FAIL", "").split("|") if label]
    if any(str(label) == wanted for label in labels for wanted in asked):
        raise RuntimeError(f"made to fail (BENCHMARKS_FAIL names {', '.join(map(str, labels))})")


# --- a process of its own ----------------------------------------------------------------------------------------


class Child(NamedTuple):
    status: int | str  # the exit status, or "past its time limit: stopped"
    output: str  # stdout and stderr, as they came
    seconds: float  # from its start to its end, Python's start-up included
    peak_mib: float | None  # its peak resident memory (VmHWM), where it was measured


def in_own_process(
    target: list[str],
    timeout: float | None = None,
    env: dict[str, str] | None = None,
    cwd: Path = REPO,
    log: Path | None = None,
    echo: bool = False,
    peak: bool = True,
) -> Child:
    """`python *target` (a script and its arguments, `-m module ...` or `-c code ...`) in a process of its own, so that
    what one form leaves behind (memory, compiled graphs, threads, imports) is not measured with the next. Its output
    is kept, and as it comes written to `log` and, with `echo`, printed; past `timeout` seconds it is killed. With
    `peak`, it runs under child.py, which writes its peak resident memory as it exits."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "peak"
        env = dict(os.environ if env is None else env)
        command = [sys.executable, *target]
        if peak:
            env["BENCHMARK_PEAK_FILE"] = str(report)
            command = [sys.executable, str(CHILD), *target]
        lines: list[str] = []
        start = time.perf_counter()
        with contextlib.ExitStack() as stack:
            file = stack.enter_context(log.open("w")) if log is not None else None
            process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True)  # fmt: skip

            def copy() -> None:  # in a thread: the limit holds while the child prints nothing
                for line in process.stdout:
                    lines.append(line)
                    if file is not None:
                        file.write(line)
                        file.flush()
                    if echo:
                        print(line, end="", flush=True)

            copying = threading.Thread(target=copy, daemon=True)
            copying.start()
            try:
                status: int | str = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                status = "past its time limit: stopped"
            copying.join(timeout=5)
        seconds = time.perf_counter() - start
        peak_mib = float(report.read_text()) if report.exists() else None
    return Child(status, "".join(lines), seconds, peak_mib)


def python_result(child: Child) -> dict:
    """What a measuring child reported: the JSON of its last line of output that begins `result: ` (which it prints,
    a dict of figures); where it failed, a RuntimeError with its last line of output."""
    results = [line[len("result: ") :] for line in child.output.splitlines() if line.startswith("result: ")]
    if child.status != 0 or not results:
        last = (child.output.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"its process ended with {child.status}: {last}")
    return json.loads(results[-1])


def memory_mib(pid: int, field: str) -> float:
    """VmRSS (resident now) or VmHWM (the peak so far) of a running process, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return math.nan


# --- tables ------------------------------------------------------------------------------------------------------


def table(rows: list[dict]) -> str:
    """A Markdown table of the rows' keys (the first row's, then any others'); a key a row lacks is an empty cell."""
    keys = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(keys) + " |", "|" + "|".join("---" for _ in keys) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(row.get(k, "")) for k in keys) + " |" for row in rows])


class Table:
    """A table of measurements that cannot be lost: each row is printed, and appended to `<out>/<name>.jsonl`, as
    soon as it is measured; `finish` prints the whole table and writes `<out>/<name>.md`. A form that fails is a row
    that says so, with its error in one line, and the table goes on; once `deadline` (time.monotonic()) has passed,
    a form is not started and its row says so."""

    def __init__(self, name: str, title: str, out: Path | None = None, deadline: float | None = None):
        self.name, self.title, self.out, self.deadline = name, title, out, deadline
        self.rows: list[dict] = []
        self.finished = False
        print(f"\n{title}\n", flush=True)

    def add(self, row: dict) -> dict:
        self.rows.append(row)
        print(f"row: {json.dumps(row)}", flush=True)
        if self.out is not None:
            with (self.out / f"{self.name}.jsonl").open("a") as file:
                file.write(json.dumps(row) + "\n")
        return row

    def measure(self, row: dict, fn: Callable[[], dict]) -> dict:
        """The row `row` with what fn() measured (a dict of columns); or, if fn raises or the deadline has passed,
        with an "error" column."""
        if self.deadline is not None and time.monotonic() > self.deadline:
            return self.add({**row, "error": "not run: the part's time budget was spent"})
        try:
            fail_if_asked(*row.values())
            values = fn()
        except Exception as err:  # a failing form is a row; the table goes on
            print(f"{self.name}: {row} failed:", file=sys.stderr, flush=True)
            traceback.print_exc()
            values = {"error": one_line(err)}
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return self.add({**row, **values})

    def finish(self, note: str = "") -> str:
        self.finished = True
        text = f"{self.title}{note}\n\n{table(self.rows)}" if self.rows else f"{self.title}: no rows"
        print(f"\n{text}\n", flush=True)
        if self.out is not None:
            (self.out / f"{self.name}.md").write_text(text + "\n")
        return text


def deadline(budget: float | None) -> float | None:
    """The time.monotonic() by which a script given `budget` seconds starts no more forms."""
    return None if budget is None else time.monotonic() + budget


def out_folder(path: str | None) -> Path | None:
    if path is None:
        return None
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder
