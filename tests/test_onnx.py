"""`captioner export --format onnx` and `captioner.onnx`: the exported graphs on ONNX Runtime (the
searches' own word functions, run by a host loop) write the torch search's captions with its attention, from the same
files, and import no torch.

The bundled model is exported once per test process, by the command a user runs. `make test` compares the first 32
images of the bundled model's test split; .ci/run all 500 (`-m ci`), and installs deploy/ in a fresh virtual
environment to show that it pulls in no torch."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import venv
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from captioner import Captioner as TorchCaptioner
from captioner.checkpoints import export
from captioner.data.images import load_image
from captioner.data.shapes import ShapesDataset
from captioner.errors import CaptionerError, ConfigError
from captioner.models.beam_search import beam_search
from captioner.models.decoding import greedy_search
from captioner.onnx import Captioner, search
from captioner.onnx.resize import resize
from captioner.onnx_export import INPUTS, OUTPUTS, WORDS, BeamWordsGraph, GreedyWordsGraph
from tests.conftest import REPO, run_main
from tests.helpers import END, PAD, SPECIAL, START, A, B, C, TableDecoder, compare, random_decoder
from tests.images import photo
from tests.models.test_decoding import TRAP, WEAK

SAMPLE = REPO / "docs" / "images" / "shapes_test_0.png"


@pytest.fixture(scope="module")
def shapes_onnx(tmp_path_factory) -> Path:
    """The bundled model exported as a user exports it: `captioner export --ckpt_path shapes --format onnx`."""
    from captioner.cli import main

    folder = tmp_path_factory.mktemp("onnx") / "shapes"
    main(["export", "--ckpt_path", "shapes", "--format", "onnx", "--output", str(folder)])
    return folder


@pytest.fixture(scope="module")
def torch_captioner() -> TorchCaptioner:
    return TorchCaptioner.load("shapes")


@pytest.fixture(scope="module")
def test_files(tmp_path_factory) -> list[Path]:
    """The bundled model's test split (ShapesDataset("test", 500, seed=0), as tests/test_bundled_model.py reads it),
    written to PNG files: both searches read the same files."""
    folder = tmp_path_factory.mktemp("shapes_test")
    split = ShapesDataset("test", 500, seed=0)
    paths = [folder / f"{i:03d}.png" for i in range(len(split))]
    for i, path in enumerate(paths):
        split.load_image(i).save(path)
    return paths


def test_the_resize_of_a_large_photo_needs_less_memory_than_twice_the_photo():
    """A 12-megapixel photo resized to 224: beside the photo, the resize's numpy arrays peak below twice its own uint8
    size (tracemalloc sees numpy's allocations). (benchmarks/resize.py measures its time against torchvision's.)"""
    import tracemalloc

    pixels = np.random.default_rng(0).integers(0, 256, (3000, 4000, 3), dtype=np.uint8)
    tracemalloc.start()
    try:
        resize(pixels, 224, "bicubic")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * pixels.nbytes, peak / pixels.nbytes


def test_importing_and_captioning_imports_no_torch(shapes_onnx):
    """The issue's command, in a process of its own: it captions, and torch is never imported."""
    code = (
        "import sys; from captioner.onnx import Captioner; "
        f"r = Captioner({str(shapes_onnx)!r}).caption([{str(SAMPLE)!r}])[0]; "
        "print(r.text); print(r.alphas.shape, r.grid_hw); "
        "assert 'torch' not in sys.modules and 'torchvision' not in sys.modules, 'torch was imported'"
    )
    ran = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr[-3000:]
    text, shape = ran.stdout.splitlines()
    assert text.startswith("there is") and shape.endswith("(14, 14)"), ran.stdout


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_the_resize_gives_torchvisions_pixels(mode):
    """The numpy resize against torchvision's v2.Resize(antialias=True) on uint8 images (what the model's
    preprocessing does): down and up, each side alone and both, to the last bit."""
    generator = np.random.default_rng(0)
    image = np.asarray(photo("astronaut"))  # 512x512: real edges and gradients
    interpolation = v2.InterpolationMode(mode)
    sizes = [(512, 512, 224), (300, 451, 224), (97, 61, 224), (224, 500, 224), (40, 224, 224), (1, 3000, 256)]
    for height, width, size in [*sizes, (333, 333, 96)]:  # (input height, width, output side)
        top = generator.integers(0, 512 - height + 1)
        pixels = np.array(Image.fromarray(image[top : top + height]).resize((width, height)))
        resized = v2.Resize((size, size), interpolation=interpolation, antialias=True)
        want = resized(torch.from_numpy(pixels).permute(2, 0, 1))
        got = resize(pixels, size, mode)
        assert got.shape == (size, size, 3)
        assert np.array_equal(got, want.permute(1, 2, 0).numpy()), (height, width, size)


