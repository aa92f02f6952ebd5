"""Files that several processes share: written whole or not at all, and built by one process at a time.

A DDP run's ranks, or two runs on one data folder, may want the same file (a feature cache, a vocabulary, an
extracted dataset, a checkpoint). Each is written under a temporary name and renamed into place, so that a kill at
any moment leaves the old file or the new one, never a torn one; and whoever builds it holds a lock file beside it,
so that the others wait and then read what it built.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from filelock import FileLock


def replace_atomically(path: str | Path, write: Callable[[BinaryIO], object]) -> None:
    """Call `write(file)` on a temporary file beside `path`, flush it to disk, then rename it to `path`."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.part")
    try:
        with open(partial, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def write_text_atomically(path: str | Path, text: str) -> None:
    replace_atomically(path, lambda file: file.write(text.encode()))


def build_lock(path: str | Path) -> FileLock:
    """An exclusive lock on `path` for building it (a lock file `.<name>.lock` beside it), held with `with`.
    Processes on one machine, or on one shared file system that supports locks, take turns."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(path.with_name(f".{path.name}.lock"))


def writable(folder: Path) -> bool:
    """Whether files can be made in `folder`, or, where it is missing, in the nearest folder above it that exists
    (where it would be made): tried, not judged from permission bits, which root ignores and a read-only mount
    overrides. Nothing is left behind, and no folder is made: a mistyped path stays missing."""
    existing = next((p for p in (folder, *folder.parents) if p.exists()), Path("."))
    try:
        with tempfile.TemporaryFile(dir=existing):
            return True
    except OSError:
        return False
