"""`captioner serve`: a page that captions an image and shows where the model looked for each word, and its JSON API.

    captioner serve --ckpt_path shapes --port 7860
    curl -F image=@cat.jpg -F beam_size=3 http://127.0.0.1:7860/api/caption

The stack is FastAPI serving one static page (`captioner/static/index.html`, plain JavaScript), not Gradio: the
per-word overlay (hover a word, see its map over the image on the scale shared by all words) would be a custom
component in Gradio too, and this way the page loads nothing from the internet and the install stays small.

There is no authentication: anyone who can reach the port can use the model. It binds to 127.0.0.1 unless --host
says otherwise.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from PIL import Image
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from captioner.api import Captioner, CaptionResult
from captioner.data.images import ImageError, load_image
from captioner.page import STATIC, example_images

if TYPE_CHECKING:
    from captioner import onnx

MAX_BEAM_SIZE = 10
MULTIPART_SLACK = 2**16  # bytes of form fields and part headers allowed beside an image of the largest size
MERGED = 2**20  # bytes of a request body handed on at a time
CLOSE = (b"connection", b"close")


class BodyRefused(Exception):
    """Raised from `receive` by `BoundedBodies` when a request body is too large or stalls."""


class BoundedBodies:
    """ASGI middleware that reads a request body as it streams in, and stops reading it past `max_upload_mb` (plus
    room for the form's other fields) or when no part of it arrives for `timeout` seconds: the request is then
    answered 413 or 408 with a one-line JSON error, and the connection is closed. So a body without a Content-Length,
    or one that stalls, costs at most the limit's bytes and `timeout` seconds; a declared Content-Length over the
    limit is refused before anything is read."""

    def __init__(self, app, max_upload_mb: float, timeout: float):
        self.app, self.timeout = app, timeout
        self.limit = int(max_upload_mb * 2**20) + MULTIPART_SLACK
        self.over = f"over the {max_upload_mb:g} MB limit"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"").decode("latin-1")
        if declared.isdigit() and int(declared) > self.limit:
            return await refuse(send, 413, f"the upload is {int(declared) / 2**20:.1f} MB, {self.over}")
        received, refusal, started, complete = 0, None, False, False

        async def receive_part() -> dict:
            nonlocal received, refusal, complete
            try:
                message = await asyncio.wait_for(receive(), self.timeout)
            except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                refusal = (408, f"no part of the upload arrived for {self.timeout:g} s")
                raise BodyRefused from None
            received += len(message.get("body", b""))
            if received > self.limit:
                refusal = (413, f"the upload is {self.over}")
                raise BodyRefused
            complete = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def bounded_receive() -> dict:
            if complete:  # after the body, a wait for the client's disconnect: no deadline
                return await receive()
            message = await receive_part()
            if message["type"] != "http.request":  # the client left: said as it is, not as the body's end
                return message
            # The parts of a body that have arrived, given as one, up to MERGED bytes: the form parser writes a spooled
            # upload to disk through a thread once per part, and the server's part is 64 KiB at most.
            parts = [message.get("body", b"")]
            while not complete and sum(map(len, parts)) < MERGED:
                message = await receive_part()
                if message["type"] != "http.request":
                    return message
                parts.append(message.get("body", b""))
            return {"type": "http.request", "body": b"".join(parts), "more_body": not complete}

        async def guarded_send(message: dict) -> None:
            nonlocal started
            if refusal is None:  # once refused, the app's own answer (a parse error, say) is not sent
                started = True
                headers = message.get("headers", [])
                if message["type"] == "http.response.start" and all(k.lower() != CLOSE[0] for k, _ in headers):
                    message = {**message, "headers": [*headers, CLOSE]}  # one request per connection (`HeadDeadline`)
                await send(message)

        try:
            await self.app(scope, bounded_receive, guarded_send)
        except BodyRefused:
            if not started:
                await refuse(send, *refusal)
        except ClientDisconnect:  # the client left mid-body: there is no one to answer
            pass


async def refuse(send, status: int, message: str) -> None:
    """Answer a request with `{"error": message}` and close the connection (its body is not read further)."""
    body = json.dumps({"error": message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": [*headers, CLOSE]})
    await send({"type": "http.response.body", "body": body})


class HeadDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection whose request head has not arrived `timeout` seconds after it
    opened. No uvicorn setting does this: its keep-alive timer starts after a response, and the first byte of the next
    request stops it, so a client that sends half a head, or nothing, would hold its connection for ever.

    It overrides asyncio.Protocol's `connection_made` and `connection_lost` and uses only the transport's documented
    methods; the deadline's timer ends with its connection, so that nothing holds a closed connection's protocol (and
    its request's state) until the deadline would have come. Whether
    the head arrived is this connection's own state: uvicorn starts its request's cycle (`cycle`) when it has parsed
    the head. (Not the ASGI scope's client address: behind a reverse proxy, uvicorn puts the forwarded address there.)
    Every response closes its connection (`Connection: close`), so a connection carries one request and one head.
    The number of connections is uvicorn's own setting (`limit_concurrency`). Tested with the uvicorn versions
    pyproject.toml allows.
    """

    timeout = 30.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)

        def expire() -> None:
            if self.cycle is None and not transport.is_closing():  # no request head yet
                transport.close()

        self.deadline = asyncio.get_running_loop().call_later(self.timeout, expire)

    def connection_lost(self, exc: Exception | None) -> None:
        self.deadline.cancel()
        super().connection_lost(exc)


