"""`captioner export --format web`: the static page's host loop (captioner/static/web/search.js) against the Python
one, call by call, under Node; and the exported folder served by a static server and driven in Chromium, its words
against `captioner.onnx.Captioner`'s on the same pixels."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from captioner.data.shapes import ShapesDataset
from captioner.errors import ConfigError
from captioner.onnx import search
from captioner.web_export import ISOLATION, static_server
from tests.conftest import REPO, run_main
from tests.helpers import END, PAD, START, TableDecoder, random_decoder
from tests.models.test_decoding import TRAP, WEAK
from tests.test_onnx import NEVER_ENDS, TorchWords

NODE = shutil.which("node")
TYPES = {np.dtype(np.float32): "float32", np.dtype(np.int64): "int64", np.dtype(np.bool_): "bool"}


def encode(array: np.ndarray) -> dict:
    data = base64.b64encode(array.tobytes(order="C")).decode()
    return {"type": TYPES[array.dtype], "dims": list(array.shape), "data": data}


class RecordedWords(TorchWords):
    """`TorchWords` that writes down each call's inputs (the state and what is bound) and outputs."""

    def __init__(self, *args, **kwargs):
        self.calls = []
        super().__init__(*args, **kwargs)

    def __call__(self, state):
        out = super().__call__(state)
        inputs = {**{name: x.numpy() for name, x in state.items()}, **self.fixed}
        self.calls.append({"inputs": {name: encode(x) for name, x in inputs.items()},
                           "outputs": {name: encode(x.numpy()) for name, x in out.items()}})  # fmt: skip
        return out


def python_search(decoder, annotations: torch.Tensor, beam_size: int, words: int, **options) -> tuple[dict, object]:
    """The Python host loop's search, and what the JavaScript one needs to replay it."""
    with torch.inference_mode():
        h, c = decoder.init_state(annotations)
        keys = decoder.prepare(annotations)
    arrays = [x.numpy() for x in (annotations, keys, h, c)]
    graph = "greedy" if beam_size == 1 else "beam"
    runner = RecordedWords(decoder, graph, {"annotations": arrays[0], "keys": arrays[1]}, words)
    common = {"start": START, "pad": PAD, "n": words}
    if beam_size == 1:
        out = search.greedy_search(runner, *arrays, **common, max_len=options.get("max_len", 30))
    else:
        out = search.beam_search(runner, *arrays, **common, beam_size=beam_size, vocab_size=decoder.vocab_size,
                                 **options)  # fmt: skip
    js = {"maxLen": options.get("max_len", 30), "lengthPenalty": options.get("length_penalty", 1.0)}
    replay = {
        **dict(zip(("annotations", "keys", "h", "c"), map(encode, arrays), strict=True)),
        "beam_size": beam_size,
        "options": {**common, **js, "vocabSize": decoder.vocab_size},
        "calls": runner.calls,
    }
    return replay, out


def searches() -> list[tuple[dict, object]]:
    """Searches of several beam widths, length penalties and words a call: a random decoder whose captions end at
    different words, tables built to trap greedy search, to favour short captions by the raw sum, to never end, and
    100 random tables of next-word probabilities."""
    cases = []
    for words in (1, 3, 4, 8):
        # the random decoder with <end> made likelier, so that captions end at different words and images leave the
        # batch between calls
        for beam_size, end, max_len, penalty in ((1, 1.0, 12, 1.0), (2, 1.3, 12, 1.0), (3, 1.4, 12, 0.7),
                                                 (4, 1.4, 12, 1.0), (5, 1.3, 6, 0.0)):  # fmt: skip
            decoder = random_decoder()
            with torch.no_grad():
                decoder.L_o.bias[END] += end
            torch.manual_seed(4)
            cases.append((decoder, torch.randn(7, 9, 16), beam_size, words,
                          {"max_len": max_len, "length_penalty": penalty}))  # fmt: skip
        tables = ((TRAP, 2, {}), (WEAK, 3, {"max_len": 10, "length_penalty": 0.0}), (NEVER_ENDS, 3, {"max_len": 5}),
                  (NEVER_ENDS, 1, {"max_len": 5}))  # fmt: skip
        for table, beam_size, options in tables:
            cases.append((TableDecoder(table), torch.zeros(3, 4, 2), beam_size, words, options))
    generator = np.random.default_rng(0)
    names = list(range(3, 8))
    for _ in range(100):
        rows = generator.dirichlet([0.5] * len(names), size=len(names)).tolist()
        table = {prev: dict(zip(names, row, strict=True)) for prev, row in zip([START, *names[1:]], rows, strict=True)}
        options = {"max_len": int(generator.integers(2, 9)), "length_penalty": float(generator.choice([0, 0.7, 1]))}
        cases.append((TableDecoder(table, vocab_size=8), torch.zeros(2, 4, 2), int(generator.integers(1, 5)),
                      int(generator.integers(1, 9)), options))  # fmt: skip
    return [python_search(decoder, annotations, beam, words, **options)
            for decoder, annotations, beam, words, options in cases]  # fmt: skip


