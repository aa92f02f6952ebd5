"""Options in combination: real `captioner fit` runs through the CLI, then test, predict, `Captioner.load(...).caption`,
export (beyond `make test`'s slice, to ONNX too: the same captions) and a `--ckpt_path last` resume, over a pairwise
covering set of the options' values: every pair of values of two options meets in at least one run (not the full
product, which is 589,824 runs).

Each run ends with exit status 0, finite logged metrics and files that load, or, for a combination refused on purpose
(self-critical training with hard attention), one `error:` line and status 2; never a traceback, never a hang (each
command has a timeout). The runs use the shipped configs/debug.yaml, logger and checkpointing on, overriding paths,
sizes and the options under test. A run of one process runs in the test's own process, through the script's `main`
(Dynamo's caches emptied first, as a new process starts with them empty); a run of two DDP processes runs in processes
of its own. The compiled step is compiled with backend aot_eager (Dynamo's and AOTAutograd's graphs, without
Inductor's code generation, which takes minutes per graph on 2 cores; tests/test_compile.py -m slow runs Inductor),
in one process under the CUDA-graph stand-in (tests/cuda_graphs.py), as on CUDA, where it is captured as CUDA graphs.

`make test` keeps two combinations: one training run and the refused one. .ci/run runs every combination, after
`make test` (`-m ci`); `pytest tests/test_option_matrix.py -m matrix -v` lists them with their results.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from captioner import lit_module
from captioner.api import Captioner
from captioner.cli import run_lightning_cli
from captioner.data.shapes import ShapesDataset
from captioner.models.show_attend_tell import compile_options
from captioner.onnx import Captioner as OnnxCaptioner
from tests.conftest import REPO, Ran, run_main, tiny_fit_args
from tests.cuda_graphs import cuda_graph_stand_in
from tests.helpers import compare, logged, metrics_csvs

FACTORS: dict[str, tuple] = {
    "attention": ("soft", "hard"),
    "objective": ("xe", "scst"),
    "compile": ("plain", "compiled"),
    "precision": ("32", "bf16-mixed", "bf16-true", "16-true"),  # the -true ones are refused
    "accumulate": (1, 2),
    "fine_tune": (0, 1),
    # a checkpoint that holds its fine-tuned encoder, or one that left its pretrained encoder out
    "init_from": ("none", "tuned", "frozen"),
    "image_size": (224, 256),  # 256: an 8x8 grid, and a start trained at 224
    "size": ("tiny", "default"),
    "baseline": ("others", "greedy"),  # SCST's baseline: a value of its own only in SCST runs
    "devices": (1, 2),
    "inputs": ("features", "image_cache"),  # the feature cache (where the encoder is frozen), or the image cache
    "captions": ("per_caption", "grouped"),  # all (SCST: random), or batches of images with 2 captions each
    "entropy": (0.0, 0.5),  # the weight of the penalty on each word's attention entropy (not the paper's: 0)
    "initial_state": ("mean", "zeros"),  # the LSTM's start: from the mean annotation (the paper's), or zeros
    # the encoder: EfficientNet-Lite0 (pretrained), or a timm ConvNeXt or ViT (tiny, random: no hub here)
    "backbone": ("lite0", "convnext", "vit"),
    # where the splits, vocabulary and caches go: the data folder (the default), or a folder of their own (cache_dir)
    "cache_dir": ("beside", "elsewhere"),
    # Lightning's exponential moving average of the weights (EMAWeightAveraging), validated and saved in their place
    "averaging": ("none", "ema"),
}
BACKBONES = {"lite0": [], "convnext": ["--model.backbone=convnext_atto", "--model.pretrained=false"]}
BACKBONES["vit"] = ["--model.backbone=vit_tiny_patch16_224", "--model.pretrained=false"]
Row = dict[str, object]


def refusal(row: Row) -> str | None:
    """The one error line of a combination refused by design (None for the others), in the order they are checked."""
    if row["attention"] == "hard" and row["objective"] == "scst":  # not with hard attention's own REINFORCE
        return "error: objective scst needs soft attention: hard attention's own REINFORCE is not combined with it"
    if str(row["precision"]).endswith("-true"):  # weights cast to half precision
        return (
            f"error: precision {row['precision']} casts the weights themselves, which captioner does not train in: "
            "its inputs and feature cache are float32; use bf16-mixed or 16-mixed (autocast on float32 weights)"
        )
    return None


def refused(row: Row) -> bool:
    return refusal(row) is not None


def pairs(row: Row) -> set[tuple]:
    """The pairs of (option, value) that a run of `row` tries together."""
    items = [(k, v) for k, v in row.items() if k != "baseline" or row["objective"] == "scst"]
    return set(itertools.combinations(items, 2))


# What decides whether a row is refused, and whether its baseline counts (`refusal`, `pairs`): a row holding a pair
# of values can be made valid, if at all, by these options alone, the others at their first values.
DECIDING = ("attention", "objective", "precision")


def completions(fixed: Row) -> list[Row]:
    """The rows that hold the values `fixed`, every other option at its first value but those of `DECIDING`, which
    take each of their values: among them is a valid row holding a pair, if any valid row holds it."""
    free = [k for k in DECIDING if k not in fixed]
    rows = []
    for values in itertools.product(*(FACTORS[k] for k in free)):
        rows.append({k: v[0] for k, v in FACTORS.items()} | dict(zip(free, values, strict=True)) | fixed)
    return rows


def wanted_pairs() -> set[tuple]:
    """Every pair of values of two options that some valid row holds (`completions` finds it without the product of
    every option's values, which is 589,824 rows)."""
    items = [(k, v) for k, values in FACTORS.items() for v in values]
    wanted = set()
    for a, b in itertools.combinations(items, 2):
        if a[0] != b[0] and any(not refused(row) and (a, b) in pairs(row) for row in completions(dict([a, b]))):
            wanted.add((a, b))
    return wanted


def covering_rows(seed: int = 0, candidates: int = 256) -> list[Row]:
    """A small set of valid rows in which every pair that some valid row holds is met at least once (greedy: each
    new row is the best of `candidates` valid rows that hold the first pair not met yet, the others' values drawn at
    random: the one that meets the most pairs not met yet), then one refused combination per refusal."""
    order = {item: i for i, item in enumerate((k, v) for k, values in FACTORS.items() for v in values)}
    unmet = wanted_pairs()
    rng, rows = random.Random(seed), []
    while unmet:
        target = min(unmet, key=lambda pair: (order[pair[0]], order[pair[1]]))  # each new row meets this pair
        drawn = []
        while len(drawn) < candidates:
            row = {k: rng.choice(values) for k, values in FACTORS.items()} | dict(target)
            if not refused(row) and target in pairs(row):
                drawn.append(row)
        best = max(drawn, key=lambda row: len(pairs(row) & unmet))
        rows.append(best)
        unmet -= pairs(best)
    refusals: dict[str, Row] = {}
    for fixed in ({"attention": "hard", "objective": "scst"}, {"precision": "bf16-true"}, {"precision": "16-true"}):
        row = {k: v[0] for k, v in FACTORS.items()} | fixed  # each refusal's combination of first values
        refusals.setdefault(refusal(row), row)
    return [*rows, *refusals.values()]


SEED, ROWS_AT_MOST = 126, 15  # of seeds 0-299, the first that gives the fewest rows (12 valid, 3 refused)
ROWS = covering_rows(seed=SEED)  # among them a cheap one for `make test` (`fast`)
BASE: Row = {k: values[0] for k, values in FACTORS.items()}  # every option at its first value


def name(row: Row) -> str:
    parts = [
        str(row["attention"]),
        str(row["objective"]) + (f"-{row['baseline']}" if row["objective"] == "scst" else ""),
        str(row["compile"]),
        {"32": "fp32"}.get(str(row["precision"]), str(row["precision"])),
        f"accumulate{row['accumulate']}",
        f"finetune{row['fine_tune']}",
        "no-init" if row["init_from"] == "none" else f"init-{row['init_from']}",
        f"image{row['image_size']}",
        str(row["size"]),
        "ddp2" if row["devices"] == 2 else "1proc",
        "imagecache" if row["inputs"] == "image_cache" else "featurecache",
        str(row["captions"]),
        f"entropy{row['entropy']:g}",
        f"start-{row['initial_state']}",
        str(row["backbone"]),
        f"caches-{row['cache_dir']}",
        f"average-{row['averaging']}",
    ]
    return "-".join(parts)


def fast(row: Row) -> bool:
    """The default run's slice: the refused combinations, and the first run of one process, a tiny model and no
    compile (the cheapest kind: a compiled row took 60 s of `make test`, this one 30; test_compile covers the compiled
    step, and .ci/run every row)."""
    cheap = {"devices": 1, "size": "tiny", "compile": "plain"}
    first = next(r for r in ROWS if not refused(r) and cheap.items() <= r.items())
    return refused(row) or row is first


IN_CI = (pytest.mark.ci, pytest.mark.matrix)
PARAMS = [pytest.param(row, id=name(row), marks=() if fast(row) else IN_CI) for row in ROWS]


def captioner(capfd, *args: str, processes: int = 1, timeout: float = 300) -> Ran:
    """`captioner ARGS` in this process, or with `processes=2` (DDP) in processes of its own."""
    if processes == 1:
        torch.compiler.reset()
        return run_main(capfd, *args, timeout=timeout)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "captioner.cli", *args]
    try:
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`captioner {' '.join(args[:1])}` did not end within {timeout} s (a hang)")
    return Ran(result.returncode, result.stdout, result.stderr)


