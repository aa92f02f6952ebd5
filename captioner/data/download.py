"""Resumable downloads with checksum, progress bar and extraction, and what `download: true` fetches for a real
dataset (`prepare`), small files first: the split or annotation files (a few MB, from the first of their sources that
answers with the split's known counts, `captioner.data.sources`), then the image archives (19 GB for COCO) that are
not on disk already, each from the first of its sources that gives every image the split file names.

A download goes to `<file>.part`; an interrupted one resumes from there with an HTTP Range request. The finished
file is checked against its digest (when one is known) and for what it must be (an HTML page is never a zip or a
JSON file; a zip opens; JSON parses) before it replaces the final name, so a file without `.part` is always complete,
and one that is not what it should be is deleted, never kept for the next run. An archive is extracted into a
temporary folder and then renamed into place, so that what the next run takes as "extracted" is complete: a kill in
the middle of the 13 GB unzip leaves only the temporary folder, which the next run deletes before it extracts again.
Each archive is deleted once extracted. One process at a time prepares a dataset folder (a lock file), so the ranks
of a DDP run, which all build the vocabulary when they start, do not download twice.
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
import zlib
from pathlib import Path

from tqdm import tqdm

from captioner.data.sources import PLANS, SOURCES, Archive, Images, Plan, Route, counts, read_split_file
from captioner.errors import CaptionerError
from captioner.files import build_lock, writable, write_text_atomically

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


def check_content(path: Path, name: str | None = None) -> None:
    """Raise ValueError unless the file at `path` is what its name (`name`, or its own) says it is: never an HTML page
    (what a moved link answers with a 200), a zip that opens, JSON that parses."""
    name = name or path.name
    with path.open("rb") as file:
        head = file.read(512).lstrip().lower()
    if head.startswith((b"<!doctype html", b"<html")):
        raise ValueError("is an HTML page")
    if name.endswith(".zip") and not zipfile.is_zipfile(path):
        raise ValueError("is not a zip archive (cut short, or another file)")
    if name.endswith(".json"):
        try:
            json.loads(path.read_bytes())
        except (ValueError, UnicodeDecodeError):
            raise ValueError("is not JSON") from None


def download(url: str, destination: str | Path, digest: str | None = None, timeout: float = 30.0) -> Path:
    """Download `url` to `destination`, resuming a previous partial download; verify `digest` if given ("md5:<hex>",
    "sha256:<hex>", or a bare SHA-256) and the content (`check_content`), deleting a file that fails either. A file
    already at `destination` is checked again and, if it fails, downloaded again."""
    destination = Path(destination)
    if destination.exists():
        try:
            check_content(destination)
            return destination
        except ValueError as err:
            log.warning("%s %s: deleted, to be downloaded again", destination, err)
            destination.unlink()
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
    try:
        check_content(part, destination.name)
    except ValueError as err:
        part.unlink()
        raise DownloadError(f"{url}: the file it gave {err}; it was deleted") from None
    part.replace(destination)
    return destination


def extract(archive: str | Path, folder: str | Path, marker: str | Path) -> None:
    """Unzip `archive` into `folder`, refusing members that would land outside it.

    The members are extracted into a temporary folder first, then moved into `folder`: a top-level folder that is not
    there yet by one rename, into one that is (annotations/) file by file, `marker` last of all. So `marker`, the file
    or folder whose presence means "extracted", appears only when everything else is in place.
    """
    folder, marker = Path(folder).resolve(), Path(marker).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    staging = folder / f".{Path(archive).name}.extracting"
    shutil.rmtree(staging, ignore_errors=True)  # what a killed extraction left
    try:
        with zipfile.ZipFile(archive) as zf:
            for member in zf.namelist():
                if not (staging / member).resolve().is_relative_to(staging):
                    raise DownloadError(f"{archive}: member {member!r} would be extracted outside {folder}")
            zf.extractall(staging)
    except (zipfile.BadZipFile, zlib.error, EOFError) as err:
        shutil.rmtree(staging, ignore_errors=True)
        raise DownloadError(f"{archive}: a damaged zip archive ({err})") from None
    _move_into(staging, folder, staging / marker.relative_to(folder))
    shutil.rmtree(staging, ignore_errors=True)


def images_digest(folder: Path, names: list[str]) -> str:
    """The SHA-256 of a folder's images: of one line `<name> <its SHA-256>` per name, in the names' order."""
    lines = "".join(f"{name} {digest_of(folder / name)}\n" for name in sorted(names))
    return hashlib.sha256(lines.encode()).hexdigest()


def extract_images(path: Path, archive: Archive, target: Path, names: list[str], url: str) -> None:
    """Put the images of `archive` (downloaded to `path` from `url`) that a split file names (`names`, relative to
    `target`) into `target`: the files of the archive's folder are extracted into a temporary folder beside it, under
    their names in the dataset (`Archive.rename`), checked (every name is there; their digest, where one is known),
    and moved into place, the first name last: its presence says that they all are. A DownloadError names what is
    wrong."""
    target = target.resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.{path.name}.extracting"
    shutil.rmtree(staging, ignore_errors=True)  # what a killed extraction left
    prefix, named = archive.folder.strip("/") + "/", set(names)
    log.info("extracting %s from %s", archive.folder, path)
    try:
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                if info.is_dir() or not info.filename.startswith(prefix):
                    continue
                inner = info.filename[len(prefix) :]
                name = archive.rename(inner) if archive.rename else inner
                destination = staging / name if name in named else None  # others are not the dataset's
                if destination is None or not destination.resolve().is_relative_to(staging.resolve()):
                    continue
                destination.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as source, destination.open("wb") as out:
                    shutil.copyfileobj(source, out, CHUNK)
        missing = [name for name in names if not (staging / name).is_file()]
        if missing:
            raise DownloadError(
                f"{url}: it holds {len(names) - len(missing):,} of the {len(names):,} images the split file names "
                f"(not {archive.folder}/{missing[0]}, ...)"
            )
        if archive.digest is not None and images_digest(staging, names) != archive.digest:
            raise DownloadError(f"{url}: its images are not the ones this source is known to give (their digest)")
        _move_into(staging, target, staging / names[0])
    except (zipfile.BadZipFile, zlib.error, EOFError) as err:
        raise DownloadError(f"{url}: a damaged zip archive ({err})") from None
    finally:
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


def _fetch(name: str, urls: dict[str, str], checksums: dict[str, str], downloads: Path) -> tuple[Path, str]:
    """Download source `name` into `downloads` (`download`, checked): its path there, and the address it came from."""
    url, digest = _source(name, urls, checksums)
    return download(url, downloads / SOURCES[name].saved_as(url), digest), url


def fetch_and_extract(
    name: str,
    urls: dict[str, str],
    folder: Path,
    marker: Path,
    checksums: dict[str, str] | None = None,
    downloads: Path | None = None,
) -> None:
    """Download the zip of source `name` into `downloads` (default: folder/downloads) and extract it into folder
    (`extract`), unless `marker` exists; the zip is deleted once extracted."""
    if marker.exists():
        return
    archive, _ = _fetch(name, urls, checksums or {}, downloads or folder / "downloads")
    log.info("extracting %s", archive)
    extract(archive, folder, marker)
    if not marker.exists():
        raise DownloadError(f"{archive}: extracted, but {marker} is still missing")
    archive.unlink()


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
    annotations), then each folder of images that is not where the data module looks for it (`image_root`,
    absolute or under `folder`). checksums: source name -> SHA-256; urls: source name -> a mirror's address."""
    if format == "custom":
        return
    if unknown := sorted(set(urls) - SOURCES.keys()):
        raise DownloadError(f"urls: no source is named {', '.join(unknown)}; the names are {', '.join(SOURCES)}")
    steps = _steps(folder, format, year, split_file, image_root)
    if all(done() for done, _ in steps):  # nothing to do: a read-only folder is not written to
        return
    if not writable(folder):  # a shared, read-only copy: nothing can be fetched into it
        raise DownloadError(
            f"{folder}: cannot be written, and files of the dataset are missing there (download: true fetches them "
            "into it): put them there by hand (data/README.md), or set data_dir to a copy you can write"
        )
    with build_lock(folder):
        downloads = folder / "downloads"
        for done, fetch in steps:
            if not done():
                fetch(urls, checksums, downloads)
        shutil.rmtree(downloads, ignore_errors=True)


