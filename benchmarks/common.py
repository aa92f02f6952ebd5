"""What the benchmark scripts share (no script imports another): the model sizes and random models, synthetic data of
COCO's shape, the tutorial's way of writing the same model (the reference every speed table compares with), timing,
and `Table`, which prints and writes each row as soon as it is measured."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from captioner.models.decoder import AttentionDecoder

REPO = Path(__file__).resolve().parent.parent

# name -> (P, E, D, A, M, V): grid positions, encoder channels, LSTM, attention, embedding and vocabulary sizes
SIZES = {
    "shapes": (49, 1280, 256, 256, 128, 32),  # the shapes decoder on EfficientNet-Lite0's 7x7 grid (feature_stride 32)
    "paper": (196, 2048, 512, 512, 512, 10000),  # a ResNet's 14x14 grid, the paper's decoder and vocabulary sizes
}
TINY = (9, 1280, 12, 10, 8, 30)  # --smoke: EfficientNet-Lite0's channels on a 3x3 grid, a few units a layer
SPECIAL = {"pad_index": 0, "start_index": 1, "end_index": 2}


# --- models and data ---------------------------------------------------------------------------------------------


def random_decoder(size: str | tuple, seed: int = 0) -> AttentionDecoder:
    """A decoder with random weights at `size` (a name in SIZES, or such a tuple), in eval mode, that never writes
    <end>: every search runs to its max_len, so that the figures compare batching, not how soon captions end."""
    P, E, D, A, M, V = SIZES[size] if isinstance(size, str) else size
    torch.manual_seed(seed)
    decoder = AttentionDecoder(
        vocab_size=V, encoder_dim=E, num_pixels=P, embed_dim=M, decoder_dim=D, attention_dim=A, dropout=0.0
    ).eval()
    with torch.no_grad():
        decoder.L_o.bias[SPECIAL["end_index"]] = -1e4
    return decoder


def annotations(size: str | tuple, batch: int, seed: int = 1) -> torch.Tensor:
    P, E, *_ = SIZES[size] if isinstance(size, str) else size
    return torch.randn(batch, P, E, generator=torch.Generator().manual_seed(seed)).relu()  # (B,P,E), as after a ReLU


def caption_batches(V: int, B: int, T: int = 16, count: int = 4, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """`count` batches of B captions (B,T) of 8 to T tokens (<start> and <end> included; one of T in each batch),
    padded, and their lengths (B,)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        lengths = torch.randint(8, T + 1, (B,), generator=generator)
        lengths[0] = T
        captions = torch.randint(3, V, (B, T), generator=generator)
        captions[:, 0] = SPECIAL["start_index"]
        captions[torch.arange(B), lengths - 1] = SPECIAL["end_index"]
        captions[torch.arange(T) >= lengths.unsqueeze(1)] = SPECIAL["pad_index"]
        out.append((captions, lengths))
    return out


IMAGE_SIZES = [(640, 480), (480, 640), (640, 427), (500, 375), (427, 640)]  # COCO's commonest image sizes
TYPES = 10_000  # word types: COCO's vocabulary at min_word_count 5 is about this size
COCO = {"train": 82_783, "restval": 30_504, "val": 5_000, "test": 5_000}  # Karpathy's split of COCO 2014


