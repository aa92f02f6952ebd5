"""Wall time and peak memory of `captioner caption` on 32 and on 512 images, start-up included.

    python benchmarks/caption_cli.py

The images are drawn shapes images saved as JPEG in a temporary folder; the command runs with the bundled model,
beam 3, batch 16. Peak memory is the maximum resident set size of the command's process (from wait4). The 512
images are captioned a second time with `--precision bf16-mixed` (see benchmarks/precision.py), on a CPU without native
bfloat16 only with BENCH_BF16=1 (common.bf16_timed_on_cpu).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import bf16_skipped, bf16_timed_on_cpu, machine, result, table

from captioner.data.shapes import ShapesDataset


def run(folder: Path, precision: str = "32-true") -> tuple[float, float]:
    """(wall seconds, peak RSS in MiB) of one `captioner caption` run."""
    command = [sys.executable, "-m", "captioner.cli", "caption", str(folder), "--beam-size", "3", "--batch-size", "16"]
    command += ["--precision", precision]
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"captioner caption failed with status {status}")
    return seconds, usage.ru_maxrss / 1024  # Linux reports KiB


def main() -> None:
    shapes = ShapesDataset("test", 512, seed=2)
    bf16_timed = bf16_timed_on_cpu()
    runs = [(32, "32-true"), (512, "32-true")]
    if bf16_timed:
        runs.append((512, "bf16-mixed"))
    rows, figures = [], {}
    with tempfile.TemporaryDirectory() as root:
        for count, precision in runs:
            folder = Path(root) / str(count)
            if not folder.exists():
                folder.mkdir()
                for i in range(count):
                    shapes.load_image(i).save(folder / f"{i:04d}.jpg", quality=90)
            seconds, peak = run(folder, precision)
            figures[count, precision] = (seconds, peak)
            rows.append(
                {
                    "images": count,
                    "precision": precision,
                    "wall s": f"{seconds:.1f}",
                    "images/s": f"{count / seconds:.1f}",
                    "peak RSS MiB": f"{peak:.0f}",
                }
            )
    print(f"bundled shapes model, beam 3, batch 16; {machine()}\n")
    print(table(rows))
    small, large = figures[32, "32-true"], figures[512, "32-true"]
    values = {
        "wall_32_s": f"{small[0]:.1f}",
        "wall_512_s": f"{large[0]:.1f}",
        "peak_32_mib": f"{small[1]:.0f}",
        "peak_512_mib": f"{large[1]:.0f}",
        "peak_growth": f"{large[1] / small[1] - 1:.1%}",
    }
    if bf16_timed:
        bf16 = figures[512, "bf16-mixed"]
        values.update(wall_512_bf16_s=f"{bf16[0]:.1f}", bf16_speedup_512=f"{large[0] / bf16[0]:.2f}")
    else:
        print(f"\n{bf16_skipped()}")
    print(result(**values))


if __name__ == "__main__":
    main()