class Batcher:
    """Runs every caption on one thread: the requests waiting when it is free (up to `max_batch`, grouped by beam
    size) go through the model as one batched search. The model is never used by two threads at once, and concurrent
    requests share its work."""

    def __init__(self, captioner: Captioner | onnx.Captioner, max_batch: int = 8, max_len: int = 30):
        self.captioner, self.max_batch, self.max_len = captioner, max_batch, max_len
        self.requests: queue.Queue[tuple[Image.Image, int, Future]] = queue.Queue()
        threading.Thread(target=self._serve, name="captioner-batcher", daemon=True).start()

    def submit(self, image: Image.Image, beam_size: int) -> Future:
        future: Future = Future()
        self.requests.put((image, beam_size, future))
        return future

    def _serve(self) -> None:
        while True:
            waiting = [self.requests.get()]
            while len(waiting) < self.max_batch and not self.requests.empty():
                waiting.append(self.requests.get())
            for beam_size in {beam for _, beam, _ in waiting}:
                group = [(image, future) for image, beam, future in waiting if beam == beam_size]
                try:
                    results = self.captioner.caption(
                        [image for image, _ in group], beam_size, batch_size=len(group), max_len=self.max_len
                    )
                except Exception as err:  # reported to each waiting request; the thread serves on
                    for _, future in group:
                        future.set_exception(err)
                    continue
                for (_, future), result in zip(group, results, strict=True):
                    future.set_result(result)


def answer(result: CaptionResult | onnx.CaptionResult) -> dict:
    """The JSON of one caption: one attention row of h*w weights per token (<end> excluded)."""
    return {
        "caption": result.text,
        "tokens": result.tokens,
        "score": round(result.score, 4),
        "grid": list(result.grid_hw),
        "alphas": [[round(a, 5) for a in row] for row in result.alphas.tolist()],
    }