def write_images(folder: Path, names: list[str], distinct: int = 8, seed: int = 0) -> list[Path]:
    """JPEG files at COCO's sizes: `distinct` different ones (source_<i>.jpg, smooth noise), and `names` linked to
    them in turn, so that every image is read and decoded as a real one would be. Returns the distinct files."""
    folder.mkdir(parents=True, exist_ok=True)
    generator = np.random.default_rng(seed)
    sources = []
    for i in range(distinct):
        width, height = IMAGE_SIZES[i % len(IMAGE_SIZES)]
        coarse = generator.integers(0, 256, (height // 16 + 1, width // 16 + 1, 3), dtype=np.uint8)
        smooth = Image.fromarray(coarse).resize((width, height), Image.BICUBIC)
        noise = generator.normal(0, 12, (height, width, 3))
        pixels = np.clip(np.asarray(smooth, dtype=np.float32) + noise, 0, 255).astype(np.uint8)
        source = folder / f"source_{i}.jpg"
        Image.fromarray(pixels).save(source, quality=90)
        sources.append(source)
    for i, name in enumerate(names):
        os.symlink(sources[i % distinct].name, folder / name)
    return sources


def write_split(root: Path, counts: dict[str, int], seed: int = 0) -> int:
    """A synthetic Karpathy split of COCO's shape: `root/dataset_coco.json` (five captions an image of 7 + Poisson(3.5)
    words, COCO's mean; words from a Zipf distribution over TYPES types, each used at least five times in the
    training captions where there is room, so that min_word_count 5 gives COCO's vocabulary) and the images under
    root/train2014 and root/val2014 (`write_images`). `counts`: images per split (train, restval, val, test).
    Returns the number of images."""
    generator = np.random.default_rng(seed)
    total = sum(counts.values())
    lengths = 7 + generator.poisson(3.5, (total, 5))
    ranks = 1.0 / np.arange(1, TYPES + 1)
    words = generator.choice(TYPES, size=int(lengths.sum()), p=ranks / ranks.sum())
    train_words = int(lengths[: counts["train"] + counts["restval"]].sum())
    covered = min(train_words, 5 * TYPES)
    words[generator.permutation(train_words)[:covered]] = np.arange(covered) % TYPES
    vocabulary = [f"w{i}" for i in range(TYPES)]
    images, position, index = [], 0, 0
    folders = {"train": "train2014", "restval": "val2014", "val": "val2014", "test": "val2014"}
    names: dict[str, list[str]] = {"train2014": [], "val2014": []}
    for split, count in counts.items():
        for _ in range(count):
            sentences = []
            for length in lengths[index]:
                tokens = [vocabulary[w] for w in words[position : position + length]]
                position += length
                sentences.append({"tokens": tokens, "raw": " ".join(tokens)})
            name = f"COCO_{folders[split]}_{index:012d}.jpg"
            names[folders[split]].append(name)
            images.append(
                {"filepath": folders[split], "filename": name, "split": split, "cocoid": index, "sentences": sentences}
            )
            index += 1
    for folder, files in names.items():
        write_images(root / folder, files)
    (root / "dataset_coco.json").write_text(json.dumps({"images": images, "dataset": "coco"}))
    return total


# --- the tutorial's way (sgrvinod's a-PyTorch-Tutorial-to-Image-Captioning), written with captioner's layers --------


def tutorial_forward(decoder: AttentionDecoder, a: torch.Tensor, captions: torch.Tensor, lengths: torch.Tensor):
    """The tutorial decoder's teacher forcing: captions sorted by length, each word run on a slice of the captions
    still going (their lengths read to the host), the annotations' attention projection computed again at every
    word, the output layer word by word. Returns logits (B,T-1,V) and alphas (B,T-1,P) in the sorted order, and the
    order."""
    lengths, order = lengths.sort(descending=True)
    a, captions = a[order], captions[order]
    steps = (lengths - 1).tolist()
    h, c = decoder.init_state(a)
    B, T = captions.size(0), steps[0]
    logits = a.new_zeros(B, T, decoder.vocab_size)
    alphas = a.new_zeros(B, T, a.size(1))
    scorer = decoder.attention
    for t in range(T):
        n = sum(s > t for s in steps)
        e = scorer.v(torch.tanh(scorer.W(a[:n]) + scorer.U(h[:n]).unsqueeze(1))).squeeze(-1)  # (n,P)
        alpha = F.softmax(e, dim=1)
        context = torch.sigmoid(decoder.f_beta(h[:n])) * (alpha.unsqueeze(2) * a[:n]).sum(dim=1)  # (n,E)
        y = decoder.embedding(captions[:n, t])
        h, c = decoder.lstm(torch.cat([y, context], dim=1), (h[:n], c[:n]))
        logits[:n, t] = decoder.output(y, h, context).float()
        alphas[:n, t] = alpha.float()
    return logits, alphas, order


def tutorial_beam_search(decoder: AttentionDecoder, a: torch.Tensor, K: int, max_len: int) -> list[int]:
    """The tutorial's beam search for one image (1,P,E), as its caption.py runs it: its K beams shrink as they end,
    which the host reads at every word; the annotations' attention projection is computed at every word."""
    V, end = decoder.vocab_size, SPECIAL["end_index"]
    a = a.expand(K, *a.shape[1:])
    words = torch.full((K, 1), SPECIAL["start_index"], device=a.device)
    scores = torch.zeros(K, 1, device=a.device)
    h, c = decoder.init_state(a)
    complete, complete_scores = [], []
    scorer = decoder.attention
    for step in range(max_len):
        k = words.size(0)
        e = scorer.v(torch.tanh(scorer.W(a[:k]) + scorer.U(h).unsqueeze(1))).squeeze(-1)
        context = torch.sigmoid(decoder.f_beta(h)) * (F.softmax(e, dim=1).unsqueeze(2) * a[:k]).sum(dim=1)
        y = decoder.embedding(words[:, -1])
        h, c = decoder.lstm(torch.cat([y, context], dim=1), (h, c))
        log_probs = scores + F.log_softmax(decoder.output(y, h, context), dim=1)  # (k,V)
        flat = log_probs[0] if step == 0 else log_probs.view(-1)
        scores, best = flat.topk(k)
        parent, word = best // V, best % V
        words = torch.cat([words[parent], word.unsqueeze(1)], dim=1)
        ended = (word == end).tolist()  # the host learns which beams ended: a sync at every word
        going = [i for i, e in enumerate(ended) if not e]
        complete += [words[i].tolist() for i, e in enumerate(ended) if e]
        complete_scores += [float(scores[i]) for i, e in enumerate(ended) if e]
        if not going:
            break
        words, scores = words[going], scores[going].unsqueeze(1)
        h, c = h[parent[going]], c[parent[going]]
    if not complete:
        return words[0].tolist()
    return complete[max(range(len(complete)), key=complete_scores.__getitem__)]


# --- the machine, timing and tables ------------------------------------------------------------------------------


def machine() -> str:
    """The device, the CPU model, torch's threads and version: the figures depend on all of them."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line]
        cpu = names[0] if names else cpu
    device = f"CUDA {torch.cuda.get_device_name()}; " if torch.cuda.is_available() else ""
    return f"{device}{cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (a timer's end on CUDA; nothing to wait for on a CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], calls: int, warmup: int = 1, device: torch.device | str = "cpu") -> float:
    """The median seconds of `calls` calls of fn, after `warmup` untimed ones; the device's queue is drained before
    and after each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def table(rows: list[dict]) -> str:
    """A Markdown table of the rows' keys (the first row's, then any others'); a key a row lacks is an empty cell."""
    keys = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(keys) + " |", "|" + "|".join("---" for _ in keys) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(row.get(k, "")) for k in keys) + " |" for row in rows])