def test_a_photos_annotations_are_the_torch_captioners(shapes_onnx, torch_captioner):
    """Photos of several sizes and modes, in files: the annotations that each captioner computes from what it reads
    (`load_image`, then its own preprocessing) agree within 1e-3 with the exact resize; and Pillow's resize, the
    default, gives torchvision's pixels to within 2 levels, a value in 100 or fewer differing."""
    onnx, pillow = Captioner(shapes_onnx, resize="exact"), Captioner(shapes_onnx)
    cases = {"coffee.jpg": photo("coffee"), "chelsea.png": photo("chelsea"), "camera.png": photo("camera")}
    cases |= {"small.png": photo("astronaut").resize((61, 97)), "wide.jpg": photo("coffee").resize((900, 120))}
    for name, image in cases.items():
        path = shapes_onnx.parent / name
        image.save(path)
        got = onnx.annotate(onnx.preprocess(load_image(path))[None])
        exact, approximate = (c.preprocess(load_image(path)).astype(int) for c in (onnx, pillow))
        assert np.abs(exact - approximate).max() <= 2 and (exact != approximate).mean() <= 0.01, name
        with torch.inference_mode():
            want = torch_captioner.model.annotate(torch_captioner.transform(load_image(path))[None]).numpy()
        assert got.shape == want.shape
        assert np.abs(got - want).max() < 1e-3, (name, np.abs(got - want).max())


@pytest.mark.parametrize("images", [32, pytest.param(500, marks=pytest.mark.ci)])
def test_the_searches_write_the_torch_captions_word_for_word(images, shapes_onnx, torch_captioner, test_files):
    """The bundled model's test images, read from files, greedy and beam 3: greedy, every caption the same; beam 3,
    at most 1% differ, each a near-tie (rankings within 1e-4); each word's attention within 1e-4."""
    onnx = Captioner(shapes_onnx)
    paths = test_files[:images]
    for beam_size in (1, 3):
        want = torch_captioner.caption(paths, beam_size=beam_size, batch_size=50)
        got = onnx.caption(paths, beam_size=beam_size, batch_size=50)
        assert [g.source for g in got] == [str(p) for p in paths]
        differ = compare(want, got, beam_size)
        assert len(differ) <= 0.01 * images, differ


def test_the_searches_agree_where_no_beam_ends_and_on_the_raw_sum(shapes_onnx, torch_captioner, test_files):
    """Captions cut at 4 words (no hypothesis ends: the best unfinished one is read back), the raw-sum ranking
    (length_penalty 0), beams of 2 and 5, and batches of images that end at different words."""
    onnx = Captioner(shapes_onnx)
    paths = test_files[:12]
    for options in [{"beam_size": 3, "max_len": 4}, {"beam_size": 2, "length_penalty": 0.0},
                    {"beam_size": 5, "batch_size": 5}, {"beam_size": 1, "max_len": 4}]:  # fmt: skip
        want, got = torch_captioner.caption(paths, **options), onnx.caption(paths, **options)
        ranked = {k: v for k, v in options.items() if k in ("max_len", "length_penalty")}
        assert compare(want, got, options["beam_size"], **ranked) == [], options
        if options == {"beam_size": 3, "max_len": 4}:  # some captions ended within 4 words, some are cut there
            assert {len(g.tokens) for g in got} > {4}, [g.text for g in got]


