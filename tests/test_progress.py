"""Progress bars with an ETA when stderr is a terminal (a pseudo-terminal here), and none when it is not, or with
--json: `captioner caption` on a folder, `captioner evaluate`, and the feature-cache build. The commands run in the
test's process with sys.stderr on the terminal, which is what the bars look at (tqdm asks its stream `isatty()`)."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import sys
import termios
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.conftest import run_main
from tests.images import write_good_images

BAR = re.compile(r"\d+%\|.*\| *\d+/\d+ \[\d\d:\d\d<\d\d:\d\d")  # "50%|█████     | 1/2 [00:01<00:01, ..."


class Terminal:
    """What a pseudo-terminal showed: `text`, once the block that wrote to it has ended."""

    text = ""


@contextmanager
def stderr_on_a_terminal() -> Iterator[Terminal]:
    """sys.stderr on a 120-column pseudo-terminal while the block runs."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    chunks: list[bytes] = []

    def read() -> None:  # drained as it is written: a full terminal buffer would block the writer
        while True:
            try:
                chunk = os.read(leader, 1 << 16)
            except OSError:  # EIO: the terminal's other end has closed
                break
            if not chunk:
                break
            chunks.append(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    terminal = Terminal()
    with open(follower, "w", encoding="utf-8", buffering=1) as stream, pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "stderr", stream)
        yield terminal
    reader.join(timeout=60)
    os.close(leader)
    terminal.text = b"".join(chunks).decode(errors="replace")


def test_caption_on_a_folder(tiny_model, tmp_path, capfd):
    images = write_good_images(tmp_path / "photos")
    with stderr_on_a_terminal() as terminal:
        ran = run_main(capfd, "caption", str(tmp_path / "photos"), "--checkpoint", tiny_model)
    assert ran.status == 0, terminal.text
    assert BAR.search(terminal.text) and f"{len(images)}/{len(images)}" in terminal.text
    assert sorted(line.split("\t")[0] for line in ran.out.splitlines()) == sorted(map(str, images))  # clean stdout
    # --json on a terminal: no bar (and none without a terminal: test_caption_cli's folder test checks its stderr)
    with stderr_on_a_terminal() as terminal:
        ran = run_main(capfd, "caption", str(tmp_path / "photos"), "--checkpoint", tiny_model, "--json")
    assert ran.status == 0 and not BAR.search(terminal.text) and "%|" not in terminal.text


def test_evaluate_and_the_feature_cache(tiny_checkpoint, tmp_path, capfd):
    """On a terminal. Not on one: test_cli's evaluate test and test_features' concurrent fits find no bar."""
    data = tmp_path / "data"  # a new data folder: the feature cache is built first
    args = ["evaluate", "--checkpoint", tiny_checkpoint, "--split", "val", "--output", str(tmp_path / "evaluation")]
    with stderr_on_a_terminal() as terminal:
        ran = run_main(capfd, *args, "--beam-size", "1", f"--data.init_args.data_dir={data}")
    assert ran.status == 0, terminal.text
    assert list((data / "features").glob("*-val-*/annotations.npy"))
    bars = [line for line in re.split(r"[\r\n]", terminal.text) if BAR.search(line)]
    assert any(line.startswith("caching shapes-") for line in bars), terminal.text
    assert any(line.startswith("evaluate val") for line in bars), terminal.text
