"""`captioner export --format web`: a folder that any static host serves as it is (GitHub Pages, a lab's web folder,
`python -m http.server`), whose page captions images in the visitor's browser with ONNX Runtime Web: no server
behind it, and no photo leaves the machine.

The folder is an ONNX export (`captioner.onnx_export`: the graphs, weights.bin, captioner.json; `captioner.onnx`
loads it too), its weights stored as float16 unless asked otherwise (half the download; docs/benchmarks.md measures
the words), beside the page that `captioner serve` serves (captioner/static: index.html and page.js, the same files)
with, as its source of captions, the browser's captioner (static/web/source.js and the host loop static/web/search.js)
instead of the server's API; site.json says where ONNX Runtime Web comes from and lists the example images
(examples/).

ONNX Runtime Web (npm `onnxruntime-web`, MIT), its WebAssembly build with SIMD: by default the page loads the pinned
version `ORT_WEB` from a public CDN (jsDelivr, which serves npm's files as they are), each file checked against its
hash (`ORT_FILES`: subresource integrity); with `ort_dist`, a local `onnxruntime-web/dist` (npm's) is copied into
ort/, for a host without internet, and checked against the hashes of the files copied. Nothing is fetched at export
time. It runs on threads where the page is cross-origin isolated (served with `Cross-Origin-Opener-Policy:
same-origin` and `Cross-Origin-Embedder-Policy: require-corp`), on one otherwise; the page says which.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import http.server
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from captioner.errors import ConfigError
from captioner.files import replace_atomically, write_text_atomically
from captioner.onnx.layout import CONFIG, GRAPHS, WEIGHTS
from captioner.page import STATIC, example_images

ORT_WEB = "1.31.1"  # the ONNX Runtime Web the page loads from the CDN
CDN = f"https://cdn.jsdelivr.net/npm/onnxruntime-web@{ORT_WEB}/dist/"
# npm's files at ORT_WEB that the page loads: the module (ONNX Runtime's JavaScript and the WebAssembly's glue in one
# file) and the WebAssembly (SIMD, threads where allowed), with their sha384 (subresource integrity)
ORT_FILES = {
    "module": ("ort.wasm.bundle.min.mjs", "sha384-6BIdAwCg9wGA2hDYLN3zCVAyr+OTK4s2qFUOqXyyOMHOmbTE+W9CyVIpApOKhHN8"),
    "wasm": ("ort-wasm-simd-threaded.wasm", "sha384-bQJgW/bZhNOlc9KU45Zu0dyd0EFfNpkOZjfHyH/90dkZQSBBGkFTsAJaabSyYA4Z"),
}
PAGE = {"index.html": "index.html", "page.js": "page.js", "source.js": "web/source.js", "search.js": "web/search.js"}
MARKER = "<!-- where captions come from"  # index.html's line before which the export puts its import map


def integrity(path: Path) -> str:
    """A file's subresource-integrity hash (sha384)."""
    return "sha384-" + base64.b64encode(hashlib.sha384(path.read_bytes()).digest()).decode()


def ort_files(output: Path, ort_dist: str | Path | None) -> dict:
    """Where the page loads ONNX Runtime Web's module and WebAssembly from, and their hashes: the CDN's pinned files,
    or copies of `ort_dist`'s in output/ort/; and its version."""
    if ort_dist is None:
        files = {kind: {"url": CDN + name, "integrity": digest} for kind, (name, digest) in ORT_FILES.items()}
        return {**files, "version": ORT_WEB}
    dist = Path(ort_dist)
    missing = [name for name, _ in ORT_FILES.values() if not (dist / name).is_file()]
    if missing:
        raise ConfigError(
            f"--ort-dist {dist}: no {', '.join(missing)} there (npm install onnxruntime-web@{ORT_WEB}, then give its "
            "node_modules/onnxruntime-web/dist)"
        )
    (output / "ort").mkdir(exist_ok=True)
    files = {}
    for kind, (name, _) in ORT_FILES.items():
        copy = output / "ort" / name
        replace_atomically(copy, lambda out, name=name: out.write((dist / name).read_bytes()))
        files[kind] = {"url": f"./ort/{name}", "integrity": integrity(copy)}
    try:
        version = json.loads((dist.parent / "package.json").read_text(encoding="utf-8"))["version"]
    except (OSError, ValueError, KeyError):
        version = "from " + str(dist)
    return {**files, "version": version}


