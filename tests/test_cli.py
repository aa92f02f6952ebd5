import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image

from captioner.api import Captioner
from captioner.checkpoints import FINGERPRINT
from captioner.cli import main, run_lightning_cli
from captioner.data.shapes import ShapesDataset
from captioner.errors import CaptionerError
from tests.conftest import run_main, tiny_fit_args

CONFIGS = sorted(Path("configs").glob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_config_parses_through_the_cli(config, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    import timm

    from captioner.models.encoder import BACKBONES

    backbone = printed["model"]["backbone"]
    assert backbone in BACKBONES or timm.is_model(backbone)
    assert printed["checkpoint"]["monitor"].startswith("val/")
    assert "vocab" not in printed["model"]  # linked from the data at instantiation


def test_fast_dev_run_fit_on_cpu(tmp_path):
    main(["fit", *tiny_fit_args(tmp_path, "--trainer.fast_dev_run=true")])
    assert list((tmp_path / "data" / "features").glob("*/annotations.npy"))  # the frozen encoder's cache was built


def test_fit_writes_a_checkpoint_that_carries_its_vocabulary_and_runs_the_demo(tmp_path, capfd):
    main(["fit", *tiny_fit_args(tmp_path), "--ckpt_path", "last"])  # nothing to resume yet: a preemptible job's start
    said = capfd.readouterr().err
    assert f"no last.ckpt in {tmp_path / 'checkpoints'}: starting from scratch" in said and "save_last" not in said
    checkpoint = tmp_path / "checkpoints" / "best.ckpt"
    assert checkpoint.is_file() and (tmp_path / "checkpoints" / "last.ckpt").is_file()
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    vocab = state["hyper_parameters"]["vocab"]
    assert vocab[:4] == ["<pad>", "<start>", "<end>", "<unk>"] and "circle" in vocab
    # The frozen pretrained encoder is left out, to be rebuilt bit for bit: its fingerprint says which weights it was
    assert not any(key.startswith("model.encoder.") for key in state["state_dict"]) and state[FINGERPRINT]
    capfd.readouterr()
    main(["demo", "--ckpt_path", str(checkpoint), "--samples", "2", "--overlays", str(tmp_path / "overlays")])
    lines = capfd.readouterr().out.strip().splitlines()
    assert sum(line.strip().startswith("generated:") for line in lines) == 2
    assert lines[-1].startswith("val/bleu4=") and 0.0 <= float(lines[-1].split("=")[1]) <= 1.0
    captions = [line.split("generated:")[1].split() for line in lines if line.strip().startswith("generated:")]
    sheets = sorted((tmp_path / "overlays").glob("*.png"))
    assert [sheet.name for sheet in sheets] == ["test_0.png", "test_1.png"]
    for sheet, words in zip(sheets, captions, strict=True):  # the image, then one titled 192-pixel tile per word
        with Image.open(sheet) as picture:
            assert picture.size == (5 * 192, -(-(1 + len(words)) // 5) * (192 + 22) + 24)  # + the colour bar
    main(["demo", "--ckpt_path", str(checkpoint), "--samples", "0"])  # no image to caption: the score alone
    lines = capfd.readouterr().out.strip().splitlines()
    assert not any("generated:" in line for line in lines) and lines[-1].startswith("val/bleu4=")


def test_the_same_seed_trains_the_same_weights_with_or_without_a_built_feature_cache(tmp_path):
    """Building the feature cache must not draw from the global random generator, which the training's shuffling
    and dropout use after it: a run that builds the cache and a run that finds it built end with the same weights."""
    builds = run_lightning_cli(["fit", *tiny_fit_args(tmp_path)])
    cache = list((tmp_path / "data" / "features").glob("*/annotations.npy"))
    assert len(cache) == 2  # train and val, built by the first run
    built_at = [path.stat().st_mtime_ns for path in cache]
    reads = run_lightning_cli(["fit", *tiny_fit_args(tmp_path, f"--checkpoint.dirpath={tmp_path / 'again'}")])
    assert [path.stat().st_mtime_ns for path in cache] == built_at  # the second run read the cache
    first, second = builds.model.state_dict(), reads.model.state_dict()
    assert first.keys() == second.keys()
    for name, tensor in first.items():
        assert torch.equal(tensor, second[name]), name


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "captioner.cli", *args], capture_output=True, text=True, timeout=300)


def test_a_mistake_ends_the_process_with_status_2_and_one_line():
    """The `captioner` process itself (the mistakes below run in the test's process, through the same `main`)."""
    result = run_cli("fit", "--config", "configs/nope.yaml")
    assert result.returncode == 2 and result.stderr == "error: configs/nope.yaml: config file not found\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["fit", "--config", "configs/nope.yaml"], "configs/nope.yaml: config file not found"),
        (["fit", "--config", "configs/debug.yaml", "--model.backbone=vgg99"], "unknown backbone 'vgg99'"),
        (["fit", "--config", "configs/debug.yaml", "--model.alpha_c=-1"], "alpha_c (lambda) must be >= 0, got -1"),
        (["fit", "--config", "configs/debug.yaml", "--model.embed_dim=abc"], "model.embed_dim: expected int, got abc"),
        (
            ["fit", "--config", "configs/debug.yaml", "--model.attention_mode=sideways"],
            "model.attention_mode: expected Literal['soft', 'hard'], got sideways",  # refused as it is parsed
        ),
        (["demo", "--checkpoint", "missing.ckpt"], "missing.ckpt: checkpoint not found"),
        (["demo", "--checkpoint", "missing.ckpt", "--samples", "-1"], "--samples must be >= 0, got -1"),
    ],
)
def test_user_mistakes_give_one_line_and_no_traceback(args, message, tmp_path, capfd):
    ran = run_main(capfd, *args, *(["--data.init_args.data_dir", str(tmp_path)] if args[0] == "fit" else []))
    assert ran.status == 2
    assert "Traceback" not in ran.err
    errors = [line for line in ran.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], ran.err


