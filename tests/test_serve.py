"""`captioner serve`, run as users run it (the command, on a local port): the JSON API, bad uploads, concurrent
clients, and the page in a real browser (Debian's Chromium driven by Playwright)."""

from __future__ import annotations

import io
import os
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from captioner.api import Captioner
from captioner.cli import main
from captioner.data.shapes import ShapesDataset
from tests.images import png_claiming

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def server():
    """`captioner serve` with the bundled model and a 1 MB upload limit; yields its base URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "captioner.cli", "serve", "--port", str(port), "--max-upload-mb", "1"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/healthz").status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    else:
        process.kill()
        pytest.fail(f"captioner serve did not come up:\n{process.communicate()[0]}")
    yield url
    process.terminate()
    log = process.communicate(timeout=30)[0]
    assert "Traceback" not in log, log


@pytest.fixture(scope="module")
def images():
    """Held-out shapes images and what the Python API says of each (beam 3), to check the server's answers by."""
    split = ShapesDataset("test", 4, seed=1)
    pictures = [split.load_image(i) for i in range(len(split))]
    expected = Captioner.load("shapes").caption(pictures, beam_size=3)
    return [(png(picture), result) for picture, result in zip(pictures, expected, strict=True)]


def post(url: str, content: bytes, name: str = "image.png", **form) -> httpx.Response:
    return httpx.post(f"{url}/api/caption", files={"image": (name, content)}, data=form, timeout=60)


def test_the_api_answers_what_the_python_api_does(server, images):
    content, expected = images[0]
    health = httpx.get(f"{server}/healthz").json()
    assert health["status"] == "ok" and health["grid"] == list(expected.grid_hw)
    response = post(server, content, beam_size=3)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert set(answer) == {"caption", "tokens", "score", "grid", "alphas"}
    assert answer["caption"] == expected.text == " ".join(answer["tokens"])
    assert answer["tokens"] == expected.tokens
    assert answer["score"] == pytest.approx(expected.score, abs=1e-3)
    assert answer["grid"] == list(expected.grid_hw)
    assert len(answer["alphas"]) == len(answer["tokens"])
    for row, expected_row in zip(answer["alphas"], expected.alphas.tolist(), strict=True):
        assert len(row) == expected.grid_hw[0] * expected.grid_hw[1] and sum(row) == pytest.approx(1, abs=1e-3)
        assert row == pytest.approx(expected_row, abs=1e-3)


def test_bad_uploads_get_a_one_line_400_and_the_server_stays_up(server, images):
    content = images[0][0]
    cases = [
        (post(server, b"my shopping list\n" * 10, "notes.txt"), "notes.txt: not an image file PIL can read"),
        (post(server, content[: len(content) // 2], "cut.png"), "cut.png: cannot decode image"),
        (post(server, png_claiming(100_000, 100_000), "bomb.png"), "bomb.png: refused as a possible decompression"),
        (post(server, os.urandom(1_200_000), "huge.jpg"), "over the 1 MB limit"),
        (post(server, content, beam_size=0), "beam_size must be between 1 and 10"),
        (post(server, content, beam_size="wide"), "beam_size: "),
        (httpx.post(f"{server}/api/caption", data={"beam_size": 3}), "no image: send the file in the form field"),
    ]
    for response, message in cases:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert message in error and "\n" not in error, error
    assert httpx.get(f"{server}/healthz").status_code == 200
    assert post(server, content).json()["caption"] == images[0][1].text


def test_twenty_requests_from_four_clients_are_each_answered_right(server, images):
    jobs = [images[i % len(images)] for i in range(20)]
    with ThreadPoolExecutor(4) as clients:
        responses = list(clients.map(lambda job: post(server, job[0], beam_size=3), jobs))
    for response, (_, expected) in zip(responses, jobs, strict=True):
        assert response.status_code == 200, response.text
        assert response.json()["tokens"] == expected.tokens
        assert response.json()["score"] == pytest.approx(expected.score, abs=1e-3)


def test_examples_are_served(server):
    names = httpx.get(f"{server}/api/examples").json()
    assert len(names) == 4
    for name in names:
        response = httpx.get(f"{server}/examples/{name}")
        assert response.status_code == 200 and response.content.startswith(b"\x89PNG")
    assert httpx.get(f"{server}/examples/missing.png").status_code == 404


def test_bad_options_are_one_line_errors(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--max-upload-mb", "0"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == "error: --max-upload-mb and --max-batch must be positive"


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine (Debian: apt-get install chromium)")
def test_the_page_in_a_browser(server, images, tmp_path):
    from playwright.sync_api import sync_playwright

    content, expected = images[1]
    (tmp_path / "shapes.png").write_bytes(content)
    (tmp_path / "notes.txt").write_text("not a picture\n")
    flags = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=flags)
        page = browser.new_page(viewport={"width": 1000, "height": 820})
        page.goto(server)
        page.set_input_files("#file", str(tmp_path / "shapes.png"))
        page.wait_for_function("document.getElementById('caption').textContent.length > 0")
        assert page.text_content("#caption") == expected.text
        words = page.locator("#strip figure")
        assert words.count() == len(expected.tokens)
        assert [words.nth(i).text_content() for i in range(words.count())] == expected.tokens
        last = len(expected.tokens) - 1
        words.nth(last).click()
        assert page.text_content("#big-word") == expected.tokens[last]
        assert "selected" in words.nth(last).get_attribute("class")
        words.nth(0).hover()
        assert page.text_content("#big-word") == expected.tokens[0]
        if os.environ.get("CAPTIONER_SCREENSHOT"):  # how docs/images/serve.png is made
            page.mouse.move(0, 0)
            page.screenshot(path=os.environ["CAPTIONER_SCREENSHOT"], full_page=True)

        page.set_input_files("#file", str(tmp_path / "notes.txt"))
        page.wait_for_function("document.getElementById('error').textContent.length > 0")
        assert page.text_content("#error") == "notes.txt: not an image file PIL can read"
        assert words.count() == 0 and page.text_content("#caption") == ""

        page.locator("#examples img").first.click()  # a bundled example
        page.wait_for_function("document.getElementById('caption').textContent.length > 0")
        assert page.text_content("#error") == "" and words.count() >= 1

        for gesture in (DROP, PASTE):  # the image dropped on the page, then pasted into it
            page.set_input_files("#file", str(tmp_path / "notes.txt"))  # clears the caption
            page.wait_for_function("document.getElementById('caption').textContent === ''")
            page.evaluate(gesture, list(content))
            page.wait_for_function("document.getElementById('caption').textContent.length > 0")
            assert page.text_content("#caption") == expected.text and words.count() == len(expected.tokens)
        browser.close()


# A file made in the page from bytes, dropped on the drop zone or pasted, as a user's drag or Ctrl+V delivers it
DROP = """(bytes) => {
  const files = new DataTransfer();
  files.items.add(new File([new Uint8Array(bytes)], "dropped.png", {type: "image/png"}));
  const drop = new DragEvent("drop", {dataTransfer: files, bubbles: true, cancelable: true});
  document.getElementById("drop").dispatchEvent(drop);
}"""
PASTE = """(bytes) => {
  const files = new DataTransfer();
  files.items.add(new File([new Uint8Array(bytes)], "pasted.png", {type: "image/png"}));
  document.dispatchEvent(new ClipboardEvent("paste", {clipboardData: files, bubbles: true}));
}"""
