"""Downloads against a local HTTP server on 127.0.0.1 that serves small files made by the test."""

import hashlib
import io
import json
import os
import shutil
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from captioner.data.download import DownloadError, download, extract, fetch_and_extract
from tests.conftest import REPO


class RangeHandler(BaseHTTPRequestHandler):
    """Serves self.server.files, honours Range requests, and cuts the first transfer of `interrupt` paths."""

    def do_GET(self):
        server = self.server
        server.asked.append(self.path)  # every request, in order, those answered 404 too
        if self.path not in server.files:
            self.send_error(404)
            return
        data = server.files[self.path]
        header = self.headers.get("Range")
        start = int(header.split("=")[1].split("-")[0]) if header else 0
        server.requests.append((self.path, start))
        body = data[start:]
        self.send_response(206 if header else 200)
        if header:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.path in server.interrupt:
            server.interrupt.remove(self.path)
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), RangeHandler)
    httpd.files, httpd.interrupt, httpd.requests, httpd.asked = {}, set(), [], []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def url(server, path):
    return f"http://127.0.0.1:{server.server_address[1]}{path}"


def test_interrupted_download_resumes_and_is_verified(server, tmp_path):
    payload = bytes(range(256)) * 4096  # 1 MiB
    server.files["/big.bin"] = payload
    server.interrupt.add("/big.bin")
    target = tmp_path / "big.bin"
    sha = hashlib.sha256(payload).hexdigest()
    with pytest.raises(DownloadError, match="interrupted"):
        download(url(server, "/big.bin"), target, digest=sha, timeout=5)
    part = tmp_path / "big.bin.part"
    assert not target.exists() and 0 < part.stat().st_size < len(payload)
    partial = part.stat().st_size
    download(url(server, "/big.bin"), target, digest=sha, timeout=5)
    assert target.read_bytes() == payload and not part.exists()
    assert server.requests == [("/big.bin", 0), ("/big.bin", partial)]  # the second request resumed


def test_checksum_mismatch_deletes_the_file(server, tmp_path):
    server.files["/a.bin"] = b"hello"
    with pytest.raises(DownloadError, match="checksum mismatch"):
        download(url(server, "/a.bin"), tmp_path / "a.bin", digest="0" * 64, timeout=5)
    assert not (tmp_path / "a.bin").exists() and not (tmp_path / "a.bin.part").exists()


def test_http_errors_are_one_line(server, tmp_path):
    with pytest.raises(DownloadError, match="HTTP 404"):
        download(url(server, "/missing.zip"), tmp_path / "missing.zip", timeout=5)


def test_fetch_and_extract_a_zip_from_a_mirror(server, tmp_path):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.writestr("annotations/captions_train2014.json", '{"images": [], "annotations": []}')
    server.files["/mirror/annotations_trainval2014.zip"] = buffer.getvalue()
    marker = tmp_path / "annotations" / "captions_train2014.json"
    urls = {"annotations2014": url(server, "/mirror/annotations_trainval2014.zip")}
    fetch_and_extract("annotations2014", urls, tmp_path, marker)
    assert marker.read_text().startswith('{"images"')
    fetch_and_extract("annotations2014", urls, tmp_path, marker)  # already there: no second request
    assert len(server.requests) == 1


