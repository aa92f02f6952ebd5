"""The bundled real-photo model `ucm` as a user meets it after `make install`, with no file of their own: in Python,
on the command line with overlays, in `captioner serve`, exported to ONNX, and evaluated; on the UCM test photos that
ship in docs/images/ucm/. What it scores on the whole test split is the README's row (`captioner evaluate --ckpt_path
ucm`, which needs the downloaded data: .ci/run's journey)."""

from __future__ import annotations

import io

import pytest

from captioner import Captioner
from captioner.api import BUNDLED
from tests.conftest import REPO, run_main

PHOTOS = sorted((REPO / "docs" / "images" / "ucm").glob("*.jpg"))
# Each shipped photo's class (its file's name) and the words a caption of it must hold one of
WORDS = {
    "airplane": {"airplane", "airplanes", "plane", "planes"},
    "harbor": {"boats", "boat", "harbor"},
    "parkinglot": {"cars", "car", "parking"},
    "storagetanks": {"tanks", "tank", "storage"},
    "tenniscourt": {"tennis", "court", "courts"},
}


@pytest.fixture(scope="module")
def ucm() -> Captioner:
    return Captioner.load("ucm")


def test_it_ships_small_with_its_card(ucm):
    """The file holds the decoder alone (its encoder rebuilt from Lite0's package), in float16, and its card: the
    data and its licence, the split, how it was trained and its test scores."""
    assert BUNDLED["ucm"].stat().st_size < 17 * 2**20
    card = ucm.card
    assert card["name"] == "ucm" and "aerial" in card["note"]
    assert {"data", "licence", "split", "trained", "scores", "examples"} <= card.keys()
    assert "public domain" in card["licence"] and card["scores"]["beam"] == 3
    assert all((REPO / photo).is_file() for photo in card["examples"])


def test_the_package_stays_under_25_mib():
    """Everything the wheel holds is under captioner/ (the code and its assets, both bundled models among them): under
    25 MiB before compression, so the wheel is too."""
    files = [p for p in (REPO / "captioner").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert sum(p.stat().st_size for p in files) < 25 * 2**20


def test_it_says_what_each_shipped_photo_shows(ucm):
    results = ucm.caption([str(p) for p in PHOTOS], beam_size=3)
    assert len(results) == len(WORDS) == len(PHOTOS)
    for photo, result in zip(PHOTOS, results, strict=True):
        kind = photo.stem.split("_")[0]
        assert WORDS[kind] & set(result.tokens), (photo.name, result.text)
        assert result.alphas.shape == (len(result.tokens), 49)


def test_the_caption_command_writes_overlays_and_says_what_the_model_has_seen(tmp_path, capfd):
    ran = run_main(capfd, "caption", str(REPO / "docs" / "images" / "ucm"), "--ckpt_path", "ucm", "--overlays",
                   str(tmp_path))  # fmt: skip
    assert ran.status == 0 and ran.out.count("\t") == len(PHOTOS), ran.err[-2000:]
    assert ran.err.startswith("note: ucm: trained on") and "aerial" in ran.err.splitlines()[0]
    assert len(list(tmp_path.glob("*.png"))) == len(PHOTOS)


def test_serve_captions_a_shipped_photo_and_shows_them_as_examples(ucm):
    from fastapi.testclient import TestClient

    from captioner.serve import create_app

    with TestClient(create_app(ucm)) as client:
        assert client.get("/api/examples").json() == [p.name for p in PHOTOS]
        photo = PHOTOS[0].read_bytes()
        answer = client.post("/api/caption", files={"image": ("a.jpg", io.BytesIO(photo), "image/jpeg")}).json()
        assert answer["caption"] == ucm.caption([str(PHOTOS[0])])[0].text and answer["grid"] == [7, 7]


@pytest.mark.ci  # the export: about 20 s
def test_its_onnx_export_captions_the_shipped_photos_with_its_words(ucm, tmp_path, capfd):
    from captioner.onnx import Captioner as OnnxCaptioner

    ran = run_main(capfd, "export", "--ckpt_path", "ucm", "--format", "onnx", "--output", str(tmp_path / "ucm_onnx"))
    assert ran.status == 0, ran.err[-2000:]
    exported = OnnxCaptioner(tmp_path / "ucm_onnx", resize="exact")
    assert exported.card == ucm.card
    for beam in (1, 3):
        want = [r.tokens for r in ucm.caption([str(p) for p in PHOTOS], beam_size=beam)]
        assert [r.tokens for r in exported.caption([str(p) for p in PHOTOS], beam_size=beam)] == want
