"""Speed on one CUDA GPU: the training step and beam search at the paper's sizes, side by side in one process with
the popular PyTorch tutorial's way of writing them, and one `captioner fit --config configs/shapes.yaml` run.

    python benchmarks/gpu.py            # on a machine with CUDA; without it, one line and exit 0
    python benchmarks/gpu.py --smoke    # the whole script at tiny sizes on the CPU: checks the script, measures nothing

1. Training, captions/s (forward, loss, backward, gradient clipping at 5, Adam), at the paper's sizes (P=196, E=2048,
   D=A=M=512, V=10,000), batches of 64 and 256 captions of 8-16 words:
   - the tutorial's decoder (sgrvinod's a-PyTorch-Tutorial-to-Image-Captioning, written here with captioner's layers):
     captions sorted by length, each word run on a slice of the captions still going, the attention projection of
     the annotations computed again at every word, the output layer word by word;
   - captioner eager: the shrinking batch (`--model.compile=false`);
   - captioner compiled: the fixed-shape step under torch.compile(mode="reduce-overhead") (`--model.compile`, the
     default on CUDA), with the time its first steps took to compile.
   Each in float32 with TF32 matmuls (the CLI's default on CUDA) and under bf16 autocast (bf16-mixed).
2. Beam 3, images/s, at the paper's sizes, with a random decoder that writes 16 words for every image: one image at a
   time and 64 at once. The tutorial's beam search runs one image at a time, its beams shrinking as they end, with a
   device-to-host copy at every word. captioner's runs sync-free (the default on CUDA), shrinking (the CPU's form),
   and with the decoder's steps compiled (`Captioner.load(..., compile_decoder=True)`).
3. `captioner fit --config configs/shapes.yaml` on the GPU, in a temporary folder: the time to make the data and build
   the feature cache, the training batches' time and the validation time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import SPECIAL, table
from lightning.pytorch.callbacks import Callback

from captioner.models.decoder import AttentionDecoder
from captioner.models.decoding import beam_search
from captioner.models.show_attend_tell import ShowAttendTell, caption_loss

PAPER = {"P": 196, "E": 2048, "D": 512, "A": 512, "M": 512, "V": 10000}
TINY = {"P": 9, "E": 1280, "D": 12, "A": 10, "M": 8, "V": 30}  # --smoke
MAX_LEN = 16
REPO = Path(__file__).resolve().parent.parent


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def model(sizes: dict, device: torch.device) -> ShowAttendTell:
    """A ShowAttendTell at `sizes` (at the paper's: a ResNet-101 pooled to 14x14). Its encoder is never run: the
    steps take annotations, as training on the feature cache does."""
    torch.manual_seed(0)
    decoder = {"embed_dim": sizes["M"], "decoder_dim": sizes["D"], "attention_dim": sizes["A"], "dropout": 0.5}
    if sizes is PAPER:
        m = ShowAttendTell(sizes["V"], backbone="resnet101", pretrained=False, grid_size=14, **decoder)
    else:  # --smoke: EfficientNet-Lite0 pooled to 3x3
        m = ShowAttendTell(sizes["V"], pretrained=False, grid_size=3, **decoder)
    assert (m.encoder.num_pixels, m.encoder.out_dim) == (sizes["P"], sizes["E"])
    return m.to(device).train()


def batches(sizes: dict, B: int, device: torch.device, count: int = 4) -> list[tuple[torch.Tensor, ...]]:
    """`count` batches of B captions of 8 to 16 tokens (<start> and <end> included), and annotations (B,P,E)."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        lengths = torch.randint(8, MAX_LEN + 1, (B,), generator=generator)
        lengths[0] = MAX_LEN
        captions = torch.randint(3, sizes["V"], (B, MAX_LEN), generator=generator)
        captions[:, 0] = SPECIAL["start_index"]
        captions[torch.arange(B), lengths - 1] = SPECIAL["end_index"]
        captions[torch.arange(MAX_LEN) >= lengths.unsqueeze(1)] = SPECIAL["pad_index"]
        a = torch.randn(B, sizes["P"], sizes["E"], generator=generator).relu()
        out.append((a.to(device), captions.to(device), lengths.to(device)))
    return out


def tutorial_forward(decoder: AttentionDecoder, a: torch.Tensor, captions: torch.Tensor, lengths: torch.Tensor):
    """The tutorial decoder's teacher forcing: sorted captions, a shrinking slice per word (its lengths read to the
    host), the annotations' attention projection at every word, the output layer word by word."""
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
    return logits, alphas


def training_rate(sizes: dict, B: int, form: str, bf16: bool, device: torch.device) -> tuple[float, float]:
    """Captions/s of one form of the step ("tutorial", "eager", "compiled"), and the seconds the first pass took."""
    torch.compiler.reset()
    m = model(sizes, device)
    if form == "compiled":  # --smoke: Dynamo's capture only, not Inductor's minutes of C++ compiling
        m.compile_step(**({"mode": "reduce-overhead"} if device.type == "cuda" else {"backend": "aot_eager"}))
    optimizer = torch.optim.Adam(m.parameters(), lr=4e-4)
    data = batches(sizes, B, device)

    def step(a, captions, lengths):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            if form == "tutorial":
                logits, alphas = tutorial_forward(m.decoder, a, captions, lengths)
                order = lengths.argsort(descending=True)
                loss = caption_loss(logits, captions[order, 1:], alphas, m.alpha_c).loss
            else:
                loss = m(captions, lengths, annotations=a).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 5.0)
        optimizer.step()

    start = time.perf_counter()
    for batch in data * 2:  # the first pass compiles each batch's caption length; the second runs them once more
        step(*batch)
    sync(device)
    first = time.perf_counter() - start
    rounds = 5 if device.type == "cuda" else 1
    start = time.perf_counter()
    for _ in range(rounds):
        for batch in data:
            step(*batch)
    sync(device)
    return rounds * len(data) * B / (time.perf_counter() - start), first


