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
    fetched. At e647ee0 the check looked for data_dir/train2014, and 19 GB were downloaded again."""
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


@pytest.mark.ci
@pytest.mark.parametrize("config", ["coco_lite0", "flickr8k"])
def test_a_shipped_config_fits_on_what_its_sources_give_small_files_first(
    server, tmp_path, tiny_counts, monkeypatch, capfd, config
):
    """`captioner fit --config configs/<config>.yaml` on a fresh folder, with a loopback server standing in for the
    internet: Karpathy's zip answers 404, the split comes from the next source (LAVIS's files; Flickr8k's own text
    files), and only then are the image archives asked for (the server's log); the fit trains on them."""
    from tests.conftest import run_main

    server.files.pop("/stanford/caption_datasets.zip", None)
    if config == "coco_lite0":
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
    assert server.asked == ["/stanford/caption_datasets.zip", *split_files, *archives]
    assert (tmp_path / "checkpoints" / config / "last.ckpt").is_file()
