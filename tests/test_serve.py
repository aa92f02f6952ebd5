"""`captioner serve`, run as users run it (the command, on a local port): the JSON API, bad uploads, concurrent
clients, and the page in a real browser (Debian's Chromium driven by Playwright)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from captioner import serve
from captioner.api import Captioner
from captioner.cli import main
from captioner.data.shapes import ShapesDataset
from captioner.serve import BoundedBodies
from tests.conftest import REPO
from tests.images import png_claiming

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


TIMEOUT = 2  # the server's --timeout: seconds a stalled client keeps its connection


@pytest.fixture(scope="module")
def server():
    """`captioner serve` with the bundled model, a 1 MB upload limit, a 1 megapixel image limit, a 2 s timeout and 8
    connections at most; yields its base URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    limits = ["--max-upload-mb", "1", "--max-pixels", "1e6", "--timeout", str(TIMEOUT), "--max-connections", "8"]
    command = [sys.executable, "-m", "captioner.cli", "serve", "--port", str(port), *limits]
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


def multipart(*parts: tuple[str, str | None, bytes]) -> tuple[bytes, dict]:
    """A multipart/form-data body of (field, file name or None for a text field, content) parts, and its header."""
    body = b""
    for field, filename, content in parts:
        disposition = f'form-data; name="{field}"' + (f'; filename="{filename}"' if filename else "")
        body += f"--xyz\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + content + b"\r\n"
    return body + b"--xyz--\r\n", {"content-type": "multipart/form-data; boundary=xyz"}


FILE_PART = b'--xyz\r\nContent-Disposition: form-data; name="image"; filename="big.png"\r\n\r\n'  # then content


