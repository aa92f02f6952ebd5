"""`captioner serve`: a page that captions an image and shows where the model looked for each word, and its JSON API.

    captioner serve --checkpoint shapes --port 7860
    curl -F image=@cat.jpg -F beam_size=3 http://127.0.0.1:7860/api/caption

The stack is FastAPI serving one static page (`captioner/static/index.html`, plain JavaScript), not Gradio: the
per-word overlay (hover a word, see its map over the image on the scale shared by all words) would be a custom
component in Gradio too, and this way the page loads nothing from the internet and the install stays small.

There is no authentication: anyone who can reach the port can use the model. It binds to 127.0.0.1 unless --host
says otherwise.
"""

from __future__ import annotations

import asyncio
import io
import queue
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Annotated

from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from PIL import Image

from captioner.api import Captioner, CaptionResult
from captioner.data.images import ImageError, load_image
from captioner.data.shapes import ShapesDataset

STATIC = Path(__file__).parent / "static"
MAX_BEAM_SIZE = 10


class Batcher:
    """Runs every caption on one thread: the requests waiting when it is free (up to `max_batch`, grouped by beam
    size) go through the model as one batched search. The model is never used by two threads at once, and concurrent
    requests share its work."""

    def __init__(self, captioner: Captioner, max_batch: int = 8, max_len: int = 30):
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


def answer(result: CaptionResult) -> dict:
    """The JSON of one caption: one attention row of h*w weights per token (<end> excluded)."""
    return {
        "caption": result.text,
        "tokens": result.tokens,
        "score": round(result.score, 4),
        "grid": list(result.grid_hw),
        "alphas": [[round(a, 5) for a in row] for row in result.alphas.tolist()],
    }


def example_images(count: int = 4) -> dict[str, bytes]:
    """A few held-out shapes images (the bundled model's test split), as PNG files for the page's examples."""
    split = ShapesDataset("test", count)
    examples = {}
    for index in range(count):
        buffer = io.BytesIO()
        split.load_image(index).save(buffer, format="PNG")
        examples[f"shapes_{index}.png"] = buffer.getvalue()
    return examples


def create_app(captioner: Captioner, max_upload_mb: float = 20, max_batch: int = 8) -> FastAPI:
    """The FastAPI app: `GET /` (the page), `POST /api/caption`, `GET /healthz`, `GET /api/examples` and
    `GET /examples/<name>` (the page's example images)."""
    limit = int(max_upload_mb * 2**20)
    batcher = Batcher(captioner, max_batch)
    examples = example_images()
    app = FastAPI(title="captioner", docs_url=None, redoc_url=None)  # their pages load scripts from a CDN

    def error(message: str) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=400)

    @app.exception_handler(RequestValidationError)
    async def invalid_form(request: Request, err: RequestValidationError) -> JSONResponse:
        problem = err.errors()[0]
        return error(f"{problem['loc'][-1]}: {problem['msg']}")

    @app.middleware("http")
    async def refuse_large_bodies(request: Request, call_next):
        # Before the form is parsed: a body far over the limit is not read at all. (A body without a length is
        # spooled to disk by the form parser and measured below.)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit + 2**16:
            return error(f"the upload is {int(declared) / 2**20:.1f} MB, over the {max_upload_mb:g} MB limit")
        return await call_next(request)

    @app.get("/", include_in_schema=False)
    def page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok", "grid": list(captioner.model.encoder.grid_hw), "vocab_size": len(captioner.vocab)}

    @app.get("/api/examples")
    def example_names() -> list[str]:
        return list(examples)

    @app.get("/examples/{name}")
    def example(name: str) -> Response:
        if name not in examples:
            return JSONResponse({"error": f"{name}: no such example"}, status_code=404)
        return Response(examples[name], media_type="image/png")

    @app.post("/api/caption")
    async def caption(
        image: Annotated[UploadFile | None, File()] = None, beam_size: Annotated[int, Form()] = 3
    ) -> JSONResponse:
        if image is None:
            return error("no image: send the file in the form field 'image'")
        name = image.filename or "upload"
        if not 1 <= beam_size <= MAX_BEAM_SIZE:
            return error(f"beam_size must be between 1 and {MAX_BEAM_SIZE}, got {beam_size}")
        if image.size is not None and image.size > limit:
            return error(f"{name}: {image.size / 2**20:.1f} MB is over the {max_upload_mb:g} MB limit")
        try:
            picture = await run_in_threadpool(load_image, image.file, name)
        except ImageError as err:
            return error(str(err))
        result = await asyncio.wrap_future(batcher.submit(picture, beam_size))
        return JSONResponse(answer(result))

    return app


def serve(checkpoint: str, host: str, port: int, max_upload_mb: float, max_batch: int) -> None:
    import uvicorn

    captioner = Captioner.load(checkpoint)
    app = create_app(captioner, max_upload_mb, max_batch)
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: listening on {host}: the server has no authentication, anyone who can reach it can use it")
    print(f"captioner serve: {checkpoint} at http://{host}:{port}/ (Ctrl+C stops)", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="info")