@pytest.mark.skipif(NODE is None, reason="no node on this machine (Debian: apt-get install nodejs)")
def test_the_javascript_host_loop_is_the_python_one_call_by_call():
    """The page's host loop, run under Node on the calls the Python host loop made (each call's outputs replayed), gives
    each call the inputs the Python loop gave it (the state, the annotations and keys of the images still searching,
    to the bit), makes as many calls, and reads back the same captions, scores and attention."""
    cases = searches()
    done = subprocess.run([NODE, str(REPO / "tests" / "web" / "replay.mjs")], input=json.dumps([r for r, _ in cases]),
                          capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    results = json.loads(done.stdout)
    assert len(results) == len(cases)
    shrinking = [
        replay for replay, _ in cases if len({call["inputs"]["tokens"]["dims"][0] for call in replay["calls"]}) > 1
    ]
    assert len(shrinking) >= 10, len(shrinking)  # images left the batch between calls, in greedy and beam searches
    assert {replay["beam_size"] == 1 for replay in shrinking} == {True, False}
    for i, (result, (_, want)) in enumerate(zip(results, cases, strict=True)):
        assert "error" not in result, (i, result)
        assert result["ids"] == want.ids, i
        assert result["scores"] == [float(np.float32(s)) for s in want.scores], i
        for got, alphas in zip(result["alphas"], want.alphas, strict=True):
            assert np.array_equal(np.array(got, np.float32).reshape(alphas.shape), alphas), i


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# npm's onnxruntime-web, as .ci/run installs it (npm install --prefix .web onnxruntime-web@<ORT_WEB>), or where
# CAPTIONER_ORT_DIST says
ORT_DIST = Path(os.environ.get("CAPTIONER_ORT_DIST", REPO / ".web" / "node_modules" / "onnxruntime-web" / "dist"))


def test_the_page_loads_onnx_runtime_web_s_pinned_files_by_their_hashes(tmp_path):
    """Without --ort-dist the page loads ONNX Runtime Web from the CDN at the pinned version, each file checked by
    its hash; the hashes are those of npm's files at that version (checked where npm's package is here)."""
    from captioner.web_export import CDN, ORT_FILES, ORT_WEB, integrity, ort_files

    files = ort_files(tmp_path, None)
    assert files["version"] == ORT_WEB and CDN.endswith(f"onnxruntime-web@{ORT_WEB}/dist/")
    assert files["module"]["url"] == CDN + ORT_FILES["module"][0] and not (tmp_path / "ort").exists()
    package = ORT_DIST.parent / "package.json"
    if package.is_file() and json.loads(package.read_text())["version"] == ORT_WEB:
        assert {kind: integrity(ORT_DIST / name) for kind, (name, _) in ORT_FILES.items()} == {
            kind: digest for kind, (_, digest) in ORT_FILES.items()
        }
    with pytest.raises(ConfigError, match=rf"^--ort-dist {tmp_path}: no ort\.wasm\.bundle\.min\.mjs, ort-wasm-simd"):
        ort_files(tmp_path / "site", tmp_path)


@pytest.mark.ci
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine (Debian: apt-get install chromium)")
@pytest.mark.skipif(not ORT_DIST.is_dir(), reason=f"no onnxruntime-web at {ORT_DIST} (npm install --prefix .web ...)")
def test_the_exported_page_captions_in_chromium_with_the_python_captioner_s_words(capfd, tmp_path):
    """`captioner export --format web` of a bundled model, served by a static server with and without cross-origin
    isolation, in headless Chromium: test photos (shapes' test images, or with CAPTIONER_WEB_MODEL=ucm the shipped UCM
    photos; at the model's input size, so that no resize differs) get the words `captioner.onnx.Captioner` gives on
    the same folder, at beam 1 and 3, with an overlay per word; a file that is no image is one line in the page; the
    page says how many threads it runs on."""
    from playwright.sync_api import sync_playwright

    from captioner.onnx import Captioner
    from captioner.web_export import ORT_FILES

    model = os.environ.get("CAPTIONER_WEB_MODEL", "shapes")  # ucm: docs/images/web.png's model and photos
    site = tmp_path / "site"
    ran = run_main(capfd, "export", "--ckpt_path", model, "--format", "web", "--output", str(site),
                   "--ort-dist", str(ORT_DIST))  # fmt: skip
    assert ran.status == 0, ran.err
    assert ran.out.startswith(f"wrote {site}/ (") and "float16" in ran.out
    assert {name for name, _ in ORT_FILES.values()} == {file.name for file in (site / "ort").iterdir()}
    python = Captioner(site)
    size = (python.image_size,) * 2
    if model == "ucm":
        pictures = [Image.open(path).convert("RGB") for path in sorted((REPO / "docs/images/ucm").glob("*.jpg"))[:3]]
    else:
        pictures = [ShapesDataset("test", 3).load_image(index) for index in range(3)]
    photos = []
    for index, picture in enumerate(pictures):
        photos.append(tmp_path / f"photo_{index}.png")
        picture.resize(size).save(photos[-1])
    (tmp_path / "notes.txt").write_text("not a picture\n")
    want = {beam: python.caption(photos, beam_size=beam) for beam in (1, 3)}
    flags = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=flags)
        for headers in ({}, ISOLATION):
            with static_server(site, headers) as address:
                page = browser.new_page(viewport={"width": 1000, "height": 900})
                page.goto(address)
                threads = "one thread" if not headers else "threads (the page is cross-origin isolated)"
                assert threads in page.text_content("#runtime")
                for beam in (1, 3):
                    page.fill("#beam", str(beam))
                    for photo, expected in zip(photos, want[beam], strict=True):
                        page.set_input_files("#file", str(tmp_path / "notes.txt"))  # clears the caption
                        page.wait_for_function("document.getElementById('error').textContent.length > 0")
                        assert page.text_content("#error") == "notes.txt: not an image file this browser can read"
                        assert page.text_content("#caption") == ""
                        page.set_input_files("#file", str(photo))
                        page.wait_for_function("document.getElementById('caption').textContent.length > 0")
                        assert page.text_content("#error") == ""
                        assert page.text_content("#caption") == expected.text, (photo.name, beam)
                        words = page.locator("#strip figure")
                        assert [words.nth(i).text_content() for i in range(words.count())] == expected.tokens
                        score = float(page.text_content("#score"))
                        assert score == pytest.approx(expected.score, abs=1e-3), (photo.name, beam)
                # the overlays: each word's attention darkens the picture where the model did not look
                words.nth(0).hover()
                shown = page.evaluate(OVERLAY)
                picture = float(np.asarray(Image.open(photos[-1]).convert("RGB"), np.float64).mean())
                assert shown["word"] == expected.tokens[0] and shown["brightness"] < 0.9 * picture, (shown, picture)
                page.mouse.move(0, 0)
                page.screenshot(path=str(tmp_path / f"page{'_isolated' if headers else ''}.png"), full_page=True)
                if os.environ.get("CAPTIONER_SCREENSHOT"):  # how docs/images/web.png is made (README)
                    page.screenshot(path=os.environ["CAPTIONER_SCREENSHOT"], full_page=True)
                page.close()
        browser.close()
    assert (tmp_path / "page.png").stat().st_size > 10_000