@pytest.mark.parametrize("command", [["demo", "--checkpoint", "missing.ckpt"], ["caption", "missing.jpg"]])
def test_an_overlays_folder_that_cannot_be_made_is_one_line(command, tmp_path, capfd):
    taken = tmp_path / "taken"
    taken.write_text("a file, not a folder")
    ran = run_main(capfd, *command, "--overlays", str(taken))
    assert ran.status == 2 and "Traceback" not in ran.err
    assert ran.err.strip() == f"error: {taken}: cannot write overlays there: File exists"


def test_a_checkpoint_whose_encoder_cannot_be_rebuilt_the_same_is_one_line(tiny_checkpoint, tmp_path, capfd):
    state = torch.load(tiny_checkpoint, map_location="cpu", weights_only=True)
    state[FINGERPRINT] = "0" * 64  # as if trained with other pretrained weights than those installed here
    torch.save(state, tmp_path / "other.ckpt")
    ran = run_main(capfd, "demo", "--ckpt_path", str(tmp_path / "other.ckpt"))
    assert ran.status == 2 and "Traceback" not in ran.err
    assert ran.err.strip() == (
        f"error: {tmp_path / 'other.ckpt'}: it left out its efficientnet_lite0 weights, to be rebuilt from their "
        "pretrained source, and the efficientnet_lite0 weights here are not those it was trained with: install the same"
    )
    with pytest.raises(CaptionerError, match=r"other\.ckpt: it left out its efficientnet_lite0 weights, to be rebuilt"):
        Captioner.load(tmp_path / "other.ckpt")


def test_a_file_that_is_not_a_checkpoint_is_one_line(tmp_path, capfd):
    bogus = tmp_path / "bogus.ckpt"
    bogus.write_bytes(b"not a checkpoint")
    ran = run_main(capfd, "demo", "--checkpoint", str(bogus))
    assert ran.status == 2 and "Traceback" not in ran.err
    assert f"{bogus}: not a captioner checkpoint" in ran.err


def test_predict_writes_captions_as_json_lines(tiny_checkpoint, tmp_path):
    output = tmp_path / "predictions.jsonl"
    main(
        [
            "predict",
            *tiny_fit_args(
                tmp_path, f"--ckpt_path={tiny_checkpoint}", f"--predictions.output={output}", "--model.beam_size=2"
            ),
        ]
    )
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["index"] for r in records] == list(range(16))  # every test image of configs/debug.yaml, in order
    assert all(r["caption"].strip() and r["score"] < 0 for r in records)