def tutorial_beam_search(decoder: AttentionDecoder, a: torch.Tensor, K: int, max_len: int) -> list[int]:
    """The tutorial's beam search for one image (1,P,E): its K beams shrink as they end, which is read on the host
    at every word; the annotations' attention projection is computed at every word."""
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


def decoding_rates(sizes: dict, device: torch.device) -> list[dict]:
    torch.manual_seed(0)
    decoder = AttentionDecoder(sizes["V"], sizes["E"], sizes["P"], sizes["M"], sizes["D"], sizes["A"], dropout=0.0)
    decoder = decoder.to(device).eval()
    with torch.no_grad():
        decoder.L_o.bias[SPECIAL["end_index"]] = -1e4  # every search writes MAX_LEN words
    compiled = AttentionDecoder(sizes["V"], sizes["E"], sizes["P"], sizes["M"], sizes["D"], sizes["A"], dropout=0.0)
    compiled.load_state_dict(decoder.state_dict())
    # As Captioner.load(..., compile_decoder=True) on CUDA: CUDA graphs. --smoke: Dynamo's capture only, as above
    options = {"mode": "reduce-overhead"} if device.type == "cuda" else {"backend": "aot_eager"}
    compiled = compiled.to(device).eval().compile_steps(**options)
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(64, sizes["P"], sizes["E"], generator=generator).relu().to(device)
    calls = {1: 20, 64: 3} if device.type == "cuda" else {1: 2, 64: 1}

    def rate(search, batch: int) -> float:
        search(images[:batch])  # warm up (and compile)
        search(images[:batch])
        sync(device)
        start = time.perf_counter()
        for i in range(calls[batch]):
            search(images[i % 64 : i % 64 + 1] if batch == 1 else images)
        sync(device)
        return calls[batch] * batch / (time.perf_counter() - start)

    def captioner(d, sync_free):
        return lambda a: beam_search(d, a, beam_size=3, max_len=MAX_LEN, sync_free=sync_free, **SPECIAL)

    def tutorial(a):
        for i in range(a.size(0)):  # one image at a time, as the tutorial's caption.py does
            tutorial_beam_search(decoder, a[i : i + 1], 3, MAX_LEN)

    rows = []
    with torch.inference_mode():
        forms = {
            "tutorial, one image at a time": tutorial,
            "captioner, sync-free (default on CUDA)": captioner(decoder, True),
            "captioner, shrinking (CPU's form)": captioner(decoder, False),
            "captioner, sync-free, compile_decoder": captioner(compiled, True),
        }
        for name, search in forms.items():
            rows.append({"beam 3": name, "batch 1": rate(search, 1), "batch 64": rate(search, 64)})
    base = dict(rows[0])
    for row in rows:
        row["batch 1"] = f"{row['batch 1']:.1f} ({row['batch 1'] / base['batch 1']:.2f}x)"
        row["batch 64"] = f"{row['batch 64']:.1f} ({row['batch 64'] / base['batch 64']:.2f}x)"
    return rows