def create_app(
    captioner: Captioner | onnx.Captioner,
    max_upload_mb: float = 20,
    max_batch: int = 8,
    max_pixels: int = 25_000_000,
    timeout: float = 30,
) -> FastAPI:
    """The FastAPI app: `GET /` (the page; its scripts, /page.js and /source.js), `POST /api/caption`, `GET /healthz`,
    `GET /api/examples` and `GET /examples/<name>` (the page's example images); `HEAD` wherever `GET` works.

    Bounded against hostile clients: a body is read up to `max_upload_mb` (`BoundedBodies`), an image of more than
    `max_pixels` is refused from its header, big images are decoded reduced to twice the model's input size, and at
    most `max_batch` decoded images are held at once (the others wait, not decoded)."""
    batcher = Batcher(captioner, max_batch)
    decoding = asyncio.Semaphore(max_batch)  # decoded images in memory: from decoding until captioned
    reduce_to = 2 * captioner.image_size
    examples = example_images(captioner.card)
    # No /docs, /redoc or /openapi.json: their pages load scripts from a CDN, and the API is the one route below.
    app = FastAPI(title="captioner", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BoundedBodies, max_upload_mb=max_upload_mb, timeout=timeout)

    def error(message: str, status: int = 400) -> JSONResponse:
        # The connection is closed after an error: what is left of the body, if any, is not read.
        return JSONResponse({"error": message}, status_code=status, headers={"connection": "close"})

    @app.exception_handler(HTTPException)  # 404, 405 and the like: the same one-line JSON as every other error
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        return error(f"{request.method} {request.url.path}: {err.detail}", err.status_code)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, err: RequestValidationError) -> JSONResponse:
        return error(f"{request.method} {request.url.path}: invalid request")

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    def page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @app.api_route("/{name}.js", methods=["GET", "HEAD"], include_in_schema=False)
    def script(name: str) -> Response:
        # the page's scripts: its own, and where its captions come from (this server's API; an export for the web
        # has the browser's captioner there instead)
        files = {"page": "page.js", "source": "server.js"}
        if name not in files:
            return error(f"/{name}.js: not found", 404)
        return FileResponse(STATIC / files[name], media_type="text/javascript")

    @app.api_route("/healthz", methods=["GET", "HEAD"])
    def healthz() -> dict:
        return {"status": "ok", "grid": list(captioner.grid_hw), "vocab_size": len(captioner.vocab)}

    @app.api_route("/api/examples", methods=["GET", "HEAD"])
    def example_names() -> list[str]:
        return list(examples)

    @app.api_route("/examples/{name}", methods=["GET", "HEAD"])
    def example(name: str) -> Response:
        if name not in examples:
            return error(f"{name}: no such example", 404)
        media = "image/jpeg" if name.lower().endswith((".jpg", ".jpeg")) else "image/png"
        return Response(examples[name], media_type=media)

    @app.post("/api/caption")
    async def caption(request: Request) -> JSONResponse:
        try:
            form = await request.form(max_files=4, max_fields=16)
        except HTTPException:  # python-multipart could not parse the body; its own words are not for the client
            return error("the body is not valid multipart/form-data: send the file in the form field 'image'")
        try:
            images, beams = form.getlist("image"), form.getlist("beam_size")
            if not images:
                return error("no image: send the file in the form field 'image'")
            if len(images) > 1 or len(beams) > 1:
                return error("send one 'image' field and at most one 'beam_size' field per request")
            image = images[0]
            if not isinstance(image, UploadFile):
                return error("image: a text field, not a file: send the file in the form field 'image'")
            beam = beams[0] if beams else "3"
            if not isinstance(beam, str) or not beam.strip().isdigit():
                return error(f"beam_size: not a whole number ({str(beam)[:20]!r})")
            beam_size = int(beam)
            if not 1 <= beam_size <= MAX_BEAM_SIZE:
                return error(f"beam_size must be between 1 and {MAX_BEAM_SIZE}, got {beam_size}")
            name = " ".join((image.filename or "upload").split())[:200]  # the client's words: one line, bounded
            if image.size is not None and image.size > max_upload_mb * 2**20:
                return error(f"{name}: {image.size / 2**20:.1f} MB is over the {max_upload_mb:g} MB limit", 413)
            async with decoding:
                try:
                    picture = await run_in_threadpool(load_image, image.file, name, max_pixels, reduce_to)
                except ImageError as err:
                    return error(str(err))
                result = await asyncio.wrap_future(batcher.submit(picture, beam_size))
                return JSONResponse(answer(result))
        finally:
            await form.close()  # the spooled upload's memory or temporary file goes now

    return app


def serve(
    captioner: Captioner | onnx.Captioner,
    name: str,
    host: str,
    port: int,
    max_upload_mb: float,
    max_batch: int,
    max_pixels: int,
    timeout: float,
    max_connections: int,
) -> None:
    import uvicorn

    app = create_app(captioner, max_upload_mb, max_batch, max_pixels, timeout)
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: listening on {host}: the server has no authentication, anyone who can reach it can use it")
    print(f"captioner serve: {name} at http://{host}:{port}/ (Ctrl+C stops)", flush=True)
    protocol = type("HeadDeadline", (HeadDeadline,), {"timeout": timeout})
    # A connection opened while `max_connections` others are open gets uvicorn's 503.
    uvicorn.run(app, host=host, port=port, log_level="info", http=protocol, limit_concurrency=max_connections + 1)