@pytest.mark.parametrize("args", [[], ["--help"], ["-h"]])
def test_the_command_alone_or_with_help_lists_every_subcommand_without_importing_torch(args):
    command = [sys.executable, "-X", "importtime", "-m", "captioner.cli", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == (2 if not args else 0) and "Traceback" not in result.stderr
    listed = [line.split()[0] for line in result.stdout.splitlines() if line.startswith("  ")]
    assert listed == ["fit", "validate", "test", "predict", "caption", "evaluate", "export", "serve", "demo"]
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time")}
    assert "captioner.errors" in imported and not imported & {"torch", "lightning", "jsonargparse", "PIL"}


def test_fit_s_help_lists_the_values_of_every_option_that_has_a_fixed_set(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    assert exit_info.value.code == 0
    listed = set(re.findall(r"^  (--\S+) \{([^}]*)\}", capsys.readouterr().out, re.M))
    assert listed >= {
        ("--model.lr_schedule", "plateau,cosine,none"),
        ("--model.lr_monitor", "val/bleu4,val/cider"),
        ("--model.objective", "xe,scst"),
        ("--model.scst_baseline", "others,greedy"),
        ("--model.attention_mode", "soft,hard"),
        ("--model.feature_stride", "32,16"),
        ("--model.attention", "additive,dot,general"),
        ("--model.gate", "scalar,channel,none"),
        ("--model.initial_state", "mean,zeros"),
    }


@pytest.mark.parametrize("command", ["caption", "evaluate", "export", "serve", "demo"])
def test_every_option_is_described_with_its_default_and_the_checkpoint_is_spelled_as_in_fit(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    help_text = capsys.readouterr().out
    options = re.findall(r"^  (-[^ ,]+(?:[ ,][^ ]+)*?)(?:  +|\n)(.*?)(?=^  -|^\S|\Z)", help_text, re.M | re.S)
    assert len(options) >= 3
    for option, description in options:
        if option != "-h":
            assert len(description.split()) >= 3, (option, description)  # described, not a bare option
    text = " ".join(help_text.split())
    assert "--ckpt_path PATH, --checkpoint PATH" in text  # fit's spelling, and the old one still works
    defaults = {
        "caption": ["(default: 3)", "(default: 16)", "(default: the bundled model `shapes`, trained on synthetic"],
        "evaluate": ["(default: test)", "(default: evaluation)"],
        "serve": ["(default: 7860)", "(default: 25e6)", "(default: 30)", "(default: the bundled model `shapes`"],
        "demo": ["(default: 5)"],
        "export": [],
    }
    for default in defaults[command]:
        assert default in text, (command, default)


def test_the_command_line_passes_a_length_penalty_only_when_given():
    """Its default is defined once, in captioner.models.decoding, which `captioner --help` does not import."""
    import argparse

    from captioner import commands

    parser = argparse.ArgumentParser()
    commands._add_decoding(parser)  # caption's and evaluate's search options, handed on by commands._decoding
    assert commands._decoding(parser.parse_args([])) == {"beam_size": 3, "max_len": 30}
    assert commands._decoding(parser.parse_args(["--length-penalty", "0"])) == {"beam_size": 3, "max_len": 30,
                                                                           "length_penalty": 0.0}  # fmt: skip


def test_a_bundled_model_says_what_it_has_seen_whenever_it_captions(tmp_path, capsys, tiny_checkpoint):
    """Its card's note, once on stderr: the default model's with the reason it is used; a model of the user's, which
    has no card, says nothing."""
    image = tmp_path / "shapes.png"
    ShapesDataset("test", 1).load_image(0).save(image)
    shapes = "trained on synthetic shapes only: it describes coloured shapes, not photos"
    for args, note in (
        ([], f"note: no --ckpt_path given: the bundled model `shapes`, {shapes}\n"),
        (["--ckpt_path", "shapes"], f"note: shapes: {shapes}\n"),
        (["--ckpt_path", tiny_checkpoint], ""),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["caption", str(image), *args])
        assert exit_info.value.code == 0
        captured = capsys.readouterr()
        assert captured.out.startswith(f"{image}\t")
        assert captured.err == note


def test_evaluate_without_a_config_scores_the_data_the_checkpoint_was_trained_on(tiny_checkpoint, tmp_path, capsys):
    main(["evaluate", "--checkpoint", tiny_checkpoint, "--output", str(tmp_path), "--split", "val", "--beam-size", "1"])
    assert "%|" not in capsys.readouterr().err  # no progress bar when stderr is not a terminal
    captions = json.loads((tmp_path / "captions.json").read_text())
    assert sorted(c["image_id"] for c in captions) == list(range(16))  # configs/debug.yaml's 16 val images
    assert "Bleu_4" in json.loads((tmp_path / "metrics.json").read_text())


@pytest.mark.parametrize("ends", ["done", "refused"])
def test_a_command_destroys_the_process_group_before_it_exits(ends, tmp_path, monkeypatch):
    """A gloo group left to the interpreter's exit aborted a DDP `captioner test` that had done its work (CI, status -6,
    "terminate called without an active exception"): the command destroys it, whether it ended or refused in one
    line. Here a one-process gloo group stands in for the one Lightning starts."""
    import torch.distributed as dist

    from captioner import cli
    from captioner.errors import ConfigError

    def lightning(argv):
        store = dist.FileStore(str(tmp_path / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        dist.all_reduce(torch.ones(2))
        if ends == "refused":
            raise ConfigError("a refusal after the group started")

    monkeypatch.setattr(cli, "run_lightning_cli", lightning)
    try:
        if ends == "done":
            main(["test"])
        else:
            with pytest.raises(SystemExit) as exit_:
                main(["test"])
            assert exit_.value.code == 2
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():  # never leave a group to the tests after this one
            dist.destroy_process_group()


def test_ptb_scoring_without_java_is_refused_in_one_line_before_anything_is_decoded(tiny_checkpoint, tmp_path, capfd):
    """Without Java, `--ptb-tokenizer` stops at once, in one line that says what to do, before the split is decoded
    (not after it, with a traceback)."""
    import shutil as shell

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shell, "which", lambda name, *args, **kwargs: None if name == "java" else "/usr/bin/" + name)
        ran = run_main(capfd, "evaluate", "--ckpt_path", tiny_checkpoint, "--ptb-tokenizer", "--output", str(tmp_path))
    assert ran.status == 2 and ran.err.startswith(
        "error: --ptb-tokenizer runs coco-caption's PTB tokenizer, which needs"
    )
    assert "Traceback" not in ran.err and not (tmp_path / "metrics.json").exists()