class PhaseTimes(Callback):
    """Splits a fit's time into setup (the data made, the feature cache built: everything before the first batch),
    training (batches, compiling included) and validation (the sanity check included); writes them as JSON."""

    def __init__(self, output: str):
        self.output = output
        self.seconds = {"setup": 0.0, "training": 0.0, "validation": 0.0}
        self.phase, self.last = "setup", time.perf_counter()

    def enter(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[self.phase] += now - self.last
        self.phase, self.last = phase, now

    def on_fit_start(self, trainer, pl_module):  # after the datamodule's setup: the cache is built by now
        self.seconds["setup"] = time.perf_counter() - START
        self.phase, self.last = "training", time.perf_counter()

    def on_train_epoch_start(self, trainer, pl_module):
        self.enter("training")

    def on_validation_start(self, trainer, pl_module):
        self.enter("validation")

    def on_validation_end(self, trainer, pl_module):
        self.enter("training")

    def on_fit_end(self, trainer, pl_module):
        self.enter("training")
        Path(self.output).write_text(json.dumps(self.seconds))


START = time.perf_counter()  # in the fit's process: imported as its config is read, before the data are made


def shapes_fit(smoke: bool) -> dict[str, float]:
    """`captioner fit --config configs/shapes.yaml` as a user runs it, in an empty temporary folder (so that the
    data are made and the cache built); seconds per phase."""
    config = REPO / "configs" / ("debug.yaml" if smoke else "shapes.yaml")
    with tempfile.TemporaryDirectory() as folder:
        times = Path(folder) / "times.json"
        timer = json.dumps({"class_path": "gpu.PhaseTimes", "init_args": {"output": str(times)}})
        command = [sys.executable, "-m", "captioner.cli", "fit", f"--config={config}", f"--trainer.callbacks+={timer}"]
        start = time.perf_counter()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
        }
        subprocess.run(command, cwd=folder, env=env, check=True)
        total = time.perf_counter() - start
        return {"total (with start-up)": total, **json.loads(times.read_text())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: checks the script only")
    parser.add_argument("--skip-fit", action="store_true", help="leave out the shapes fit")
    parser.add_argument("--skip-training", action="store_true", help="leave out the training steps' table")
    options = parser.parse_args()
    if not options.smoke and not torch.cuda.is_available():
        print("gpu.py: no CUDA device here; it measures GPU speed only (docs/benchmarks.md, 'On a GPU')")
        return
    device = torch.device("cpu" if options.smoke else "cuda")
    sizes = TINY if options.smoke else PAPER
    torch.set_float32_matmul_precision("high")  # TF32, what `captioner fit` sets on CUDA by default
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (smoke run: not a measurement)"
    print(f"# gpu.py on {name}, torch {torch.__version__}\n", flush=True)

    rows = []
    for B in () if options.skip_training else (64, 256):
        for bf16 in (False, True):
            rates = {form: training_rate(sizes, B, form, bf16, device) for form in ("tutorial", "eager", "compiled")}
            base = rates["tutorial"][0]
            rows.append(
                {
                    "batch": B,
                    "precision": "bf16-mixed" if bf16 else "float32 (TF32)",
                    "tutorial": f"{base:.0f}",
                    "captioner eager": f"{rates['eager'][0]:.0f} ({rates['eager'][0] / base:.2f}x)",
                    "captioner compiled": f"{rates['compiled'][0]:.0f} ({rates['compiled'][0] / base:.2f}x)",
                    "compiled: first 8 steps, s": f"{rates['compiled'][1]:.1f}",
                }
            )
            print(f"training B={B} bf16={bf16}: {rows[-1]}", flush=True)
    if rows:
        print("\ntraining, captions/s at the paper's sizes\n")
        print(table(rows), flush=True)

    print("\nbeam 3, images/s at the paper's sizes (16 words per image)\n")
    print(table(decoding_rates(sizes, device)), flush=True)

    if not options.skip_fit:
        seconds = shapes_fit(options.smoke)
        print(f"\n`captioner fit --config configs/{'debug' if options.smoke else 'shapes'}.yaml`, seconds\n")
        print(table([{phase: f"{value:.1f}" for phase, value in seconds.items()}]), flush=True)


if __name__ == "__main__":
    sys.exit(main())