class Held:
    """An array where an OrtValue would be (`.numpy()`)."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def numpy(self) -> np.ndarray:
        return self.array


class TorchWords(search.Words):
    """A decoder's word graph (`GreedyWordsGraph`, `BeamWordsGraph`) run by torch where ONNX Runtime would run the
    exported one, on numpy arrays: the host loop run on it reads the very numbers the torch search reads, so the two
    must choose the same words. Records what is bound."""

    def __init__(self, decoder, graph: str, fixed: dict[str, np.ndarray], words: int = WORDS):
        model = SimpleNamespace(decoder=decoder, pad_index=PAD, start_index=START, end_index=END)
        self.graph, self.name = (GreedyWordsGraph if graph == "greedy" else BeamWordsGraph)(model, words), graph
        self.outputs, self.fixed, self.bound = OUTPUTS[graph], {}, []
        self.batches: list[int] = []  # the images in each call
        self.bind(fixed)

    def value(self, array: np.ndarray) -> Held:
        return Held(np.array(array))

    def bind(self, fixed: dict[str, np.ndarray]) -> None:
        self.bound.append(sorted(fixed))
        self.fixed.update({name: np.array(x) for name, x in fixed.items()})

    def __call__(self, state: dict[str, Held]) -> dict[str, Held]:
        feed = {**{name: x.numpy() for name, x in state.items()}, **self.fixed}
        self.batches.append(len(feed["h"]))
        with torch.inference_mode():
            out = self.graph(*(torch.from_numpy(np.ascontiguousarray(feed[name])) for name in INPUTS[self.name]))
        return {name: Held(x.numpy()) for name, x in zip(self.outputs, out, strict=True)}


def host_search(decoder, annotations: torch.Tensor, beam_size: int, words: int = WORDS, runners=None, **options):
    """`captioner.onnx.search`'s host loop on the decoder's word graphs, run by torch (`TorchWords`, appended to
    `runners` where it is given)."""
    with torch.inference_mode():
        h, c = decoder.init_state(annotations)
        keys = decoder.prepare(annotations)
    arrays = [x.numpy() for x in (annotations, keys, h, c)]
    graph = "greedy" if beam_size == 1 else "beam"
    runner = TorchWords(decoder, graph, {"annotations": arrays[0], "keys": arrays[1]}, words)
    if runners is not None:
        runners.append(runner)
    common = {"start": START, "pad": PAD, "n": words}
    if beam_size == 1:
        return search.greedy_search(runner, *arrays, **common, **options)
    return search.beam_search(runner, *arrays, **common, beam_size=beam_size, vocab_size=decoder.vocab_size, **options)


NEVER_ENDS = {w: {A: 0.5, B: 0.3, C: 0.2} for w in (START, A, B, C)}


@pytest.mark.parametrize(
    "decoder, options",
    [
        ("random", {"beam_size": 1, "max_len": 12}),
        ("random", {"beam_size": 3, "max_len": 12}),
        ("random", {"beam_size": 4, "max_len": 12, "length_penalty": 0.7}),
        ("random", {"beam_size": 5, "max_len": 6, "length_penalty": 0.0}),
        ("trap", {"beam_size": 2}),
        ("weak", {"beam_size": 3, "max_len": 10, "length_penalty": 0.0}),
        ("weak", {"beam_size": 3, "max_len": 10}),
        ("never_ends", {"beam_size": 3, "max_len": 5}),
        ("never_ends", {"beam_size": 1, "max_len": 5}),
    ],
)
@pytest.mark.parametrize("words", [WORDS, 3, 8])
def test_the_host_loop_is_the_torch_search(decoder, options, words):
    """On the torch search's own test decoders (tests/models/test_decoding.py: a random one, whose captions end at
    many different words, and tables built to trap greedy search, to favour short captions by the raw sum, to never
    end), the host loop over the word graphs writes the same words, scores and attention, for each beam width and
    length penalty, and with graphs of 4 (the export's), 3 and 8 words a call (8: a call runs past `max_len`). On
    these decoders every image of a batch ends in the same call; images that leave the batch between calls: the next
    test."""
    if decoder == "random":
        decoder, annotations = random_decoder(), torch.randn(7, 9, 16)
    else:
        tables = {"trap": TRAP, "weak": WEAK, "never_ends": NEVER_ENDS}
        decoder, annotations = TableDecoder(tables[decoder]), torch.zeros(3, 4, 2)
    options = dict(options)  # pytest's own dict: a rerun of the case gets it as the parametrization gave it
    beam_size = options.pop("beam_size")
    with torch.inference_mode():
        if beam_size == 1:
            want = greedy_search(decoder, annotations, **options, **SPECIAL)
        else:
            want = beam_search(decoder, annotations, beam_size=beam_size, **options, **SPECIAL)
    got = host_search(decoder, annotations, beam_size, words, **options)
    for i, ids in enumerate(got.ids):
        n = int(want.lengths[i])
        assert ids == want.tokens[i, :n].tolist(), i
        assert got.scores[i] == pytest.approx(float(want.scores[i]), abs=1e-5)
        assert np.abs(got.alphas[i] - want.alphas[i, :n].numpy()).max() <= 1e-6


@pytest.mark.parametrize("beam_size, end_bias, options", [(1, 1.0, {}), (4, 1.2, {"length_penalty": 0.7})])
@pytest.mark.parametrize("words", [WORDS, 3])
def test_images_leave_the_host_loop_s_batch_between_calls_as_the_torch_search_s(beam_size, end_bias, options, words):
    """The random decoder made likelier to write <end> (its bias raised), so that its 7 images' captions end at
    different words: the host loop's batch shrinks between calls as images finish, and it writes the torch search's
    words, scores and attention all the same."""
    decoder, annotations = random_decoder(), torch.randn(7, 9, 16)
    with torch.no_grad():
        decoder.L_o.bias[END] += end_bias
    with torch.inference_mode():
        if beam_size == 1:
            want = greedy_search(decoder, annotations, max_len=12, **options, **SPECIAL)
        else:
            want = beam_search(decoder, annotations, beam_size=beam_size, max_len=12, **options, **SPECIAL)
    runners = []
    got = host_search(decoder, annotations, beam_size, words, runners=runners, max_len=12, **options)
    batches = runners[0].batches
    assert batches[0] == 7 and 0 < batches[-1] < 7, batches  # a later call had some of the images, not all
    for i, ids in enumerate(got.ids):
        n = int(want.lengths[i])
        assert ids == want.tokens[i, :n].tolist(), i
        assert got.scores[i] == pytest.approx(float(want.scores[i]), abs=1e-5)
        assert np.abs(got.alphas[i] - want.alphas[i, :n].numpy()).max() <= 1e-6


def test_both_searches_refuse_a_beam_wider_than_the_words_they_can_choose():
    """A vocabulary of V words offers a search V - 2 (never <pad> or <start>): a wider beam is refused in one line by
    both searches."""
    decoder, annotations = random_decoder(), torch.randn(2, 9, 16)  # V = 30
    with torch.inference_mode():
        assert beam_search(decoder, annotations, beam_size=28, max_len=3, **SPECIAL).tokens.shape[0] == 2
        with pytest.raises(ConfigError, match=r"^beam size 29 is larger than the 28 words this vocabulary can"):
            beam_search(decoder, annotations, beam_size=29, max_len=3, **SPECIAL)
    assert len(host_search(decoder, annotations, 28, max_len=3).ids) == 2
    with pytest.raises(search.SearchError, match=r"^beam size 29 is larger than the 28 words this vocabulary can"):
        host_search(decoder, annotations, 29, max_len=3)


def test_the_host_loop_is_the_torch_search_on_random_tables():
    """200 tables of next-word probabilities drawn at random (8 words, <end> among them: captions end at any word,
    and finished hypotheses compete with live ones), random beam widths, length penalties and longest captions: the
    same caption, but for ties: a caption that takes the same transitions in another order (7 6 5 4 7 5, 7 5 4 7 6 5)
    has the same probability, and of two equal values torch.topk keeps whichever its kernel happens to, at each size
    it is given (the host loop's first word ranks K hypotheses where the torch search ranks one). A trained model's
    words depend on more than the previous one, and make no such ties."""
    generator = np.random.default_rng(0)
    words, ties = list(range(END, 8)), 0
    for _ in range(200):
        rows = generator.dirichlet([0.5] * len(words), size=len(words)).tolist()  # after <start> and each word
        table = {prev: dict(zip(words, row, strict=True)) for prev, row in zip([START, *words[1:]], rows, strict=True)}
        decoder, annotations = TableDecoder(table, vocab_size=8), torch.zeros(1, 4, 2)
        options = {"beam_size": int(generator.integers(2, 5)), "max_len": int(generator.integers(2, 9))}
        options["length_penalty"] = float(generator.choice([0, 0.7, 1]))
        with torch.inference_mode():
            want = beam_search(decoder, annotations, **options, **SPECIAL)
        beam_size = options.pop("beam_size")
        got = host_search(decoder, annotations, beam_size, int(generator.integers(1, 9)), **options)
        n = int(want.lengths[0])
        if got.ids[0] != want.tokens[0, :n].tolist():  # only a tie: the same transitions in another order
            penalty = options["length_penalty"]
            rankings = float(want.scores[0]) / n**penalty, got.scores[0] / len(got.ids[0]) ** penalty
            assert abs(rankings[0] - rankings[1]) < 1e-5, (table, options, got.ids[0], want.tokens[0, :n].tolist())
            ties += 1
    assert ties <= 10


def test_fixed_inputs_are_bound_once_and_the_state_stays_in_ort_values(shapes_onnx, monkeypatch):
    """One image, beam 3 and greedy, several calls of words each: the annotations, keys and length penalty are bound
    once, the state becomes an OrtValue once (before the first word), and from then on each call's state is the last
    call's outputs as they are (no image leaves: none is copied through numpy). With CUDA's provider that is what
    keeps the annotations on the GPU for the whole search (not measured here)."""
    bound, made, calls = [], [], []

    def bind(self, fixed, bind=search.Words.bind):
        bound.append(sorted(fixed))
        bind(self, fixed)

    def value(self, array, value=search.Words.value):
        made.append(array.shape)
        return value(self, array)

    def call(self, state, run=search.Words.__call__):
        if calls:  # the state is the last call's outputs, the very objects
            assert all(state[name] is calls[-1][name + "_out"] for name in search.STATE)
        calls.append(run(self, state))
        return calls[-1]

    monkeypatch.setattr(search.Words, "bind", bind)
    monkeypatch.setattr(search.Words, "value", value)
    monkeypatch.setattr(search.Words, "__call__", call)
    onnx = Captioner(shapes_onnx)
    for beam_size in (3, 1):
        bound.clear(), made.clear(), calls.clear()
        assert len(onnx.caption([SAMPLE], beam_size=beam_size, max_len=12)[0].tokens) == 12  # cut short
        assert len(calls) == 3  # 4 + 4 + 4 words
        fixed = [["annotations", "keys"], ["length_penalty"]] if beam_size > 1 else [["annotations", "keys"]]
        assert bound == fixed and len(made) == sum(map(len, fixed)) + len(search.STATE), (bound, made)


def test_a_calls_outputs_outlive_the_next_call(shapes_onnx):
    """The state a call reads is the outputs of the one before: ONNX Runtime must not write the next outputs over
    them (as a CUDA graph's replay would). Every output of the first call still holds its values after two more."""
    onnx = Captioner(shapes_onnx)
    annotations = onnx.annotate(onnx.preprocess(load_image(SAMPLE))[None])
    h, c, keys = onnx.sessions["start"].run(None, {"annotations": annotations})
    words = search.Words(onnx.sessions["greedy"], "cpu", {"annotations": annotations, "keys": keys})
    state = {"tokens": np.full(1, 1), "h": h, "c": c, "scores": np.zeros(1, np.float32),
             "lengths": np.zeros(1, np.int64), "finished": np.zeros(1, bool)}  # fmt: skip
    first = words({name: words.value(x) for name, x in state.items()})
    copies = {name: value.numpy().copy() for name, value in first.items()}
    later = words(words.next_state(first))
    words(words.next_state(later))
    assert all(np.array_equal(first[name].numpy(), copies[name]) for name in first)
    assert not np.array_equal(later["h_out"].numpy(), copies["h_out"])  # the calls did compute new states


def test_caption_command_on_an_onnx_folder_draws_the_same_overlays(shapes_onnx, capfd, tmp_path, monkeypatch):
    """`captioner caption --ckpt_path FOLDER IMAGE --overlays DIR` captions with the ONNX search (torch's Captioner is
    never loaded) and draws its overlays from the ONNX attention: the same picture as torch's, to a level or two."""
    torch_overlays, onnx_overlays = tmp_path / "torch", tmp_path / "onnx"
    want = run_main(capfd, "caption", "--ckpt_path", "shapes", str(SAMPLE), "--overlays", str(torch_overlays), "--json")

    def refuse(*args, **kwargs):
        raise AssertionError("the torch model was built")

    monkeypatch.setattr("captioner.api.build_model", refuse)
    got = run_main(
        capfd, "caption", "--ckpt_path", str(shapes_onnx), str(SAMPLE), "--overlays", str(onnx_overlays), "--json"
    )
    assert got.status == want.status == 0, got.err
    record, expected = json.loads(got.out), json.loads(want.out)
    assert record["tokens"] == expected["tokens"] and abs(record["score"] - expected["score"]) < 1e-4
    (drawn,), (reference,) = onnx_overlays.glob("*.png"), torch_overlays.glob("*.png")
    a, b = (np.asarray(Image.open(p), dtype=np.int16) for p in (drawn, reference))
    assert a.shape == b.shape and np.abs(a - b).max() <= 2


def test_serve_on_an_onnx_folder_answers_what_torch_does(shapes_onnx, torch_captioner):
    """`captioner serve --ckpt_path FOLDER`, as users run it: its answer is the torch Captioner's caption, and its
    attention within the JSON's rounding (1e-5) of 1e-4."""
    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "captioner.cli", "serve", "--ckpt_path", str(shapes_onnx), "--port", str(port)]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
    try:
        while time.monotonic() < deadline and process.poll() is None:
            try:
                health = httpx.get(f"{url}/healthz")
                break
            except httpx.TransportError:
                time.sleep(0.2)
        assert process.poll() is None, "captioner serve ended"
        assert health.json()["grid"] == [14, 14]
        files = {"image": ("shapes.png", SAMPLE.read_bytes())}
        answer = httpx.post(f"{url}/api/caption", files=files, data={"beam_size": "3"}, timeout=60).json()
    finally:
        process.terminate()
        log = process.communicate(timeout=30)[0]
    assert "Traceback" not in log, log
    expected = torch_captioner.caption([SAMPLE], beam_size=3)[0]
    assert answer["tokens"] == expected.tokens and answer["caption"] == expected.text
    assert np.abs(np.array(answer["alphas"]) - expected.alphas.numpy()).max() <= 1e-4 + 1e-5


def test_a_broken_export_is_one_line_naming_the_folder(shapes_onnx, tmp_path, capfd):
    incomplete = Path(shutil.copytree(shapes_onnx, tmp_path / "incomplete"))
    (incomplete / "beam.onnx").unlink()
    newer = Path(shutil.copytree(shapes_onnx, tmp_path / "newer"))
    config = json.loads((newer / "captioner.json").read_text())
    (newer / "captioner.json").write_text(json.dumps({**config, "format": 99}))
    empty = tmp_path / "empty"
    empty.mkdir()
    truncated = Path(shutil.copytree(shapes_onnx, tmp_path / "truncated"))
    (truncated / "encoder.onnx").write_bytes((shapes_onnx / "encoder.onnx").read_bytes()[:1000])
    reasons = {incomplete: "beam.onnx: missing", newer: "format 99", empty: "captioner.json"}  # no / without it
    reasons[truncated] = "encoder.onnx: ONNX Runtime cannot load it"
    for folder, reason in reasons.items():
        with pytest.raises(CaptionerError, match=reason):
            Captioner(folder)
        ran = run_main(capfd, "caption", "--ckpt_path", str(folder), str(SAMPLE))
        errors = ran.err.strip().splitlines()
        assert ran.status == 2 and len(errors) == 1 and reason in errors[0] and "Traceback" not in ran.err, ran.err


def test_a_bad_image_is_skipped_with_its_error(shapes_onnx, tmp_path):
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"not a jpeg")
    results = list(Captioner(shapes_onnx).iter_captions([SAMPLE, broken, photo("coffee")], beam_size=3))
    assert results[0].text.startswith("there is") and results[2].source == "<image>"
    assert str(results[1]) == f"{broken}: not an image file PIL can read"


@pytest.mark.parametrize("change", [1e-3, 0.1])
def test_a_check_finds_graphs_that_are_not_the_models(shapes_onnx, change):
    """export's check (run at every export) refuses graphs that compute another function than the model's: here one
    word's logit moved by 1e-3 or by 0.1: "square", a word the searches choose, whose scores it moves by 4e-4 and
    more."""
    from captioner.checkpoints import build_model, model_file, resolve
    from captioner.onnx_export import check

    model = build_model(model_file(resolve("shapes")), "shapes").eval()
    model.encoder.fold_batchnorm()
    check(model, shapes_onnx, "shapes")  # the model it was exported from
    vocab = json.loads((shapes_onnx / "captioner.json").read_text())["vocab"]
    with torch.no_grad():
        model.decoder.L_o.bias[vocab.index("square")] += change  # one word's logit
    with pytest.raises(CaptionerError, match=r"the exported (greedy|beam) graph's \w+ are not the model's \("):
        check(model, shapes_onnx, "shapes")


def test_int8_quantizes_the_step_and_still_captions(shapes_onnx, tmp_path):
    """--int8 step's quantization (here on a copy of the float export): the word graphs' matrix products run in int8,
    their weights take less than half the bytes, and they caption. What it changes is measured in
    benchmarks/onnx_runtime.py. With an ONNX Runtime whose quantizer cannot take the word graphs, a one-line refusal
    before any work."""
    import onnx
    import onnxruntime

    from captioner.onnx.layout import GRAPHS
    from captioner.onnx_export import INT8, QUANTIZER, export_onnx, quantize
    from captioner.onnx_weights import share

    if tuple(int(part) for part in onnxruntime.__version__.split(".")[:2]) < QUANTIZER:  # .ci/run's floor slice
        with pytest.raises(ConfigError, match=r"^--int8 needs onnxruntime >= 1\.32, whose quantizer takes the"):
            export_onnx("shapes", tmp_path / "int8", int8="step")
        assert not (tmp_path / "int8").exists()  # refused before any work
        return
    folder = Path(shutil.copytree(shapes_onnx, tmp_path / "int8"))
    quantize(folder, INT8["step"])
    share(folder, GRAPHS)

    def weights(path: Path) -> int:  # bytes (the graphs' 4 words of nodes share them), weights.bin's included
        return sum(len(i.raw_data) or 4 * len(i.float_data) for i in onnx.load(str(path)).graph.initializer)

    def size(folder: Path) -> int:
        return sum(file.stat().st_size for file in folder.iterdir())

    for graph in ("greedy", "beam"):
        ops = {node.op_type for node in onnx.load(str(folder / f"{graph}.onnx")).graph.node}
        assert {"DynamicQuantizeLinear", "MatMulInteger"} <= ops, (graph, ops)
        assert weights(folder / f"{graph}.onnx") < 0.5 * weights(shapes_onnx / f"{graph}.onnx")
    assert size(folder) < size(shapes_onnx) - 0.5 * weights(shapes_onnx / "greedy.onnx")
    assert (folder / "encoder.onnx").read_bytes() == (shapes_onnx / "encoder.onnx").read_bytes()
    result = Captioner(folder).caption([SAMPLE])[0]
    assert result.tokens and result.alphas.shape == (len(result.tokens), 196)


INTACT = """
import base64, hashlib, importlib.metadata, sys
files = importlib.metadata.distribution(sys.argv[1]).files
changed = []
for f in files:
    if f.hash is not None:
        path = f.locate()
        digest = hashlib.new(f.hash.mode, path.read_bytes()).digest() if path.exists() else b""
        if base64.urlsafe_b64encode(digest).rstrip(b"=").decode() != f.hash.value:
            changed.append(str(f))
print(len(files), changed)
"""


@pytest.mark.ci
def test_deploy_installs_without_torch_and_captions_beside_the_full_package(shapes_onnx, tmp_path):
    """deploy/ as the README ships it, its wheel built in the checkout and installed from another folder (deploy/ links
    to the package's own files, which a copy of the folder alone would not bring), in a fresh virtual environment:
    pip installs numpy, Pillow and onnxruntime, never torch, and the README's command captions there. Then the full
    package joins it, and each is uninstalled in turn, in both orders: every file each installed is still there with
    the bytes it installed (its RECORD's hashes), and the one left captions (the two packages share no file)."""
    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    # pip builds a folder in place: the packages are built from a copy, so that no build/ lands in the repository
    source = tmp_path / "source"
    for name in ("captioner", "deploy"):
        leftovers = shutil.ignore_patterns("__pycache__", "build")
        shutil.copytree(REPO / name, source / name, symlinks=True, ignore=leftovers)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)

    def pip(*args: str) -> None:
        ran = subprocess.run([python, "-m", "pip", *args], cwd=tmp_path, capture_output=True, text=True, timeout=900)
        assert ran.returncode == 0, ran.stderr[-3000:]

    def captions(module: str) -> None:
        code = (
            f"import sys; from {module} import Captioner; "
            f"print(Captioner({str(shapes_onnx)!r}).caption([{str(SAMPLE)!r}])[0].text); "
            "assert 'torch' not in sys.modules"
        )
        ran = subprocess.run([python, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert ran.returncode == 0 and ran.stdout.startswith("there is"), (module, ran.stderr[-3000:])

    def intact(*distributions: str) -> None:
        for name in distributions:
            ran = subprocess.run([python, "-c", INTACT, name], cwd=tmp_path, capture_output=True, text=True)
            assert ran.returncode == 0 and ran.stdout.split(" ", 1)[1].strip() == "[]", (name, ran.stdout, ran.stderr)

    pip("wheel", "--quiet", "--no-deps", "--wheel-dir", str(tmp_path / "built"), str(source / "deploy"))
    (wheel,) = (tmp_path / "built").glob("captioner_onnx-*.whl")
    target = tmp_path / "where it runs"
    target.mkdir()
    pip("install", "--quiet", str(shutil.copy(wheel, target)))
    listed = subprocess.run([python, "-m", "pip", "list", "--format=json"], capture_output=True, text=True)
    installed = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert "onnxruntime" in installed and not {"torch", "torchvision", "lightning"} & installed, installed
    captions("captioner_onnx")
    # The full package beside it (without its dependencies: what is checked is whose files are whose), then either
    # one removed: deploy first, then the full package
    pip("install", "--quiet", "--no-deps", str(source))
    intact("captioner", "captioner-onnx")
    captions("captioner_onnx"), captions("captioner.onnx")
    pip("uninstall", "--yes", "captioner-onnx")
    intact("captioner")
    captions("captioner.onnx")
    pip("install", "--quiet", str(source / "deploy"))  # the other order: the full package first
    intact("captioner", "captioner-onnx")
    pip("uninstall", "--yes", "captioner")
    intact("captioner-onnx")
    captions("captioner_onnx")


def test_one_rule_says_what_a_model_name_means_for_every_command_and_the_api(shapes_onnx, tmp_path, capfd, monkeypatch):
    """`captioner.checkpoints.locate`: a folder named like the bundled model that holds no model does not shadow it;
    one that holds an export makes the bare name
    ambiguous, refused in one line, and `./shapes` is the folder; another folder is one line; `Captioner.load` takes
    an export folder too."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "shapes").mkdir()  # e.g. a folder of shapes images: not a model
    image = str(SAMPLE)
    ran = run_main(capfd, "caption", image, "--ckpt_path", "shapes")
    assert ran.status == 0 and ran.out.split("\t")[1].startswith("there is"), ran.err
    shutil.copytree(shapes_onnx, tmp_path / "shapes", dirs_exist_ok=True)  # now an export
    for command in (["caption", image], ["serve"], ["export", "--output", "x.pt"]):
        ran = run_main(capfd, *command, "--ckpt_path", "shapes")
        assert ran.status == 2 and ran.err.splitlines() == [
            "error: 'shapes' is both the bundled model's name and a model in this folder: write ./shapes for this "
            "folder's, or another path"
        ], (command, ran.err)
    ran = run_main(capfd, "caption", image, "--ckpt_path", "./shapes")
    assert ran.status == 0 and ran.out.split("\t")[1].startswith("there is"), ran.err
    assert isinstance(TorchCaptioner.load("./shapes"), Captioner)  # captioner.onnx's
    (tmp_path / "other").mkdir()
    ran = run_main(capfd, "caption", image, "--ckpt_path", "other")
    assert ran.status == 2 and ran.err.splitlines() == [
        "error: other: a folder without captioner.json, so not a model that `captioner export --format onnx` wrote"
    ], ran.err
    with pytest.raises(CaptionerError, match="an ONNX export folder; this needs a torch model file"):
        export("./shapes", tmp_path / "x.pt")  # `captioner export`'s own: from a torch model only


def test_the_host_loop_gives_onnx_runtime_int64_ids_whatever_numpy_s_default_integer():
    """ONNX Runtime wants int64 token ids. numpy's default integer is 32 bits on Windows before numpy 2, where
    `np.full(B, start)` gave int32: stood in for here by a start id that is a 32-bit integer."""

    class Recorder:  # the word graphs' stand-in: it records what the first call is given, then ends the search
        def __init__(self):
            self.given = {}

        def bind(self, inputs):
            pass

        def value(self, x):
            return x

        def __call__(self, state):
            self.given.update(state)
            raise StopIteration

    annotations, keys = np.zeros((2, 4, 3), np.float32), np.zeros((2, 4, 5), np.float32)
    h = c = np.zeros((2, 6), np.float32)
    for run in (
        lambda words: search.greedy_search(words, annotations, keys, h, c, start=np.int32(1), n=4),
        lambda words: search.beam_search(words, annotations, keys, h, c, start=np.int32(1), n=4, vocab_size=9),
    ):
        words = Recorder()
        with pytest.raises(StopIteration):
            run(words)
        assert words.given["tokens"].dtype == np.int64 and words.given["lengths"].dtype == np.int64