def zip_of(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, content in files.items():
            zf.writestr(name, content)
    return buffer.getvalue()


def jpeg(name: str) -> bytes:
    from tests.images import photo

    buffer = io.BytesIO()
    photo(name).resize((64, 64)).save(buffer, format="JPEG")
    return buffer.getvalue()


# A tiny COCO in the Karpathy split's shape: 2 train, 2 restval, 1 val, 1 test images (4 / 1 / 1)
COCO = [  # (name, its folder, Karpathy's split)
    ("astronaut", "train2014", "train"),
    ("coffee", "train2014", "train"),
    ("chelsea", "val2014", "restval"),
    ("camera", "val2014", "restval"),
    ("rocket", "val2014", "val"),
    ("cat", "val2014", "test"),
]


def coco_name(name: str, folder: str) -> str:
    return f"COCO_{folder}_{1000 + [n for n, *_ in COCO].index(name):012d}.jpg"


def caption(name: str, n: int) -> str:
    return f"a photo of the {name} number {n}"


def serve_coco(server, karpathy_zip: bool = True, lavis: bool = True) -> dict[str, str]:
    """The tiny COCO's image zips, and its split as Karpathy's zip and as LAVIS's three files; `urls` for them."""
    entries = {"train": [], "val": [], "test": []}
    for name, folder, split in COCO:
        image = f"{folder}/{coco_name(name, folder)}"
        if split in ("train", "restval"):  # one entry per caption
            entries["train"] += [{"image": image, "caption": caption(name, n), "image_id": f"coco_{n}"} for n in (1, 2)]
        else:
            entries[split].append({"image": image, "caption": [caption(name, n) for n in (1, 2)]})
    if lavis:
        for split, listed in entries.items():
            server.files[f"/lavis/coco_karpathy_{split}.json"] = json.dumps(listed).encode()
    karpathy = {
        "images": [
            {
                "filepath": f,
                "filename": coco_name(n, f),
                "split": s,
                "cocoid": 1000 + i,
                "sentences": [{"raw": caption(n, k)} for k in (1, 2)],
            }
            for i, (n, f, s) in enumerate(COCO)
        ]
    }
    if karpathy_zip:
        server.files["/stanford/caption_datasets.zip"] = zip_of({"dataset_coco.json": json.dumps(karpathy).encode()})
    for folder in ("train2014", "val2014"):
        images = {f"{folder}/{coco_name(n, f)}": jpeg(n) for n, f, _ in COCO if f == folder}
        server.files[f"/coco/{folder}.zip"] = zip_of(images)
    urls = {"karpathy": url(server, "/stanford/caption_datasets.zip")}
    urls |= {f"coco_karpathy_{s}": url(server, f"/lavis/coco_karpathy_{s}.json") for s in ("train", "val", "test")}
    return urls | {f: url(server, f"/coco/{f}.zip") for f in ("train2014", "val2014")}


@pytest.fixture
def tiny_counts(monkeypatch):
    """The split files' known counts, as the tiny datasets here have them."""
    from dataclasses import replace

    from captioner.data.sources import PLANS

    monkeypatch.setitem(PLANS, "dataset_coco.json", replace(PLANS["dataset_coco.json"], counts=(4, 1, 1)))
    monkeypatch.setitem(PLANS, "dataset_flickr8k.json", replace(PLANS["dataset_flickr8k.json"], counts=(2, 1, 1)))


@pytest.mark.parametrize("karpathy_zip", [True, False], ids=["karpathy's zip", "its 404, then LAVIS's files"])
def test_coco_gets_its_split_file_first_from_the_first_source_that_answers_then_its_images(
    server, tmp_path, tiny_counts, karpathy_zip
):
    """Small files first: the split file from Karpathy's zip, or, where it answers 404 (as it has since 2023), from
    LAVIS's three files, read into Karpathy's format; only then the image archives. The same split either way."""
    from captioner.data.datamodules import CocoDataModule

    urls = serve_coco(server, karpathy_zip=karpathy_zip)
    data = CocoDataModule(data_dir=str(tmp_path / "coco"), download=True, urls=urls, min_word_count=1)
    assert "astronaut" in data.vocab.stoi and "rocket" not in data.vocab.stoi  # train (with restval) only
    assert [len(data.split(s)) for s in ("train", "val", "test")] == [4, 1, 1]
    assert data.split("test").image_id(0) == 1005 and data.split("val").captions(0) == [
        caption("rocket", 1),
        caption("rocket", 2),
    ]
    split_files = ["/stanford/caption_datasets.zip"]
    if not karpathy_zip:
        split_files += [f"/lavis/coco_karpathy_{s}.json" for s in ("train", "val", "test")]
    assert server.asked == [*split_files, "/coco/train2014.zip", "/coco/val2014.zip"]
    assert not (tmp_path / "coco" / "downloads").exists()  # archives removed after extraction


def test_a_source_with_other_counts_is_refused_and_when_none_gives_the_split_one_line_says_what_each_answered(
    server, tmp_path, tiny_counts, monkeypatch
):
    """Karpathy's zip answers with another split (wrong counts) and LAVIS's files are missing: each is one warning,
    no image archive is asked for, and the error is one line: each address, what it answered, where the file goes."""
    from dataclasses import replace

    from captioner.data.datamodules import CocoDataModule
    from captioner.data.sources import PLANS

    urls = serve_coco(server, lavis=False)
    monkeypatch.setitem(PLANS, "dataset_coco.json", replace(PLANS["dataset_coco.json"], counts=(5, 1, 1)))
    data = CocoDataModule(data_dir=str(tmp_path / "coco"), download=True, urls=urls)
    with pytest.raises(DownloadError) as failed:
        data.prepare_data()
    target = tmp_path / "coco" / "dataset_coco.json"
    assert str(failed.value) == (
        f"{target}: no source gave it ({urls['karpathy']}: gives 4 / 1 / 1 images (train / val / test), not "
        f"dataset_coco.json's 5 / 1 / 1; {urls['coco_karpathy_train']}: HTTP 404 Not Found); download it by hand and "
        f"put it at {target} (data/README.md, 'MS-COCO (Karpathy splits, the usual setting)')"
    )
    assert server.asked == ["/stanford/caption_datasets.zip", "/lavis/coco_karpathy_train.json"]


FLICKR8K = {"1001_a.jpg": "train", "1002_b.jpg": "train", "1003_c.jpg": "val", "1004_d.jpg": "test"}
PHOTOS = dict(zip(FLICKR8K, ("astronaut", "coffee", "rocket", "chelsea"), strict=True))


def flickr8k_text() -> dict[str, bytes]:
    """Flickr8k's own text files: the captions (`<image>#<n>\t<caption>`) and the train, dev and test lists."""
    from captioner.data.sources import LISTS_8K, TOKENS_8K

    tokens = "".join(f"{name}#{n}\t{caption(PHOTOS[name], n)}\n" for name in FLICKR8K for n in range(5))
    files = {TOKENS_8K: tokens.encode()}
    for split, listing in LISTS_8K.items():
        files[listing] = "".join(f"{name}\n" for name, s in FLICKR8K.items() if s == split).encode()
    return files


def test_flickr8k_comes_from_its_own_text_files_and_image_zip(server, tmp_path, tiny_counts):
    """Flickr8k's split from its own distribution (the mirror's Flickr8k_text.zip) where Karpathy's zip answers 404,
    then its images (Flickr8k_Dataset.zip, whose Flicker8k_Dataset/ is the configured image root); and the same
    text files read where they are, with no download."""
    from captioner.data.datamodules import CocoDataModule

    server.files["/8k/Flickr8k_text.zip"] = zip_of({f"Flickr8k_text/{n}": b for n, b in flickr8k_text().items()})
    images = {f"Flicker8k_Dataset/{name}": jpeg(photo) for name, photo in PHOTOS.items()}
    server.files["/8k/Flickr8k_Dataset.zip"] = zip_of(images | {"__MACOSX/Flicker8k_Dataset/._1001_a.jpg": b"x"})
    urls = {"karpathy": url(server, "/stanford/caption_datasets.zip")}
    urls |= {
        "flickr8k_text": url(server, "/8k/Flickr8k_text.zip"),
        "flickr8k_images": url(server, "/8k/Flickr8k_Dataset.zip"),
    }
    options = {"split_file": "dataset_flickr8k.json", "image_root": "Flicker8k_Dataset", "min_word_count": 1}
    data = CocoDataModule(data_dir=str(tmp_path / "flickr8k"), download=True, urls=urls, **options)
    assert [len(data.split(s)) for s in ("train", "val", "test")] == [2, 1, 1]
    assert data.split("val").captions(0) == [caption("rocket", n) for n in range(5)]
    assert server.asked == ["/stanford/caption_datasets.zip", "/8k/Flickr8k_text.zip", "/8k/Flickr8k_Dataset.zip"]
    assert sorted(p.name for p in (tmp_path / "flickr8k" / "Flicker8k_Dataset").iterdir()) == sorted(FLICKR8K)

    own = tmp_path / "own"  # the text files where they are, read as they are: no download
    for name, content in flickr8k_text().items():
        (own / "text").mkdir(parents=True, exist_ok=True)
        (own / "text" / name).write_bytes(content)
    shutil.copytree(tmp_path / "flickr8k" / "Flicker8k_Dataset", own / "photos")
    asked = len(server.asked)
    options = {"split_file": "text/Flickr8k.token.txt", "image_root": str(own / "photos"), "min_word_count": 1}
    data = CocoDataModule(data_dir=str(own), download=True, urls=urls, **options)
    assert [len(data.split(s)) for s in ("train", "val", "test")] == [2, 1, 1] and len(server.asked) == asked


def test_images_found_under_an_image_root_elsewhere_are_not_downloaded(server, tmp_path, tiny_counts):
    """COCO's photos already on disk outside the data folder (an absolute image_root): only the split file is
    fetched."""
    from captioner.data.datamodules import CocoDataModule

    urls = serve_coco(server)
    photos = tmp_path / "lab" / "coco2014"
    for name, folder, _ in COCO:
        (photos / folder).mkdir(parents=True, exist_ok=True)
        (photos / folder / coco_name(name, folder)).write_bytes(jpeg(name))
    data = CocoDataModule(data_dir=str(tmp_path / "coco"), image_root=str(photos), download=True, urls=urls)
    assert len(data.split("train")) == 4
    assert server.asked == ["/stanford/caption_datasets.zip"]


URLS = {"train2014": "http://127.0.0.1:9/train2014.zip"}  # never asked: the archive is downloaded already


def test_an_interrupted_extraction_is_extracted_again_by_the_next_run(tmp_path, monkeypatch):
    members = {f"train2014/{i:03d}.jpg": bytes([i]) * 100 for i in range(20)}
    archive = tmp_path / "downloads" / "train2014.zip"
    archive.parent.mkdir()
    archive.write_bytes(zip_of(members))
    marker = tmp_path / "train2014"
    real_extractall = zipfile.ZipFile.extractall

    def killed_halfway(self, path):  # as a kill in the middle of a long unzip: half the files are on disk
        real_extractall(self, path, members=self.namelist()[:10])
        raise KeyboardInterrupt

    monkeypatch.setattr(zipfile.ZipFile, "extractall", killed_halfway)
    with pytest.raises(KeyboardInterrupt):
        fetch_and_extract("train2014", URLS, tmp_path, marker)
    assert not marker.exists()  # so the next run does not take the half as the whole
    monkeypatch.setattr(zipfile.ZipFile, "extractall", real_extractall)
    fetch_and_extract("train2014", URLS, tmp_path, marker)  # the archive is there already
    assert sorted(p.name for p in marker.iterdir()) == sorted(Path(m).name for m in members)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["downloads", "train2014"]  # no staging folder left


def test_extraction_into_an_existing_folder_moves_the_marker_last(tmp_path, monkeypatch):
    (tmp_path / "annotations").mkdir()
    (tmp_path / "annotations" / "instances_train2014.json").write_text("{}")  # from another archive
    files = {f"annotations/captions_{part}2014.json": b"{}" for part in ("val", "train")}
    archive = tmp_path / "annotations.zip"
    archive.write_bytes(zip_of(files))
    marker = tmp_path / "annotations" / "captions_train2014.json"
    moved, real_replace = [], os.replace

    def replace(source, target):
        moved.append(Path(target).name)
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", replace)
    extract(archive, tmp_path, marker)
    assert moved == ["captions_val2014.json", "captions_train2014.json"]
    assert sorted(p.name for p in (tmp_path / "annotations").iterdir()) == [
        "captions_train2014.json",
        "captions_val2014.json",
        "instances_train2014.json",
    ]


# A tiny UCM-captions: its images as the release numbers them (1-100 agricultural, 101-200 airplane, ... 2001-2100
# tennis courts), 3 / 1 / 1 of them in train / val / test
UCM = {"1.tif": ("train", "coffee"), "2.tif": ("train", "chelsea"), "101.tif": ("train", "rocket")}
UCM |= {"102.tif": ("val", "astronaut"), "2100.tif": ("test", "camera")}
UCMERCED_NAMES = {"1.tif": "agricultural/agricultural00.tif", "2.tif": "agricultural/agricultural01.tif"}
UCMERCED_NAMES |= {"101.tif": "airplane/airplane00.tif", "102.tif": "airplane/airplane01.tif"}
UCMERCED_NAMES |= {"2100.tif": "tenniscourt/tenniscourt99.tif"}


def tif(photo_name: str, size: int = 48) -> bytes:
    from tests.images import photo

    buffer = io.BytesIO()
    photo(photo_name).convert("RGB").resize((size, size)).save(buffer, format="TIFF")
    return buffer.getvalue()


def ucm_split() -> bytes:
    """The split file as the release has it: Karpathy's format, no filepath, each caption's raw text."""
    images = [
        {"filename": n, "imgid": i, "split": s, "sentences": [{"raw": f"a {p} seen from above {k} ."} for k in (1, 2)]}
        for i, (n, (s, p)) in enumerate(UCM.items())
    ]
    return json.dumps({"images": images, "dataset": "ucm"}).encode()


@pytest.fixture
def tiny_ucm(monkeypatch, tmp_path_factory):
    """The tiny UCM's counts, and the digest of the release's images as the repository archive gives them."""
    from dataclasses import replace

    from captioner.data.download import images_digest
    from captioner.data.sources import PLANS

    folder = tmp_path_factory.mktemp("release")
    for name, (_, photo_name) in UCM.items():
        (folder / name).write_bytes(tif(photo_name))
    plan = PLANS["dataset_ucm.json"]
    (images,) = plan.images
    release = replace(images.archives[0], digest=images_digest(folder, list(UCM)))
    images = replace(images, archives=(release, *images.archives[1:]))
    monkeypatch.setitem(PLANS, "dataset_ucm.json", replace(plan, counts=(3, 1, 1), images=(images,)))


def serve_ucm(server, split: bool = True, repository: bool = True, ucmerced: bool = True) -> dict[str, str]:
    """The tiny UCM's sources: the release's split file (raw), its repository's archive (the split file and imgs/ in
    GitHub's top folder, with the authors' other files), and UC Merced's archive of class-named photos."""
    from captioner.data.sources import UCM_ARCHIVE_TOP

    if split:
        server.files["/raw/dataset.json"] = ucm_split()
    if repository:
        files = {f"{UCM_ARCHIVE_TOP}/imgs/{n}": tif(p) for n, (_, p) in UCM.items()}
        files |= {f"{UCM_ARCHIVE_TOP}/dataset.json": ucm_split(), f"{UCM_ARCHIVE_TOP}/Models/model_499.h5": b"x" * 99}
        server.files["/codeload/zip"] = zip_of(files)
    if ucmerced:
        files = {f"UCMerced_LandUse/Images/{UCMERCED_NAMES[n]}": tif(p) for n, (_, p) in UCM.items()}
        files["UCMerced_LandUse/Images/beach/beach00.tif"] = tif("coffee")  # a photo the tiny split does not name
        server.files["/ucmerced/UCMerced_LandUse.zip"] = zip_of(files)
    return {
        "ucm_split": url(server, "/raw/dataset.json"),
        "ucm_repository": url(server, "/codeload/zip"),
        "ucmerced": url(server, "/ucmerced/UCMerced_LandUse.zip"),
        "ucmerced_mirror": url(server, "/torchgeo/UCMerced_LandUse.zip"),
    }


def ucm_data(tmp_path, urls):
    """configs/ucm.yaml's data options, in a fresh folder, with the sources at `urls`."""
    import yaml

    from captioner.data.datamodules import CocoDataModule

    options = yaml.safe_load((REPO / "configs" / "ucm.yaml").read_text())["data"]["init_args"]
    options |= {"data_dir": str(tmp_path / "ucm"), "urls": urls, "min_word_count": 1, "num_workers": 0}
    return CocoDataModule(**options)


def test_ucm_comes_from_the_release_s_split_file_then_its_repository_s_photos(server, tmp_path, tiny_ucm):
    """configs/ucm.yaml on a fresh folder: the split file first (the release's, 2.9 MB), then the repository's archive
    for its photos, which are checked (every image the split names; their digest) before they take their place. The
    archive is deleted once extracted; a second run asks for nothing."""
    urls = serve_ucm(server)
    data = ucm_data(tmp_path, urls)
    assert [len(data.split(s)) for s in ("train", "val", "test")] == [3, 1, 1]
    assert server.asked == ["/raw/dataset.json", "/codeload/zip"]
    root = tmp_path / "ucm" / "images"
    assert sorted(p.name for p in root.iterdir()) == sorted(UCM)  # the photos only, not the authors' other files
    assert (root / "101.tif").read_bytes() == tif("rocket")
    assert not (tmp_path / "ucm" / "downloads").exists()
    ucm_data(tmp_path, urls).split("train")
    assert len(server.asked) == 2


def test_ucm_falls_back_source_by_source_and_never_keeps_a_wrong_file(server, tmp_path, tiny_ucm, caplog):
    """The release's split file answers with an HTML page (a 200, as a moved link does): refused with one warning,
    deleted, and the split comes from the repository's archive. That archive's photos are not the release's (their
    digest): refused, and the photos come from UC Merced's own archive (its 404'ing first address, then the
    mirror), numbered by class as the captions are, with a warning that says so."""
    urls = serve_ucm(server)
    server.files["/raw/dataset.json"] = b"<!DOCTYPE html><html><body>moved</body></html>"
    archive = zipfile.ZipFile(io.BytesIO(server.files["/codeload/zip"]))
    files = {name: archive.read(name) for name in archive.namelist()}
    files[next(n for n in files if n.endswith("imgs/2.tif"))] = tif("astronaut")  # another photo under its name
    server.files["/codeload/zip"] = zip_of(files)
    server.files["/torchgeo/UCMerced_LandUse.zip"] = server.files.pop("/ucmerced/UCMerced_LandUse.zip")
    data = ucm_data(tmp_path, urls)
    assert [len(data.split(s)) for s in ("train", "val", "test")] == [3, 1, 1]
    assert server.asked == [
        "/raw/dataset.json",
        "/codeload/zip",
        "/ucmerced/UCMerced_LandUse.zip",
        "/torchgeo/UCMerced_LandUse.zip",
    ]
    root = tmp_path / "ucm" / "images"
    assert sorted(p.name for p in root.iterdir()) == sorted(UCM)  # beach00.tif, not named by the split, left out
    assert all((root / n).read_bytes() == tif(p) for n, (_, p) in UCM.items())
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("/raw/dataset.json: the file it gave is an HTML page; it was deleted" in w for w in warnings)
    assert any("/codeload/zip: its images are not the ones this source is known to give" in w for w in warnings)
    assert any("/ucmerced/UCMerced_LandUse.zip: HTTP 404" in w for w in warnings)
    assert any("numbered by class" in w for w in warnings)
    assert not (tmp_path / "ucm" / "downloads").exists() and not list((tmp_path / "ucm").glob(".*extracting"))


def test_when_no_source_gives_ucm_s_photos_one_line_says_what_each_answered_and_where_they_go(
    server, tmp_path, tiny_ucm
):
    """The split file comes, but the repository's archive is cut short (not a zip) and UC Merced's are missing: one
    error line names each address, what it answered, and where the photos go by hand; no wrong file is kept."""
    urls = serve_ucm(server, ucmerced=False)
    server.files["/codeload/zip"] = server.files["/codeload/zip"][:100]
    data = ucm_data(tmp_path, urls)
    with pytest.raises(DownloadError) as failed:
        data.prepare_data()
    root = tmp_path / "ucm" / "images"
    assert str(failed.value) == (
        f"{root}: no source gave its images ({urls['ucm_repository']}: the file it gave is not a zip archive (cut "
        f"short, or another file); it was deleted; {urls['ucmerced']}: HTTP 404 Not Found; {urls['ucmerced_mirror']}: "
        f"HTTP 404 Not Found); download them by hand and put them in {root} (data/README.md, 'UCM-captions (aerial "
        "photos)')"
    )
    assert not root.exists() and (tmp_path / "ucm" / "dataset_ucm.json").is_file()  # the next run asks for photos
    assert [p.name for p in (tmp_path / "ucm" / "downloads").iterdir()] == ["dataset.json"]  # the good file only


def test_a_file_that_a_source_once_gave_wrong_is_never_trusted_by_a_later_run(server, tmp_path):
    """A download left in downloads/ by an earlier run (here an HTML page under a zip's name) is checked before it is
    used: deleted and downloaded again, not returned as it is."""
    good = zip_of({"a.txt": b"a"})
    server.files["/a.zip"] = good
    target = tmp_path / "downloads" / "a.zip"
    target.parent.mkdir()
    target.write_bytes(b"<html><body>Rate limit exceeded</body></html>")
    assert download(url(server, "/a.zip"), target, timeout=5).read_bytes() == good
    assert server.asked == ["/a.zip"]


def test_a_misspelt_source_name_in_urls_is_refused_in_one_line(tmp_path):
    from captioner.data.download import prepare

    with pytest.raises(DownloadError, match=r"urls: no source is named ucm_splt; the names are karpathy, "):
        prepare(tmp_path, "karpathy", 2014, "dataset_ucm.json", "images", {"ucm_splt": "http://127.0.0.1:9/"}, {})


@pytest.mark.ci
@pytest.mark.parametrize("config", ["coco_lite0", "flickr8k", "ucm"])
def test_a_shipped_config_fits_on_what_its_sources_give_small_files_first(
    server, tmp_path, tiny_counts, tiny_ucm, monkeypatch, capfd, config
):
    """`captioner fit --config configs/<config>.yaml` on a fresh folder, with a loopback server standing in for the
    internet: the first source of the split answers 404 (Karpathy's zip; the UCM release's raw file), the split comes
    from the next source (LAVIS's files; Flickr8k's own text files; the UCM repository's archive), and only then are
    the image archives asked for (the server's log); the fit trains on them."""
    from tests.conftest import run_main

    server.files.pop("/stanford/caption_datasets.zip", None)
    if config == "ucm":
        urls = serve_ucm(server, split=False)
        split_files, archives = ["/raw/dataset.json", "/codeload/zip"], []  # its photos: from the same archive
    elif config == "coco_lite0":
        urls = serve_coco(server, karpathy_zip=False)
        split_files = [f"/lavis/coco_karpathy_{s}.json" for s in ("train", "val", "test")]
        archives = ["/coco/train2014.zip", "/coco/val2014.zip"]
    else:
        server.files["/8k/Flickr8k_text.zip"] = zip_of(flickr8k_text())
        server.files["/8k/Flickr8k_Dataset.zip"] = zip_of(
            {f"Flicker8k_Dataset/{name}": jpeg(photo) for name, photo in PHOTOS.items()}
        )
        urls = {"karpathy": url(server, "/stanford/caption_datasets.zip")}
        urls |= {
            f"flickr8k_{n}": url(server, f"/8k/{f}")
            for n, f in (("text", "Flickr8k_text.zip"), ("images", "Flickr8k_Dataset.zip"))
        }
        split_files, archives = ["/8k/Flickr8k_text.zip"], ["/8k/Flickr8k_Dataset.zip"]
    monkeypatch.chdir(tmp_path)
    sizes = ["--trainer.max_epochs=1", "--model.embed_dim=16", "--model.decoder_dim=16", "--model.attention_dim=16"]
    data = [f"--data.init_args.data_dir={tmp_path / 'data'}", f"--data.init_args.urls={json.dumps(urls)}"]
    data += ["--data.init_args.batch_size=4", "--data.init_args.num_workers=0", "--data.init_args.min_word_count=1"]
    ran = run_main(capfd, "fit", "--config", str(REPO / "configs" / f"{config}.yaml"), *sizes, *data)
    assert ran.status == 0, ran.err[-3000:]
    first = [] if config == "ucm" else ["/stanford/caption_datasets.zip"]
    assert server.asked == [*first, *split_files, *archives]
    assert (tmp_path / "checkpoints" / config / "last.ckpt").is_file()


def test_flickr30k_from_lavis_s_files_finds_its_photos_in_the_documented_folder(server, tmp_path, monkeypatch):
    """LAVIS names Flickr30k's photos `flickr30k-images/<name>`; Karpathy's file names them without a folder. Either
    way the photos are in image_root (data/README.md: `image_root=flickr30k-images`), not looked for in
    flickr30k-images/flickr30k-images/ ("no usable images")."""
    from dataclasses import replace

    from captioner.data.datamodules import CocoDataModule
    from captioner.data.sources import PLANS

    monkeypatch.setitem(PLANS, "dataset_flickr30k.json", replace(PLANS["dataset_flickr30k.json"], counts=(2, 1, 1)))
    splits = {"train": ["1001.jpg", "1002.jpg"], "val": ["1003.jpg"], "test": ["1004.jpg"]}
    urls = {"karpathy": url(server, "/stanford/caption_datasets.zip")}
    for split, names in splits.items():
        if split == "train":
            entries = [{"image": f"flickr30k-images/{n}", "caption": caption(n, k)} for n in names for k in (1, 2)]
        else:
            entries = [{"image": f"flickr30k-images/{n}", "caption": [caption(n, k) for k in (1, 2)]} for n in names]
        server.files[f"/lavis/flickr30k_{split}.json"] = json.dumps(entries).encode()
        urls[f"flickr30k_{split}"] = url(server, f"/lavis/flickr30k_{split}.json")
    photos = tmp_path / "flickr30k" / "flickr30k-images"  # given by the authors, put in place by hand
    photos.mkdir(parents=True)
    for (name, _), which in zip(PHOTOS.items(), ("1001.jpg", "1002.jpg", "1003.jpg", "1004.jpg"), strict=True):
        (photos / which).write_bytes(jpeg(PHOTOS[name]))
    options = {"split_file": "dataset_flickr30k.json", "image_root": "flickr30k-images", "min_word_count": 1}
    data = CocoDataModule(data_dir=str(tmp_path / "flickr30k"), download=True, urls=urls, **options)
    assert [len(data.split(s)) for s in ("train", "val", "test")] == [2, 1, 1]


@pytest.mark.parametrize("split_file", ["dataset_flickr8k.json", "Flickr8k.token.txt"])
def test_flickr8k_s_photos_are_fetched_into_the_data_folder_itself_or_beside_its_own_text_files(
    server, tmp_path, tiny_counts, split_file
):
    """`image_root: .` (the photos in the data folder itself, whose existence says nothing of them), and Flickr8k's own
    text files as the split file: the photos are fetched all the same, and a second run asks for nothing."""
    from captioner.data.datamodules import CocoDataModule

    server.files["/8k/Flickr8k_text.zip"] = zip_of(flickr8k_text())
    server.files["/8k/Flickr8k_Dataset.zip"] = zip_of(
        {f"Flicker8k_Dataset/{name}": jpeg(photo) for name, photo in PHOTOS.items()}
    )
    urls = {
        "karpathy": url(server, "/stanford/caption_datasets.zip"),
        "flickr8k_text": url(server, "/8k/Flickr8k_text.zip"),
    }
    urls["flickr8k_images"] = url(server, "/8k/Flickr8k_Dataset.zip")
    root = tmp_path / "flickr8k"
    if split_file == "Flickr8k.token.txt":  # put in place by hand, as data/README.md allows
        root.mkdir()
        for name, content in flickr8k_text().items():
            (root / name).write_bytes(content)
    options = {"split_file": split_file, "image_root": ".", "min_word_count": 1}
    data = CocoDataModule(data_dir=str(root), download=True, urls=urls, **options)
    assert [len(data.split(s)) for s in ("train", "val", "test")] == [2, 1, 1]
    assert all((root / name).is_file() for name in FLICKR8K)
    asked = len(server.asked)
    CocoDataModule(data_dir=str(root), download=True, urls=urls, **options).prepare_data()
    assert len(server.asked) == asked