def _archive(name: str, folder: Path, marker: Path):
    """The step that fetches and extracts the archive of source `name` (`fetch_and_extract`)."""
    return lambda urls, checksums, downloads: fetch_and_extract(name, urls, folder, marker, checksums, downloads)


def split_images(split_file: Path, folder: str) -> list[str]:
    """The images a split file names in one folder under its image root (`filepath`; "": the root), by their names
    there, in the file's order."""
    images = read_split_file(split_file)["images"]
    return [image["filename"] for image in images if image.get("filepath", "") == folder]


def _steps(folder: Path, format: str, year: int, split_file: str, image_root: str) -> list:
    """What `prepare` makes, in order, small files first: (whether it is there already, the step that makes it from
    urls, checksums and the downloads folder)."""
    if format == "coco":
        annotations = folder / "annotations" / f"captions_train{year}.json"
        parts = [folder / f"train{year}", folder / f"val{year}"]
        return [(annotations.exists, _archive(f"annotations{year}", folder, annotations))] + [
            (part.exists, _archive(part.name, folder, part)) for part in parts
        ]
    plan, target = PLANS.get(Path(split_file).name), folder / split_file

    def split(urls: dict, checksums: dict, downloads: Path) -> None:
        if plan is None:
            raise DownloadError(f"{target}: missing, and no source of it is known; see data/README.md")
        make_split_file(target, plan, urls, checksums, downloads)

    steps = [(target.exists, split)]
    root = folder / image_root  # where the images are looked for; an absolute image_root anywhere
    for images in plan.images if plan is not None else ():
        steps.append(_images_step(images, root, target, plan.section))
    return steps


