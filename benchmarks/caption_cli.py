"""Wall time and peak memory of `captioner caption` on 32 and on 512 images, start-up included.

    python benchmarks/caption_cli.py

The images are drawn shapes images saved as JPEG in a temporary folder; the command runs with the bundled model,
beam 3, batch 16. Peak memory is the maximum resident set size of the command's process (from wait4).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine, result, table

from captioner.data.shapes import ShapesDataset


def run(folder: Path) -> tuple[float, float]:
    """(wall seconds, peak RSS in MiB) of one `captioner caption` run."""
    command = [sys.executable, "-m", "captioner.cli", "caption", str(folder), "--beam-size", "3", "--batch-size", "16"]
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"captioner caption failed with status {status}")
    return seconds, usage.ru_maxrss / 1024  # Linux reports KiB


def main() -> None:
    shapes = ShapesDataset("test", 512, seed=2)
    rows, figures = [], {}
    with tempfile.TemporaryDirectory() as root:
        for count in (32, 512):
            folder = Path(root) / str(count)
            folder.mkdir()
            for i in range(count):
                shapes.load_image(i).save(folder / f"{i:04d}.jpg", quality=90)
            seconds, peak = run(folder)
            figures[count] = (seconds, peak)
            rows.append(
                {
                    "images": count,
                    "wall s": f"{seconds:.1f}",
                    "images/s": f"{count / seconds:.1f}",
                    "peak RSS MiB": f"{peak:.0f}",
                }
            )
    print(f"bundled shapes model, beam 3, batch 16; {machine()}\n")
    print(table(rows))
    growth = figures[512][1] / figures[32][1] - 1
    print(
        result(
            wall_32_s=f"{figures[32][0]:.1f}",
            wall_512_s=f"{figures[512][0]:.1f}",
            peak_32_mib=f"{figures[32][1]:.0f}",
            peak_512_mib=f"{figures[512][1]:.0f}",
            peak_growth=f"{growth:.1%}",
        )
    )


if __name__ == "__main__":
    main()
