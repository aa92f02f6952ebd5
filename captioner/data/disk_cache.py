"""What the two disk caches share: a folder per key beside the data, built by one process at a time and published
whole. The caches are the frozen encoder's annotations (`features.FeatureCache`) and the images resized to the
encoder's input (`image_cache.ImageCache`); a subclass says how to check and write its files, and this class does
the rest, once for both:

- the lock: whoever builds holds the folder's lock file; another process that needs the cache waits, then finds it
  built (`ensure`);
- the damage check: `problem` says why a cache on disk cannot be used; a damaged one is named in a warning and built
  again;
- the atomic publish: a build first removes the file whose presence says the cache is complete (`marker`), writes
  everything under temporary names, renames the data into place, writes meta.json, and renames the marker last. A
  kill at any moment leaves no marker (the cache is built again) or a whole cache, never a marker beside half-written
  data;
- the unreadable list: the images that could not be read when it was built, in meta.json ("bad");
- the space check: before anything is written, the bytes it needs against the disk's free space (an OSError);
- under DDP (`shared`): local rank 0 builds, the other ranks wait and only open what it built, and every rank's
  outcome is reduced: all use the cache, or all fall back together.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Protocol

from filelock import Timeout
from PIL import Image

from captioner.errors import CaptionerError
from captioner.files import build_lock, write_text_atomically

log = logging.getLogger(__name__)


class ImageSource(Protocol):
    """What the cache (and the datamodules) need of a dataset split."""

    identity: str

    def __len__(self) -> int: ...

    def load_image(self, index: int) -> Image.Image: ...


def size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


class DiskCache:
    """A cache of one dataset split in its own folder. Subclasses set `kind` (its name in messages) and `marker` (the
    file written last), and give `damage`, `needed`, `describe` and `write`."""

    kind = "cache"
    estimated = False  # whether `needed` is an estimate (said "about")

    def __init__(self, folder: Path, marker: str):
        self.dir = folder
        self.marker = folder / marker
        self.meta = folder / "meta.json"
        self.bad: set[int] = set()  # the images that could not be read when it was built
        self._temporary: list[Path] = []  # a build's files under temporary names

    # --- what a subclass gives ---------------------------------------------------------------------------------

    def damage(self) -> str | None:
        """Why the cache on disk, whose marker and meta.json are there and readable, cannot be used; or None."""
        raise NotImplementedError

    def needed(self) -> int:
        """The bytes a build will write (an estimate where it cannot be known before)."""
        raise NotImplementedError

    def describe(self) -> str:
        """What a build holds, for the line said before it (the images, their size)."""
        raise NotImplementedError

    def write(self, **options) -> tuple[dict, list[int], list[tuple[Path, Path]]]:
        """Write the cache's files under `temporary` names: returns meta.json's content (without "bad"), the images
        that could not be read, and the files to put in place, (temporary, final) pairs, the marker last."""
        raise NotImplementedError

    # --- the shared part ---------------------------------------------------------------------------------------

    def problem(self) -> str | None:
        """Why the cache on disk cannot be used, or None when it can: missing (no marker), or damaged (a truncated,
        replaced or foreign file, as a full disk or a broken copy leaves them)."""
        if not self.marker.exists():
            return "missing"
        try:
            self.read_bad()
        except (OSError, ValueError) as err:  # json's JSONDecodeError is a ValueError
            return f"damaged ({self.meta.name}: {err})"
        return self.damage()

    def read_bad(self) -> set[int]:
        """The unreadable images meta.json records: none where it has no "bad" (a cache written before it recorded
        them, which is as usable as one written now). Raises ValueError when it is not an object, or its "bad" not a
        list of image indices."""
        meta = json.loads(self.meta.read_text())
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
        bad = meta.get("bad", [])
        if not isinstance(bad, list) or not all(isinstance(index, int) for index in bad):
            raise ValueError('its "bad" is not a list of image indices')
        return set(bad)

    def open(self) -> bool:
        """Use the cache on disk if it is whole (its unreadable list read); False if it is missing or damaged."""
        if self.problem() is not None:
            return False
        self.bad = self.read_bad()
        return True

    def ensure(self, **options) -> None:
        """Build the cache unless a usable one is there (a damaged one is named in a warning and built again), holding
        its lock file: of two processes that need it, one builds and the other then opens it. A whole cache is
        opened first, without the lock: one in a folder that cannot be written (a shared, read-only dataset) is used.
        Raises OSError when it cannot be written (its folder, or too little disk: said before anything is
        written)."""
        if self.open():
            return
        self.dir.mkdir(parents=True, exist_ok=True)  # first, so that a warning names the folder that cannot be made
        with build_lock(self.dir):
            self.build_unless_usable(**options)

    def build_unless_usable(self, **options) -> None:
        """`ensure`'s work, under the lock its caller holds."""
        problem = self.problem()
        if problem is None:
            self.bad = self.read_bad()
            return
        if problem != "missing":
            log.warning("%s: %s %s; building it again", self.dir, self.kind, problem)
        self.build(**options)

    def build(self, **options) -> None:
        """Write the cache (`write`) and publish it (the module's docstring), its marker removed first; a build that
        fails removes its temporary files."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.marker.unlink(missing_ok=True)  # first: no complete-looking cache while its files are replaced
        needed = self.needed()
        about = "about " if self.estimated else ""
        need = f"{about}{size(needed)}"
        log.info("%s of %s; %s, %s free on its disk (%s)", self.kind, self.describe(), need, self.free(), self.dir)
        self.check_space(needed)
        self._temporary = []
        try:
            meta, bad, files = self.write(**options)
            for temporary, final in files[:-1]:
                os.replace(temporary, final)
            write_text_atomically(self.meta, json.dumps(meta | {"bad": bad}, indent=1))
            os.replace(*files[-1])  # the marker, last
        finally:
            for path in self._temporary:
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
        self.bad = set(bad)

    def temporary(self, name: str) -> Path:
        """A new temporary file's path in the folder (removed after the build, if still there)."""
        path = self.dir / f"{name}.{os.getpid()}.tmp"
        self._temporary.append(path)
        return path

    def free(self) -> str:
        return size(shutil.disk_usage(self.dir).free)

    def check_space(self, needed: int) -> None:
        """Raises OSError (ENOSPC) when the disk has fewer than `needed` bytes free."""
        free = shutil.disk_usage(self.dir).free
        if needed > free:
            about = "about " if self.estimated else ""
            message = f"no space left: it needs {about}{size(needed)}, {size(free)} are free"
            raise OSError(errno.ENOSPC, message, str(self.dir))