def ok(result: Ran) -> None:
    assert result.status == 0 and "Traceback" not in result.err, result.err[-4000:]


def options(row: Row, starts: dict[tuple[str, str], Path], root: Path) -> list[str]:
    args = ["--data.init_args.train_size=32", "--data.init_args.val_size=8", "--data.init_args.test_size=8"]
    args += ["--data.init_args.batch_size=8", "--trainer.limit_train_batches=4"]
    if row["attention"] == "hard":
        args.append("--model.attention_mode=hard")
    if row["objective"] == "scst":
        args += ["--model.objective=scst", "--data.init_args.train_captions=random"]
        args.append(f"--model.scst_baseline={row['baseline']}")
    if row["compile"] == "compiled":
        args += ["--model.compile=true", "--model.compile_backend=aot_eager"]
    if row["precision"] != "32":
        args.append(f"--trainer.precision={row['precision']}")
    args += [f"--trainer.accumulate_grad_batches={row['accumulate']}", f"--model.fine_tune_blocks={row['fine_tune']}"]
    if row["init_from"] != "none":
        start = starts[str(row["init_from"]), str(row["size"]), str(row["initial_state"]), str(row["backbone"])]
        args.append(f"--model.init_from={start}")
    if row["image_size"] != 224:
        args.append(f"--model.image_size={row['image_size']}")
    if row["size"] == "default":  # the library's own sizes (debug.yaml's are 32)
        args += ["--model.embed_dim=512", "--model.decoder_dim=512", "--model.attention_dim=512"]
    if row["devices"] == 2:
        args += ["--trainer.devices=2", "--trainer.strategy=ddp"]
    if row["inputs"] == "image_cache":
        args += ["--data.init_args.feature_cache=false", "--data.init_args.image_cache=true"]
    if row["entropy"]:
        args.append(f"--model.attention_entropy_penalty={row['entropy']}")
    if row["initial_state"] != "mean":
        args.append(f"--model.initial_state={row['initial_state']}")
    if row["captions"] == "grouped":
        args += ["--data.init_args.train_captions=grouped", "--data.init_args.captions_per_image=2"]
    if row["cache_dir"] == "elsewhere":
        args.append(f"--data.init_args.cache_dir={root / 'derived'}")
    if row["averaging"] == "ema":
        args += ["--trainer.callbacks+=lightning.pytorch.callbacks.EMAWeightAveraging", "--trainer.callbacks.decay=0.5"]
    return args + BACKBONES[str(row["backbone"])]