def _images_step(images: Images, root: Path, split_file: Path, section: str) -> tuple:
    """The step that puts a folder of images where the split file (made by the step before) looks for them, from the
    first of its archives that gives every one of them: (whether they are there, the step). A folder of its own
    (`train2014/`) is there when it exists, since it is moved into place whole; images at the image root itself, when
    the first of them is, since it is moved in last."""
    where = root / images.folder if images.folder else root

    def done() -> bool:
        if images.folder:
            return where.exists()
        names = split_images(split_file, "") if split_file.exists() else []
        return not names or (where / names[0]).exists()

    def fetch(urls: dict, checksums: dict, downloads: Path) -> None:
        names, tried = split_images(split_file, images.folder), []
        for archive in images.archives:
            path = None
            try:
                path, url = _fetch(archive.source, urls, checksums, downloads)
                extract_images(path, archive, where, names, url)
            except DownloadError as err:
                log.warning("%s; trying the next source", err)
                tried.append(str(err))
                if path is not None:
                    path.unlink(missing_ok=True)  # not the archive it should be: never kept for a later run
                continue
            if archive.note:
                log.warning("%s: %s", where, archive.note)
            path.unlink()
            return
        raise DownloadError(
            f"{where}: no source gave its images ({'; '.join(tried)}); download them by hand and put them in {where} "
            f"(data/README.md, '{section}')"
        )

    return done, fetch


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
                path, url = _fetch(name, urls, checksums, downloads)
                files.append(path)
            splits = _read(route, files, target.name, url)
            found = counts(splits)
            if found != plan.counts:
                got, want = (" / ".join(f"{n:,}" for n in c) for c in (found, plan.counts))
                raise DownloadError(f"{url}: gives {got} images (train / val / test), not {target.name}'s {want}")
        except DownloadError as err:
            log.warning("%s; trying the next source", err)
            tried.append(str(err))
            for path in files:  # what this route gave is not the split: never kept for a later run
                path.unlink(missing_ok=True)
            continue
        write_text_atomically(target, json.dumps(splits))
        log.info("%s: made from %s", target, ", ".join(urls.get(n, SOURCES[n].url) for n in route.sources))
        return
    answers = f"no source gave it ({'; '.join(tried)})" if tried else "missing, and it has no source to download"
    where = f"put it at {target} (data/README.md, '{plan.section}')"
    raise DownloadError(f"{target}: {answers}; download it by hand and {where}")


def _read(route: Route, files: list[Path], split_file: str, url: str) -> dict:
    try:
        return route.read(files, split_file)
    except (ValueError, KeyError, TypeError, zipfile.BadZipFile, UnicodeDecodeError) as err:  # json's errors too
        raise DownloadError(f"{url}: not a file this source gives ({type(err).__name__}: {err})") from None