def shared(cache: DiskCache, trainer, fallback: str, **options) -> bool:
    """Whether every process can use `cache`, built first where missing or damaged. False, with one warning, when it
    cannot be written (a full disk, a folder that cannot be made): `fallback` says what is used instead.

    Without a Trainer, or in one process, this process builds it. Under DDP, local rank 0 builds it while the other
    ranks wait, and they then only open what it built (never build it themselves):

    - they wait on the cache's lock file, which the builder takes before a barrier that every rank passes, not in a
      collective: a build of COCO's cache takes longer than any process group's timeout;
    - any error of the build (a wrong encoder, memory, CUDA) reaches every rank at once: each reduces whether one
      failed, and all raise (the builder its error; the others one line that points to it);
    - every rank's outcome is reduced: all use the cache, or all fall back together, so that no two ranks train on
      different inputs.

    Two processes that need one cache and share no Trainer (two runs on one data_dir, or the local ranks 0 of two
    nodes on a shared file system) take turns through the lock file: one that finds it taken waits as the other
    ranks do."""
    distributed = trainer is not None and trainer.world_size > 1
    if not distributed:
        try:
            cache.ensure(**options)
        except OSError as err:
            _cannot_write(cache, err, fallback)
            return False
        return True
    strategy = trainer.strategy
    lock, usable, error = None, True, None
    if trainer.local_rank == 0 and not cache.open():  # a whole cache needs no lock (a read-only folder)
        try:
            cache.dir.mkdir(parents=True, exist_ok=True)
            lock = build_lock(cache.dir)
            lock.acquire(blocking=False)  # taken: another run, or another node's rank 0, builds it; wait as the rest
        except Timeout:
            lock = None
        except OSError as err:
            lock, usable = None, False
            _cannot_write(cache, err, fallback)
    strategy.barrier(cache.kind)  # the builder, if any, holds the lock from here until its build is over
    if lock is not None:
        try:
            cache.build_unless_usable(**options)
        except OSError as err:
            _cannot_write(cache, err, fallback)
            usable = False
        except Exception as err:  # reduced below first, so that no rank waits for this one in a collective
            error = err
        finally:
            lock.release()
    elif usable:
        usable = _wait_and_open(cache)
    if strategy.reduce_boolean_decision(error is not None, all=False):  # did any rank fail?
        if error is not None:
            raise error
        raise CaptionerError(f"{cache.dir}: another process failed to build the {cache.kind} (its error is above)")
    everywhere = strategy.reduce_boolean_decision(usable, all=True)
    if usable and not everywhere:
        log.warning("%s: another process cannot use the %s; %s, in every process", cache.dir, cache.kind, fallback)
    return everywhere


def _wait_and_open(cache: DiskCache) -> bool:
    """A rank that does not build: the cache as the builder left it, waiting on its lock file while it is taken."""
    if cache.open():
        return True
    try:
        with build_lock(cache.dir):  # no timeout: returns when the builder releases it
            return cache.open()
    except OSError:  # the folder or its lock file cannot be made: there is no cache to wait for
        return False


def _cannot_write(cache: DiskCache, err: OSError, fallback: str) -> None:
    where, why = err.filename or cache.dir, err.strerror or err
    log.warning("%s: cannot write the %s (%s); %s", where, cache.kind, why, fallback)