def export_web(
    checkpoint: str | Path,
    output: str | Path,
    name: str | None = None,
    ort_dist: str | Path | None = None,
    float16: bool = True,
    int8: str | None = None,
) -> Path:
    """Write `checkpoint`'s model (a fit checkpoint, an exported file or a bundled model's name) and the page to the
    folder `output` (the module's docstring); `float16` and `int8` as `captioner.onnx_export.export_onnx` takes them.
    Returns the folder."""
    from captioner.checkpoints import model_file, resolve
    from captioner.onnx_export import export_onnx, require_onnx

    require_onnx()
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    (output / CONFIG).unlink(missing_ok=True)  # written last, by export_onnx: a kill leaves no folder that loads
    ort = ort_files(output, ort_dist)
    page = (STATIC / "index.html").read_text(encoding="utf-8")
    imports = {"imports": {"onnxruntime-web": ort["module"]["url"]},
               "integrity": {ort["module"]["url"]: ort["module"]["integrity"]}}  # fmt: skip
    tag = f'<script type="importmap">{json.dumps(imports)}</script>\n'
    if MARKER not in page:
        raise AssertionError(f"{STATIC / 'index.html'}: no line {MARKER!r} to put the import map before")
    page = page.replace(MARKER, tag + MARKER, 1)
    for target, source in PAGE.items():
        text = page if target == "index.html" else (STATIC / source).read_text(encoding="utf-8")
        write_text_atomically(output / target, text)
    (output / "examples").mkdir(exist_ok=True)
    card = model_file(resolve(checkpoint), name or str(checkpoint)).card
    examples = example_images(card)
    for example, content in examples.items():
        replace_atomically(output / "examples" / example, lambda out, content=content: out.write(content))
    return export_onnx(checkpoint, output, name, int8=int8, float16=float16, before_config=_site(ort, examples))


def _site(ort: dict, examples: dict[str, bytes]):
    """site.json's writer, which `export_onnx` calls once the graphs and weights are written (before captioner.json):
    where ONNX Runtime Web comes from, the example images, and which graphs read weights.bin."""

    def write(folder: Path) -> None:
        external = [graph for graph in GRAPHS if _reads_weights(folder / f"{graph}.onnx")]
        site = {"ort": ort, "examples": list(examples), "weights": WEIGHTS, "external": external}
        write_text_atomically(folder / "site.json", json.dumps(site, indent=1))

    return write


def _reads_weights(path: Path) -> bool:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return any(tensor.data_location == onnx.TensorProto.EXTERNAL for tensor in model.graph.initializer)


def folder_size(folder: Path) -> int:
    return sum(file.stat().st_size for file in folder.rglob("*") if file.is_file())


# The headers that make a page cross-origin isolated, where ONNX Runtime Web may run on several threads
ISOLATION = {"Cross-Origin-Opener-Policy": "same-origin", "Cross-Origin-Embedder-Policy": "require-corp"}


@contextmanager
def static_server(folder: Path, headers: dict[str, str] | None = None) -> Iterator[str]:
    """`python -m http.server -d folder` on a free loopback port, in a thread, adding `headers` (`ISOLATION`, say) to
    each answer; yields its address. For trying an export here (the tests and benchmarks/browser.py serve with it)."""

    class Handler(http.server.SimpleHTTPRequestHandler):
        def end_headers(self):
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            super().end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