# The word the big canvas shows, and its pixels' mean brightness (RGB)
OVERLAY = """() => {
  const big = document.getElementById("big");
  const data = big.getContext("2d").getImageData(0, 0, big.width, big.height).data;
  let total = 0;
  for (let i = 0; i < data.length; i += 4) total += data[i] + data[i + 1] + data[i + 2];
  return {word: document.getElementById("big-word").textContent, brightness: total / (data.length / 4 * 3)};
}"""


@pytest.mark.parametrize(
    "args, error",
    [
        (["--ort-dist", "dist"], "--ort-dist is for --format web"),
        (
            ["--format", "onnx", "--float32"],
            "--float32 is for --format web (the others store float32 unless --float16)",
        ),
        (["--format", "web", "--float16", "--float32"], "--float16 or --float32, not both"),
        (["--int8", "step"], "--int8 is for --format onnx and web"),
        (
            ["--format", "web", "--card", "card.json"],
            "--card is for --format model (an ONNX export keeps the model's card)",
        ),
    ],
)
def test_export_options_that_do_not_go_together_are_one_line_errors(capfd, tmp_path, args, error):
    ran = run_main(capfd, "export", "--ckpt_path", "shapes", "--output", str(tmp_path / "out"), *args)
    assert ran.status == 2 and ran.err.strip() == f"error: {error}", ran.err
    assert not (tmp_path / "out").exists()
