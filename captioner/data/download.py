"""Resumable downloads with checksum, progress bar and extraction, for COCO and the Karpathy splits.

A download goes to `<file>.part`; an interrupted one resumes from there with an HTTP Range request. The finished
file is checked against its SHA-256 (when one is known) before it replaces the final name, so a file without
`.part` is always complete. An archive is extracted into a temporary folder and then renamed into place, so that what
the next run takes as "extracted" is complete: a kill in the middle of the 13 GB unzip leaves only the temporary
folder, which the next run deletes before it extracts again. One process at a time prepares a dataset folder (a lock
file), so the ranks of a DDP run, which all build the vocabulary when they start, do not download twice.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import shutil
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

from tqdm import tqdm

from captioner.errors import CaptionerError
from captioner.files import build_lock

log = logging.getLogger(__name__)

# The official locations; any of them can be overridden (a mirror) through CocoDataModule's `urls`.
COCO_URLS = {
    "train2014": "http://images.cocodataset.org/zips/train2014.zip",
    "val2014": "http://images.cocodataset.org/zips/val2014.zip",
    "train2017": "http://images.cocodataset.org/zips/train2017.zip",
    "val2017": "http://images.cocodataset.org/zips/val2017.zip",
    "annotations2014": "http://images.cocodataset.org/annotations/annotations_trainval2014.zip",
    "annotations2017": "http://images.cocodataset.org/annotations/annotations_trainval2017.zip",
    "karpathy": "https://cs.stanford.edu/people/karpathy/deepimagesent/caption_datasets.zip",
}
CHUNK = 1 << 20


class DownloadError(CaptionerError):
    """A download failed or its checksum did not match."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def download(url: str, destination: str | Path, sha256: str | None = None, timeout: float = 30.0) -> Path:
    """Download `url` to `destination`, resuming a previous partial download; verify `sha256` if given."""
    destination = Path(destination)
    if destination.exists():
        return destination
    destination.parent.mkdir(parents=True, exist_ok=True)
    part = destination.with_name(destination.name + ".part")
    start = part.stat().st_size if part.exists() else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={start}-"} if start else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            resumed = start > 0 and response.status == 206
            if not resumed:
                start = 0  # the server ignored the Range header: start over
            length = response.headers.get("Content-Length")
            total = start + int(length) if length is not None else None
            with (
                part.open("ab" if resumed else "wb") as out,
                tqdm(total=total, initial=start, unit="B", unit_scale=True, desc=destination.name) as bar,
            ):
                for block in iter(lambda: response.read(CHUNK), b""):
                    out.write(block)
                    bar.update(len(block))
            if total is not None and part.stat().st_size < total:  # the server closed the connection early
                raise http.client.IncompleteRead(b"", total - part.stat().st_size)
    except urllib.error.HTTPError as err:
        if err.code == 416 and start:  # the range starts at the end: the .part file is already complete
            pass
        else:
            raise DownloadError(f"{url}: HTTP {err.code} {err.reason}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
        reason = getattr(err, "reason", None) or type(err).__name__
        raise DownloadError(f"{url}: download interrupted ({reason}); run again to resume from {part}") from None
    if sha256 is not None:
        actual = sha256_of(part)
        if actual != sha256:
            part.unlink()
            raise DownloadError(f"{url}: checksum mismatch (expected {sha256}, got {actual}); the file was deleted")
    part.replace(destination)
    return destination


def extract(archive: str | Path, folder: str | Path, marker: str | Path) -> None:
    """Unzip `archive` into `folder`, refusing members that would land outside it.

    The members are extracted into a temporary folder first, then moved into `folder`: a top-level folder that is not
    there yet (train2014/) by one rename, into one that is (annotations/) file by file, `marker` last of all. So
    `marker`, the file or folder whose presence means "extracted", appears only when everything else is in place.
    """
    folder, marker = Path(folder).resolve(), Path(marker).resolve()
    staging = folder / f".{Path(archive).name}.extracting"
    shutil.rmtree(staging, ignore_errors=True)  # what a killed extraction left
    with zipfile.ZipFile(archive) as zf:
        for member in zf.namelist():
            if not (folder / member).resolve().is_relative_to(folder):
                raise DownloadError(f"{archive}: member {member!r} would be extracted outside {folder}")
        zf.extractall(staging)
    _move_into(staging, folder, staging / marker.relative_to(folder))
    shutil.rmtree(staging, ignore_errors=True)


def _move_into(source: Path, target: Path, last: Path) -> None:
    """Move `source` to `target` by renames: whole if `target` is missing, else entry by entry, `last` (a path under
    `source`) and the folders that hold it after every other entry."""
    if not target.exists() or source.is_file():
        os.replace(source, target)
        return
    for entry in sorted(source.iterdir(), key=lambda entry: entry == last or entry in last.parents):
        _move_into(entry, target / entry.name, last)


def fetch_and_extract(name: str, urls: dict[str, str], folder: Path, marker: Path, sha256: str | None = None) -> None:
    """Download the zip called `name` into folder/downloads and extract it into folder, unless `marker` exists."""
    if marker.exists():
        return
    url = {**COCO_URLS, **urls}[name]
    archive = download(url, folder / "downloads" / Path(url).name, sha256)
    log.info("extracting %s", archive)
    extract(archive, folder, marker)
    if not marker.exists():
        raise DownloadError(f"{archive}: extracted, but {marker} is still missing")


def prepare_coco(
    folder: Path, format: str, year: int, split_file: str, urls: dict[str, str], checksums: dict[str, str]
) -> None:
    """Download and extract what the chosen COCO layout needs and is missing (checksums: name -> SHA-256)."""
    if format == "custom":
        return
    with build_lock(folder):
        for part in ("train", "val"):
            fetch_and_extract(f"{part}{year}", urls, folder, folder / f"{part}{year}", checksums.get(f"{part}{year}"))
        if format == "coco":
            marker = folder / "annotations" / f"captions_train{year}.json"
            fetch_and_extract(f"annotations{year}", urls, folder, marker, checksums.get(f"annotations{year}"))
        else:
            fetch_and_extract("karpathy", urls, folder, folder / split_file, checksums.get("karpathy"))
        shutil.rmtree(folder / "downloads", ignore_errors=True)
