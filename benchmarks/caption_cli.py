"""The `captioner caption` command as a user runs it, on a folder of 128 shapes test images (PNG files) and on one
image: seconds from start to exit, images/s, and the peak memory of the process, with the bundled model and beam 3.

    python benchmarks/caption_cli.py

Each command runs three times; the table gives the fastest run and its peak resident memory.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from common.harness import Script, in_own_process

from captioner.data.shapes import ShapesDataset

IMAGES = 128


def run(*args: str) -> tuple[float, float]:
    """Seconds and peak resident MiB of one `captioner caption` process."""
    child = in_own_process(["-m", "captioner.cli", "caption", *args])
    if child.status != 0:
        raise RuntimeError((child.output.strip().splitlines() or ["failed"])[-1])
    return child.seconds, child.peak_mib


def main() -> None:
    script = Script(__file__, __doc__)
    script.start()
    rows = script.table("caption_cli", "`captioner caption`, the fastest of 3 runs each")
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
    script.finish()


if __name__ == "__main__":
    main()