def one_line(error: BaseException) -> str:
    """An error as one line: its type and the first line of its message, cut at 300 characters."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def fail_if_asked(*labels: object) -> None:
    """Raises where the environment's BENCHMARKS_FAIL (labels separated by "|") names one of `labels`: how a test
    makes a form fail, to see its table go on (tests/test_benchmarks.py)."""
    asked = [label for label in os.environ.get("BENCHMARKS_FAIL", "").split("|") if label]
    if any(str(label) == wanted for label in labels for wanted in asked):
        raise RuntimeError(f"made to fail (BENCHMARKS_FAIL names {', '.join(map(str, labels))})")


class Table:
    """A table of measurements that cannot be lost: each row is printed, and appended to `<out>/<name>.jsonl`, as
    soon as it is measured; `finish` prints the whole table and writes `<out>/<name>.md`. A form that fails is a row
    that says so, with its error in one line, and the table goes on; once `deadline` (time.monotonic()) has passed,
    a form is not started and its row says so."""

    def __init__(self, name: str, title: str, out: Path | None = None, deadline: float | None = None):
        self.name, self.title, self.out, self.deadline = name, title, out, deadline
        self.rows: list[dict] = []
        print(f"\n{title}\n", flush=True)

    def add(self, row: dict) -> dict:
        self.rows.append(row)
        print(f"row: {json.dumps(row)}", flush=True)
        if self.out is not None:
            with (self.out / f"{self.name}.jsonl").open("a") as file:
                file.write(json.dumps(row) + "\n")
        return row

    def measure(self, row: dict, fn: Callable[[], dict]) -> dict:
        """The row `row` with what fn() measured (a dict of columns); or, if fn raises or the deadline has passed,
        with an "error" column."""
        if self.deadline is not None and time.monotonic() > self.deadline:
            return self.add({**row, "error": "not run: the part's time budget was spent"})
        try:
            fail_if_asked(*row.values())
            values = fn()
        except Exception as err:  # a failing form is a row; the table goes on
            print(f"{self.name}: {row} failed:", file=sys.stderr, flush=True)
            traceback.print_exc()
            values = {"error": one_line(err)}
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return self.add({**row, **values})

    def finish(self, note: str = "") -> str:
        text = f"{self.title}{note}\n\n{table(self.rows)}" if self.rows else f"{self.title}: no rows"
        print(f"\n{text}\n", flush=True)
        if self.out is not None:
            (self.out / f"{self.name}.md").write_text(text + "\n")
        return text


def deadline(budget: float | None) -> float | None:
    """The time.monotonic() by which a script given `budget` seconds starts no more forms."""
    return None if budget is None else time.monotonic() + budget


def out_folder(path: str | None) -> Path | None:
    if path is None:
        return None
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder
