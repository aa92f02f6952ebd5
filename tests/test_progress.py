"""Progress bars with an ETA when stderr is a terminal (a pseudo-terminal here), and none when it is not, or with
--json: `captioner caption` on a folder, `captioner evaluate`, and the feature-cache build."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

from tests.images import write_good_images

BAR = re.compile(r"\d+%\|.*\| *\d+/\d+ \[\d\d:\d\d<\d\d:\d\d")  # "50%|█████     | 1/2 [00:01<00:01, ..."


def run(*args: str, terminal: bool) -> tuple[str, str]:
    """Run `captioner ...`; stdout is always a pipe, stderr a pseudo-terminal or a pipe. Returns (stdout, stderr)."""
    command = [sys.executable, "-m", "captioner.cli", *args]
    if not terminal:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr
        return result.stdout, result.stderr
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a 120-column terminal
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=follower)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # EIO: every writer has closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    stdout = process.stdout.read().decode()
    assert process.wait(timeout=600) == 0, b"".join(chunks).decode(errors="replace")
    return stdout, b"".join(chunks).decode(errors="replace")


def test_caption_on_a_folder(tiny_model, tmp_path):
    images = write_good_images(tmp_path / "photos")
    stdout, terminal = run("caption", str(tmp_path / "photos"), "--checkpoint", tiny_model, terminal=True)
    assert BAR.search(terminal) and f"{len(images)}/{len(images)}" in terminal
    assert sorted(line.split("\t")[0] for line in stdout.splitlines()) == sorted(map(str, images))  # clean stdout
    # --json on a terminal: no bar (and none without a terminal: test_caption_cli's folder test checks its stderr)
    _, stderr = run("caption", str(tmp_path / "photos"), "--checkpoint", tiny_model, "--json", terminal=True)
    assert not BAR.search(stderr) and "%|" not in stderr


def test_evaluate_and_the_feature_cache(tiny_model, tmp_path):
    """On a terminal. Not on one: test_cli's evaluate test and test_features' concurrent fits find no bar."""
    checkpoint = str(Path(tiny_model).parent / "checkpoints" / "best.ckpt")
    data = tmp_path / "data"  # a new data folder: the feature cache is built first
    args = ["evaluate", "--checkpoint", checkpoint, "--split", "val", "--output", str(tmp_path / "evaluation")]
    _, stderr = run(*args, "--beam-size", "1", f"--data.init_args.data_dir={data}", terminal=True)
    assert list((data / "features").glob("*-val-*/annotations.npy"))
    bars = [line for line in re.split(r"[\r\n]", stderr) if BAR.search(line)]
    assert any(line.startswith("caching shapes-") for line in bars), stderr
    assert any(line.startswith("evaluate val") for line in bars), stderr
