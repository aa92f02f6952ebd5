"""The `captioner caption` command as a user runs it, on a folder of 128 shapes test images (PNG files) and on one
image: seconds from start to exit, images/s, and the peak memory of the process, with the bundled model and beam 3.

    python benchmarks/caption_cli.py

Each command runs three times; the table gives the fastest run and its peak resident memory.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import Table, machine, out_folder

from captioner.data.shapes import ShapesDataset

IMAGES = 128


# `captioner caption ...`, which reports its own peak resident memory (KiB) on its last line of stderr as it exits
COMMAND = """
import atexit, resource, sys
atexit.register(lambda: print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr))
from captioner.cli import main
main(sys.argv[1:])
"""


def run(*args: str) -> tuple[float, float]:
    """Seconds and peak resident MiB of one `captioner caption` process."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", COMMAND, "caption", *args], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed")
    return seconds, int(result.stderr.split()[-1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="a folder for the table's rows (caption_cli.jsonl as measured, caption_cli.md)")
    options = parser.parse_args()
    print(f"# caption_cli.py on {machine()}")
    rows = Table("caption_cli", "`captioner caption`, the fastest of 3 runs each", out_folder(options.out))
    with tempfile.TemporaryDirectory() as folder:
        test = ShapesDataset("test", IMAGES, seed=0)
        for i in range(IMAGES):
            test.load_image(i).save(Path(folder) / f"{i:03d}.png")
        one = str(Path(folder) / "000.png")
        commands = {"one image": ((one,), 1), f"{IMAGES} images": ((folder, "--batch-size", "32"), IMAGES)}
        for name, (args, count) in commands.items():

            def measure(args=args, count=count) -> dict:
                seconds, peak = min(run(*args) for _ in range(3))
                return {
                    "seconds": f"{seconds:.1f}",
                    "images/s": f"{count / seconds:.1f}",
                    "peak memory (MiB)": f"{peak:.0f}",
                }

            rows.measure({"command": f"captioner caption ({name})"}, measure)
    rows.finish()


if __name__ == "__main__":
    main()