def chunks(total: int, size: int = 2**16):
    """A body of `total` bytes sent in chunks, with no Content-Length (Transfer-Encoding: chunked)."""
    for _ in range(total // size):
        yield b"\0" * size


def test_bad_uploads_get_a_one_line_error_and_the_server_stays_up(server, images):
    content = images[0][0]
    two_images, form = multipart(("image", "a.png", content), ("image", "b.png", content))
    text_image, _ = multipart(("image", None, b"not a file"))
    cases = [
        (post(server, b"my shopping list\n" * 10, "notes.txt"), 400, "notes.txt: not an image file PIL can read"),
        (post(server, content[: len(content) // 2], "cut.png"), 400, "cut.png: cannot decode image"),
        (post(server, png_claiming(100_000, 100_000), "bomb.png"), 400, "bomb.png: refused as a possible decompress"),
        (post(server, png_claiming(1500, 1000), "big.png"), 400, "big.png: 1500x1000 pixels is over the 1 Mpx limit"),
        (post(server, os.urandom(1_200_000), "huge.jpg"), 413, "the upload is 1.1 MB, over the 1 MB limit"),
        (post(server, content, beam_size=0), 400, "beam_size must be between 1 and 10"),
        (post(server, content, beam_size="wide"), 400, "beam_size: not a whole number ('wide')"),
        (httpx.post(f"{server}/api/caption", data={"beam_size": 3}), 400, "no image: send the file in the form field"),
        (httpx.post(f"{server}/api/caption", content=two_images, headers=form), 400, "send one 'image' field"),
        (httpx.post(f"{server}/api/caption", content=text_image, headers=form), 400, "image: a text field, not a file"),
        (httpx.post(f"{server}/api/caption", content=b"garbage", headers=form), 400, "not valid multipart"),
        (httpx.get(f"{server}/api/caption"), 405, "GET /api/caption: Method Not Allowed"),
        (httpx.get(f"{server}/openapi.json"), 404, "GET /openapi.json: Not Found"),
        (httpx.get(f"{server}/docs"), 404, "GET /docs: Not Found"),
    ]
    for response, status, message in cases:
        assert response.status_code == status, response.text
        assert response.json() == {"error": response.json()["error"]}
        error = response.json()["error"]
        assert message in error and "\n" not in error, error
    assert httpx.head(f"{server}/healthz").status_code == 200 == httpx.head(f"{server}/").status_code
    assert httpx.get(f"{server}/healthz").status_code == 200
    assert post(server, content).json()["caption"] == images[0][1].text


@pytest.mark.parametrize("kind", ["multipart/form-data; boundary=xyz", "image/png"])
def test_an_oversize_body_without_a_length_is_cut_off_at_the_limit(server, kind):
    """A chunked body has no Content-Length to refuse it by. A form is read up to the limit, then answered 413; a body
    that is not a form is not read at all (400). Either way the connection is closed: the client sees the answer, or
    the connection cut while it is still sending."""
    sent = 0

    def body():
        nonlocal sent
        if kind.startswith("multipart"):  # one file part, whose content never ends
            yield FILE_PART
        for chunk in chunks(64 * 2**20):
            sent += len(chunk)
            yield chunk

    status, message = (413, "over the 1 MB limit") if kind.startswith("multipart") else (400, "no image")
    try:
        response = httpx.post(f"{server}/api/caption", content=body(), headers={"content-type": kind})
        assert response.status_code == status and message in response.json()["error"]
    except httpx.TransportError:
        pass
    assert sent < 8 * 2**20  # not the 64 MB: the server stopped reading


def test_stalled_clients_are_cut_off_after_the_timeout(server):
    host, port = server.removeprefix("http://").split(":")
    head = f"POST /api/caption HTTP/1.1\r\nHost: {host}\r\nContent-Type: multipart/form-data; boundary=xyz\r\n"
    stalls = {
        "half a head": head.encode(),
        "half a body": (head + "Content-Length: 100000\r\n\r\n").encode() + FILE_PART + b"\0" * 1000,
        "nothing at all": b"",
    }
    clients = {what: socket.create_connection((host, int(port))) for what in stalls}  # all at once: one wait
    start = time.monotonic()
    for what, client in clients.items():
        client.sendall(stalls[what])
    for what, client in clients.items():
        with client:
            client.settimeout(TIMEOUT + 10)
            answer = b""
            while chunk := client.recv(4096):  # until the server closes the connection
                answer += chunk
            assert time.monotonic() - start < TIMEOUT + 5, what
        if what == "half a body":
            assert answer.startswith(b"HTTP/1.1 408") and b"no part of the upload arrived for 2 s" in answer, answer
        else:
            assert answer == b"", (what, answer)
    assert time.monotonic() - start > TIMEOUT - 0.5  # they were held until the timeout, no sooner


def test_an_upload_longer_than_the_head_deadline_is_answered_sent_directly_or_through_a_proxy(server, images):
    """The head arrives at once, the body in four parts 0.9 s apart: each part within the body's timeout, the whole
    past the head deadline. A reverse proxy on this machine says whom it forwards for (X-Forwarded-For), which uvicorn
    trusts from 127.0.0.1 and puts in the ASGI scope: such a connection is answered too, not closed at the head
    deadline."""
    host, port = server.removeprefix("http://").split(":")
    content, expected = images[0]
    body = FILE_PART + content + b"\r\n--xyz--\r\n"
    parts = [body[i * len(body) // 4 : (i + 1) * len(body) // 4] for i in range(4)]
    head = (
        f"POST /api/caption HTTP/1.1\r\nHost: {host}\r\nContent-Type: multipart/form-data; boundary=xyz\r\n"
        f"Content-Length: {len(body)}\r\n"
    )
    forwarded = {"direct": "", "proxied": "X-Forwarded-For: 203.0.113.7\r\nX-Forwarded-Proto: http\r\n"}
    clients = {how: socket.create_connection((host, int(port))) for how in forwarded}  # side by side: one wait
    start = time.monotonic()
    for how, client in clients.items():
        client.sendall(f"{head}{forwarded[how]}\r\n".encode())
    for i, part in enumerate(parts):
        time.sleep(0.9 if i else 0)
        for client in clients.values():
            client.sendall(part)
    assert time.monotonic() - start > TIMEOUT  # the upload outlasted the head deadline
    for how, client in clients.items():
        with client:
            client.settimeout(60)
            answer = b""
            while chunk := client.recv(4096):  # until the server closes the connection
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 200"), (how, answer[:300])
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["caption"] == expected.text, how


def test_a_connection_over_the_limit_gets_a_503_and_the_next_one_after_them_is_served(server, images):
    host, port = server.removeprefix("http://").split(":")
    idle = [socket.create_connection((host, int(port))) for _ in range(8)]  # held open until the head deadline
    try:
        time.sleep(0.2)  # the server has accepted them
        assert post(server, images[0][0]).status_code == 503
    finally:
        for connection in idle:
            connection.close()
    time.sleep(0.2)
    response = post(server, images[0][0])
    assert response.status_code == 200 and response.headers["connection"] == "close"  # one request per connection


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
    error = "--max-upload-mb, --max-batch, --max-pixels, --timeout, --max-connections must be positive"
    assert capsys.readouterr().err.strip() == f"error: {error}"


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

        wide = tmp_path / "wide.png"  # a 2:1 picture: its overlays are 2:1 too, not squashed to squares
        ShapesDataset("test", 1, seed=1).load_image(0).resize((448, 224)).save(wide)
        page.set_input_files("#file", str(tmp_path / "notes.txt"))  # clears the caption
        page.wait_for_function("document.getElementById('caption').textContent === ''")
        page.set_input_files("#file", str(wide))
        page.wait_for_function("document.getElementById('caption').textContent.length > 0")
        sizes = page.evaluate("[...document.querySelectorAll('#big, #strip canvas')].map(c => [c.width, c.height])")
        assert sizes[0] == [672, 336] and all(size == [224, 112] for size in sizes[1:]), sizes
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


def drive(middleware: BoundedBodies, messages: list[dict]) -> tuple[list[dict], list[dict]]:
    """Run `middleware` around an app that reads the request body to its end (or the client's leaving) and answers
    200, on `messages` as the client sends them (then none: a stall); what the app received, and what was sent."""
    received, sent = [], []

    async def app(scope, receive, send):
        while True:
            message = await receive()
            received.append(message)
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def receive():
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    middleware.app = app
    scope = {"type": "http", "headers": [], "client": ("127.0.0.1", 5000)}
    asyncio.run(middleware(scope, receive, send))
    return received, sent


def test_a_client_that_leaves_before_a_body_part_is_said_to_have_left():
    """Not handed on as a complete (empty) body, which the app would parse as the whole upload."""
    first = {"type": "http.request", "body": b"x" * 10, "more_body": True}
    received, _ = drive(BoundedBodies(None, 1, 5), [first, {"type": "http.disconnect"}])
    assert received[-1] == {"type": "http.disconnect"}


def test_a_stalled_body_is_a_408_whatever_class_asyncio_times_out_with(monkeypatch):
    """Before Python 3.11, asyncio.wait_for raises asyncio.TimeoutError, which is not the builtin TimeoutError."""

    class PythonTenTimeout(Exception):
        pass

    async def wait_for(awaitable, timeout):
        awaitable.close()
        raise PythonTenTimeout

    monkeypatch.setattr(serve.asyncio, "TimeoutError", PythonTenTimeout)
    monkeypatch.setattr(serve.asyncio, "wait_for", wait_for)
    _, sent = drive(BoundedBodies(None, 1, 0.1), [])
    assert sent[0]["status"] == 408 and (b"connection", b"close") in sent[0]["headers"]
    assert b"no part of the upload arrived for 0.1 s" in sent[1]["body"]


def test_a_closed_connection_s_protocol_is_not_held_by_its_head_deadline():
    """The head deadline's timer ends with its connection: nothing holds a closed connection's protocol until the
    deadline would have come (before, the loop's timer kept each one for `timeout` seconds)."""
    import gc
    import weakref

    import uvicorn
    from uvicorn.server import ServerState

    class Transport(asyncio.Transport):
        def __init__(self):
            super().__init__()
            self.closed = False

        def get_extra_info(self, name, default=None):
            return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

        def is_closing(self):
            return self.closed

        def close(self):
            self.closed = True

    async def connect_and_close() -> weakref.ref:
        config = uvicorn.Config(lambda scope, receive, send: None, log_level="error")
        config.load()
        protocol = serve.HeadDeadline(config, ServerState(), {}, _loop=asyncio.get_running_loop())
        protocol.connection_made(Transport())
        protocol.connection_lost(None)
        return weakref.ref(protocol)

    loop = asyncio.new_event_loop()
    try:
        protocol = loop.run_until_complete(connect_and_close())
        gc.collect()
        assert protocol() is None
    finally:
        loop.close()


def test_the_page_s_examples_are_the_photos_a_model_s_card_names_else_shapes():
    """A model whose card names example photos (the bundled `ucm`: UCM test photos in docs/images/ucm/) shows them;
    another, or one whose photos are not there (an installed wheel has no docs/), shows held-out shapes images."""
    from captioner.page import example_images

    photos = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs" / "images" / "ucm").glob("*.jpg"))
    named = example_images({"examples": photos})
    assert list(named) == [p.rsplit("/", 1)[1] for p in photos] and all(b[:2] == b"\xff\xd8" for b in named.values())
    for card in ({}, {"examples": ["docs/images/ucm/missing.jpg"]}):
        assert all(name.startswith("shapes_") for name in example_images(card))
