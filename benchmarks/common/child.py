"""Runs a Python program as `python` would (`child.py script.py ARGS`, `child.py -m module ARGS` or `child.py -c CODE
ARGS`) and, as it exits, writes its peak resident memory (VmHWM, MiB) to the file that the environment's
BENCHMARK_PEAK_FILE names: `harness.in_own_process`'s child. VmHWM is the process's own high-water mark; the
ru_maxrss that `resource` gives keeps, across the exec that starts a child, the parent's peak, which is not the
child's."""

import atexit
import os
import runpy
import sys
from pathlib import Path


def peak_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")  # not Linux


report = os.environ.pop("BENCHMARK_PEAK_FILE", None)
if report:
    atexit.register(lambda: Path(report).write_text(f"{peak_mib()}\n"))
target, *args = sys.argv[1:]
sys.path[0] = "" if target in ("-m", "-c") else str(Path(target).resolve().parent)  # as `python` sets it, not ours
if target == "-m":
    sys.argv = [args[0], *args[1:]]
    runpy.run_module(args[0], run_name="__main__", alter_sys=True)
elif target == "-c":
    sys.argv = ["-c", *args[1:]]
    exec(compile(args[0], "<string>", "exec"), {"__name__": "__main__"})
else:
    sys.argv = [target, *args]
    runpy.run_path(target, run_name="__main__")
