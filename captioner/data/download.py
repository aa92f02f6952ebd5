"""Resumable downloads with checksum, progress bar and extraction, and what `download: true` fetches for a real
dataset (`prepare`), small files first: the split or annotation files (a few MB, from the first of their sources that
answers with the split's known counts, `captioner.data.sources`), then the image archives (19 GB for COCO) that are
not on disk already.

A download goes to `<file>.part`; an interrupted one resumes from there with an HTTP Range request. The finished
file is checked against its digest (when one is known) before it replaces the final name, so a file without
`.part` is always complete. An archive is extracted into a temporary folder and then renamed into place, so that what
the next run takes as "extracted" is complete: a kill in the middle of the 13 GB unzip leaves only the temporary
folder, which the next run deletes before it extracts again. One process at a time prepares a dataset folder (a lock
file), so the ranks of a DDP run, which all build the vocabulary when they start, do not download twice.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import shutil
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

from tqdm import tqdm

from captioner.data.sources import PLANS, SOURCES, Plan, Route, counts
from captioner.errors import CaptionerError
from captioner.files import build_lock, write_text_atomically

log = logging.getLogger(__name__)

CHUNK = 1 << 20


class DownloadError(CaptionerError):
    """A download failed or its checksum did not match."""


def digest_of(path: Path, algorithm: str = "sha256") -> str:
    digest = hashlib.new(algorithm)
    with path.open("rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def download(url: str, destination: str | Path, digest: str | None = None, timeout: float = 30.0) -> Path:
    """Download `url` to `destination`, resuming a previous partial download; verify `digest` if given ("md5:<hex>",
    "sha256:<hex>", or a bare SHA-256)."""
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
    if digest is not None:
        algorithm, _, expected = digest.rpartition(":")
        actual = digest_of(part, algorithm or "sha256")
        if actual != expected.lower():
            part.unlink()
            raise DownloadError(f"{url}: checksum mismatch (expected {digest}, got {actual}); the file was deleted")
    part.replace(destination)
    return destination


def extract(archive: str | Path, folder: str | Path, marker: str | Path, top: str = "") -> None:
    """Unzip `archive` into `folder`, refusing members that would land outside it; with `top`, the contents of the
    archive's folder `top` become `folder` itself (Flickr8k's `Flicker8k_Dataset/` as the configured image root).

    The members are extracted into a temporary folder first, then moved into `folder`: a top-level folder that is not
    there yet (train2014/) by one rename, into one that is (annotations/) file by file, `marker` last of all. So
    `marker`, the file or folder whose presence means "extracted", appears only when everything else is in place.
    """
    folder, marker = Path(folder).resolve(), Path(marker).resolve()
    beside = folder.parent if top else folder
    beside.mkdir(parents=True, exist_ok=True)
    staging = beside / f".{Path(archive).name}.extracting"
    shutil.rmtree(staging, ignore_errors=True)  # what a killed extraction left
    with zipfile.ZipFile(archive) as zf:
        for member in zf.namelist():
            if not (staging / member).resolve().is_relative_to(staging):
                raise DownloadError(f"{archive}: member {member!r} would be extracted outside {folder}")
        zf.extractall(staging)
    if top:
        if not (staging / top).is_dir():
            raise DownloadError(f"{archive}: no folder {top}/ in it")
        _move_into(staging / top, folder, staging / top / marker.relative_to(folder))
    else:
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


def _source(name: str, urls: dict[str, str], checksums: dict[str, str]) -> tuple[str, str | None]:
    """A source's address (`urls` overrides it: a mirror) and the digest to check (`checksums`' SHA-256 first)."""
    source = SOURCES[name]
    url = urls.get(name, source.url)
    return url, checksums.get(name) or (source.digest if url == source.url else None)


def fetch_and_extract(
    name: str,
    urls: dict[str, str],
    folder: Path,
    marker: Path,
    checksums: dict[str, str] | None = None,
    top: str = "",
    downloads: Path | None = None,
) -> None:
    """Download the zip of source `name` into `downloads` (default: folder/downloads) and extract it into folder
    (`extract`, `top` included), unless `marker` exists."""
    if marker.exists():
        return
    url, digest = _source(name, urls, checksums or {})
    archive = download(url, (downloads or folder / "downloads") / Path(url).name, digest)
    log.info("extracting %s", archive)
    extract(archive, folder, marker, top)
    if not marker.exists():
        raise DownloadError(f"{archive}: extracted, but {marker} is still missing")


def prepare(
    folder: Path,
    format: str,
    year: int,
    split_file: str,
    image_root: str,
    urls: dict[str, str],
    checksums: dict[str, str],
) -> None:
    """Download and extract what the chosen layout needs and is missing, small files first: the split file (or COCO's
    annotations), then each image archive whose folder is not where the data module looks for it (`image_root`,
    absolute or under `folder`). checksums: source name -> SHA-256; urls: source name -> a mirror's address."""
    if format == "custom":
        return
    steps = _steps(folder, format, year, split_file, image_root)
    if all(marker.exists() for marker, _ in steps):  # nothing to do: a read-only folder is not written to
        return
    with build_lock(folder):
        downloads = folder / "downloads"
        for marker, fetch in steps:
            if not marker.exists():
                fetch(urls, checksums, downloads)
        shutil.rmtree(downloads, ignore_errors=True)


