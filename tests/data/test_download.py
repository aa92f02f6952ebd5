"""Downloads against a local HTTP server on 127.0.0.1 that serves small files made by the test."""

import hashlib
import io
import os
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from captioner.data.download import DownloadError, download, extract, fetch_and_extract


class RangeHandler(BaseHTTPRequestHandler):
    """Serves self.server.files, honours Range requests, and cuts the first transfer of `interrupt` paths."""

    def do_GET(self):
        server = self.server
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
    httpd.files, httpd.interrupt, httpd.requests = {}, set(), []
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
        download(url(server, "/big.bin"), target, sha256=sha, timeout=5)
    part = tmp_path / "big.bin.part"
    assert not target.exists() and 0 < part.stat().st_size < len(payload)
    partial = part.stat().st_size
    download(url(server, "/big.bin"), target, sha256=sha, timeout=5)
    assert target.read_bytes() == payload and not part.exists()
    assert server.requests == [("/big.bin", 0), ("/big.bin", partial)]  # the second request resumed


def test_checksum_mismatch_deletes_the_file(server, tmp_path):
    server.files["/a.bin"] = b"hello"
    with pytest.raises(DownloadError, match="checksum mismatch"):
        download(url(server, "/a.bin"), tmp_path / "a.bin", sha256="0" * 64, timeout=5)
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


def test_coco_datamodule_downloads_what_is_missing_before_building_its_vocabulary(server, tmp_path):
    import json

    from captioner.data.datamodules import CocoDataModule
    from tests.datasets import CAPTIONS
    from tests.images import photo

    def jpeg(name):
        buffer = io.BytesIO()
        photo(name).resize((64, 64)).save(buffer, format="JPEG")
        return buffer.getvalue()

    split = {"astronaut": ("train2014", "train"), "coffee": ("train2014", "train"), "rocket": ("val2014", "val")}
    karpathy = {
        "images": [
            {
                "filepath": folder,
                "filename": f"{n}.jpg",
                "split": s,
                "cocoid": i,
                "sentences": [{"raw": c} for c in CAPTIONS[f"{n}.jpg"]],
            }
            for i, (n, (folder, s)) in enumerate(split.items())
        ]
    }
    server.files["/m/train2014.zip"] = zip_of({f"train2014/{n}.jpg": jpeg(n) for n in ("astronaut", "coffee")})
    server.files["/m/val2014.zip"] = zip_of({"val2014/rocket.jpg": jpeg("rocket")})
    server.files["/m/caption_datasets.zip"] = zip_of({"dataset_coco.json": json.dumps(karpathy).encode()})
    urls = {name: url(server, f"/m/{name}.zip") for name in ("train2014", "val2014")}
    urls["karpathy"] = url(server, "/m/caption_datasets.zip")
    data = CocoDataModule(data_dir=str(tmp_path / "coco"), download=True, urls=urls, min_word_count=1)
    assert "astronaut" in data.vocab.stoi and "rocket" not in data.vocab.stoi  # train split only
    assert len(data.split("val")) == 1
    assert (tmp_path / "coco" / "train2014" / "coffee.jpg").is_file()
    assert not (tmp_path / "coco" / "downloads").exists()  # archives removed after extraction


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