@pytest.fixture(scope="module")
def starts(tmp_path_factory) -> dict[tuple[str, str, str, str], Path]:
    """Checkpoints to start from (`init_from`) by kind, model size, initial state (a start from zeros has no f_init
    weights) and backbone, trained at 224 pixels when first asked for: "tuned" holds its fine-tuned encoder, "frozen"
    left its pretrained encoder out (a random timm encoder, which has no source, is kept)."""
    root = tmp_path_factory.mktemp("starts")

    class Lazy(dict):
        def __missing__(self, key: tuple[str, str, str, str]) -> Path:
            kind, size, initial_state, backbone = key
            folder = root / f"{kind}-{size}-{initial_state}-{backbone}"
            start = {"size": size, "fine_tune": int(kind == "tuned"), "initial_state": initial_state}
            start["backbone"] = backbone
            args = options({**BASE, **start}, {}, folder)
            run_lightning_cli(["fit", *tiny_fit_args(folder, *args)])
            self[key] = folder / "checkpoints" / "best.ckpt"
            return self[key]

    return Lazy()


@pytest.mark.parametrize("row", PARAMS)
def test_a_combination_of_options_trains_tests_predicts_captions_exports_and_resumes(
    row, starts, tmp_path, capfd, caplog
):
    def run(*args: str) -> Ran:  # fit, test and predict run in as many processes as the row's devices
        return captioner(capfd, *args, processes=int(row["devices"]))

    def fit_run(*args: str) -> Ran:
        """In this process, a compiled step compiles with the options a CUDA run gets, under the CUDA-graph stand-in
        (tests/cuda_graphs.py): where CUDA graphs are asked for (no gradient accumulation), each step's outputs and
        gradients are overwritten at the next, as a CUDA graph's replay overwrites them."""
        if row["compile"] != "compiled" or row["devices"] != 1:
            return run("fit", *args)
        with pytest.MonkeyPatch.context() as patch, cuda_graph_stand_in("aot_eager", graphs_only=True) as stand_in:
            patch.setattr(lit_module, "compile_options", lambda _, n, backend: compile_options("cuda", n, backend))
            ran = run("fit", *args)
        if row["objective"] == "xe" and ran.status == 0:  # SCST trains on its samples, not the compiled step
            assert (stand_in.calls > 0) == (row["accumulate"] == 1)
        return ran

    args = tiny_fit_args(tmp_path, *options(row, starts if row["init_from"] != "none" else {}, tmp_path))
    fit = fit_run(*args)
    if refused(row):
        errors = [line for line in fit.err.splitlines() if line.startswith("error:")]
        assert fit.status == 2 and "Traceback" not in fit.err, fit.err[-3000:]
        assert errors == [refusal(row)]
        return
    ok(fit)
    # the path that fed the training batches, said by the run (in its stderr; in this process, Lightning's logger may
    # write it where pytest's log capture finds it): a silent fallback would fail here
    reads = {"features": "the feature cache" if row["fine_tune"] == 0 else "the image files"}
    reads["image_cache"] = "the image cache"
    said = fit.err + caplog.text
    assert f"train split: the model reads {reads[str(row['inputs'])]} (" in said, said[-3000:]
    # what the run derived from the data (vocabulary, caches) went to cache_dir, or beside the data; shapes are drawn,
    # not read from files, so with a cache_dir of its own nothing at all lands in the data folder
    derived = tmp_path / ("derived" if row["cache_dir"] == "elsewhere" else "data")
    assert list(derived.glob("vocab-*.json")) and (row["cache_dir"] == "beside") == (tmp_path / "data").exists()
    cache = {"the feature cache": derived / "features", "the image cache": derived / "image_cache"}
    if reads[str(row["inputs"])] in cache:
        assert f"the model reads {reads[str(row['inputs'])]} ({cache[reads[str(row['inputs'])]]}" in said
    values = logged(tmp_path)
    assert {"train/loss_epoch", "val/loss", "val/bleu4"} <= values.keys(), values
    assert all(math.isfinite(value) for value in values.values()), values
    best, last = tmp_path / "checkpoints" / "best.ckpt", tmp_path / "checkpoints" / "last.ckpt"

    ok(run("test", *args, f"--ckpt_path={best}"))
    assert math.isfinite(logged(tmp_path)["test/bleu4"])
    output = tmp_path / "predictions.jsonl"
    ok(run("predict", *args, f"--ckpt_path={best}", f"--predictions.output={output}"))
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["index"] for r in records] == list(range(8))

    images = [ShapesDataset("test", 2, seed=9).load_image(i) for i in range(2)]
    results = Captioner.load(best).caption(images)
    exported = tmp_path / "model.pt"
    ok(captioner(capfd, "export", "--ckpt_path", str(best), "--output", str(exported)))
    assert [r.tokens for r in Captioner.load(exported).caption(images)] == [r.tokens for r in results]
    if not fast(row):  # the model's ONNX graphs write its captions (make test exports the bundled model: test_onnx)
        graphs = tmp_path / "onnx"
        ok(captioner(capfd, "export", "--ckpt_path", str(best), "--format", "onnx", "--output", str(graphs)))
        exact = OnnxCaptioner(graphs, resize="exact")  # torchvision's pixels: torch's captions
        compare(results, exact.caption(images), beam_size=3)  # a one-epoch model's near-ties

    ok(fit_run(*args, "--trainer.max_epochs=2", "--ckpt_path=last"))
    state = torch.load(last, map_location="cpu", weights_only=True)
    assert state["epoch"] == 1 and all(math.isfinite(value) for value in logged(tmp_path).values())
    # with weight averaging, the averaged weights are the model's, and the weights being trained are kept beside them
    # (the encoder left out of both where it is its pretrained source's)
    assert ("current_model_state" in state) == (row["averaging"] == "ema")
    if row["averaging"] == "ema" and "encoder_weights" in state:
        assert not any(".encoder." in key for key in state["current_model_state"])
    resumed = metrics_csvs(tmp_path)[-1]  # it went on from last.ckpt: the first epoch was not trained again
    assert {int(r["epoch"]) for r in resumed} == {1} and any(r.get("train/loss_epoch") for r in resumed), resumed


def test_the_rows_meet_every_pair_of_values_that_a_valid_run_can_hold():
    met = set().union(*(pairs(row) for row in ROWS if not refused(row)))
    assert met == wanted_pairs() and len(ROWS) <= ROWS_AT_MOST


def test_the_pairs_wanted_are_those_of_every_valid_row():
    """`wanted_pairs`, which the rows are checked against, is what the product of the options' values gives, on a
    smaller product: the options that decide refusals, with two others."""
    global FACTORS
    everything_factors = FACTORS
    try:
        FACTORS = {k: v for k, v in everything_factors.items() if k in (*DECIDING, "baseline", "devices", "backbone")}
        product = [dict(zip(FACTORS, values, strict=True)) for values in itertools.product(*FACTORS.values())]
        assert wanted_pairs() == set().union(*(pairs(row) for row in product if not refused(row)))
    finally:
        FACTORS = everything_factors
    refusals = [refusal(row) for row in ROWS if refused(row)]  # one row per refusal
    assert len(refusals) == 3 and set(refusals) == {
        refusal({**BASE, "attention": "hard", "objective": "scst"}),
        refusal({**BASE, "precision": "bf16-true"}),
        refusal({**BASE, "precision": "16-true"}),
    }