def _archive(name: str, folder: Path, marker: Path, top: str = ""):
    """The step that fetches and extracts the archive of source `name` (`fetch_and_extract`)."""
    return lambda urls, checksums, downloads: fetch_and_extract(name, urls, folder, marker, checksums, top, downloads)


def _steps(folder: Path, format: str, year: int, split_file: str, image_root: str) -> list:
    """What `prepare` makes, in order, small files first: (the path whose presence says it is there, the step that
    makes it from urls, checksums and the downloads folder)."""
    if format == "coco":
        annotations = folder / "annotations" / f"captions_train{year}.json"
        parts = [folder / f"train{year}", folder / f"val{year}"]
        return [(annotations, _archive(f"annotations{year}", folder, annotations))] + [
            (part, _archive(part.name, folder, part)) for part in parts
        ]
    plan, target = PLANS.get(Path(split_file).name), folder / split_file

    def split(urls: dict, checksums: dict, downloads: Path) -> None:
        if plan is None:
            raise DownloadError(f"{target}: missing, and no source of it is known; see data/README.md")
        make_split_file(target, plan, urls, checksums, downloads)

    steps = [(target, split)]
    root = folder / image_root  # where the images are looked for; an absolute image_root anywhere
    for images in plan.images if plan is not None else ():
        marker = root if images.is_root else root / images.folder
        steps.append((marker, _archive(images.source, root, marker, images.folder if images.is_root else "")))
    return steps


def make_split_file(target: Path, plan: Plan, urls: dict, checksums: dict, downloads: Path) -> None:
    """The Karpathy split file at `target`, from the first of `plan`'s routes whose sources answer and give the
    split's counts; each source that does not is one warning, and when none does, one error names each address,
    what it answered, and where to put the file by hand."""
    tried = []
    for route in plan.routes:
        url = ""
        try:
            files = []
            for name in route.sources:
                url, digest = _source(name, urls, checksums)
                files.append(download(url, downloads / Path(url).name, digest))
            splits = _read(route, files, target.name, url)
            found = counts(splits)
            if found != plan.counts:
                got, want = (" / ".join(f"{n:,}" for n in c) for c in (found, plan.counts))
                raise DownloadError(f"{url}: gives {got} images (train / val / test), not {target.name}'s {want}")
        except DownloadError as err:
            log.warning("%s; trying the next source", err)
            tried.append(str(err))
            continue
        write_text_atomically(target, json.dumps(splits))
        log.info("%s: made from %s", target, ", ".join(urls.get(n, SOURCES[n].url) for n in route.sources))
        return
    raise DownloadError(
        f"{target}: no source gave it ({'; '.join(tried)}); download it by hand and put it at {target} "
        f"(data/README.md, '{plan.section}')"
    )


def _read(route: Route, files: list[Path], split_file: str, url: str) -> dict:
    try:
        return route.read(files, split_file)
    except (ValueError, KeyError, TypeError, zipfile.BadZipFile, UnicodeDecodeError) as err:  # json's errors too
        raise DownloadError(f"{url}: not a file this source gives ({type(err).__name__}: {err})") from None
