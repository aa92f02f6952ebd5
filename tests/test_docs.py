"""The docs cannot drift from the code: every `captioner ...` command in README.md, docs/*.md and data/README.md (in a
code block or inline) is checked without running it, against the CLI's own parsers: its subcommand exists, each
option it gives is one of that command's (with a value among its choices, where it has some), a Lightning command
parses whole (`--print_config`), and every path of the repository it names exists. So is every `python <script>.py`
command of benchmarks/ that the docs or the scripts' own docstrings show, against the script's parser. So do the
files the docs name, and the options of the README's table of `--model.<name>` options."""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import runpy
import shlex
from pathlib import Path

import pytest
import yaml

from captioner import cli
from captioner import commands as own_commands
from captioner.checkpoints import RENAMED
from tests.conftest import REPO

DOCS = [REPO / "README.md", REPO / "data" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LIGHTNING = ("fit", "validate", "test", "predict")
OURS = {"caption": own_commands.caption, "evaluate": own_commands.evaluate, "export": own_commands.export_model}
OURS |= {"serve": own_commands.serve, "demo": own_commands.demo}
BENCHMARKS = REPO / "benchmarks"
REPOSITORY_PATHS = ("configs/", "docs/", "notebooks/", "benchmarks/", "captioner/", "deploy/", "tests/", "data/README")


def commands(text: str) -> list[list[str]]:
    """Each `captioner` command in a markdown text, as its words after `captioner`: from code blocks (continued
    lines joined, comments left out) and inline code."""
    lines = []
    for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, re.S):
        lines += block.replace("\\\n", " ").splitlines()
    lines += re.findall(r"`((?:\.venv/bin/)?captioner [^`]+)`", text)
    found = []
    for line in lines:
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # not shell (a Python line with an unbalanced quote)
            continue
        while words and words[0] in ("srun", "torchrun"):
            words = words[1:]
        if words and Path(words[0]).name == "captioner":
            found.append([word for word in words[1:] if word != "..."])  # "..." elides the rest in prose
    return found


DOCUMENTED = [
    pytest.param(words, id=f"{path.relative_to(REPO)}: captioner {' '.join(words)}"[:150])
    for path in DOCS
    for words in commands(path.read_text(encoding="utf-8"))
]


class _Parsed(Exception):
    """Raised where a command would parse its arguments: the parser is all that is wanted of it."""

    def __init__(self, parser):
        self.parser = parser


def parser_of(command: str, monkeypatch):
    """The argparse parser of one of captioner's own commands, as it builds it (`captioner.commands._parser`)."""
    build = own_commands._parser

    def capturing(function, **kwargs):
        parser = build(function, **kwargs)

        def parsed(*args, **kwargs):
            raise _Parsed(parser)

        parser.parse_args = parser.parse_known_args = parsed
        return parser

    monkeypatch.setattr(own_commands, "_parser", capturing)
    with pytest.raises(_Parsed) as stopped:
        OURS[command]([])
    return stopped.value.parser


def check_ours(command: str, words: list[str], monkeypatch) -> None:
    parser = parser_of(command, monkeypatch)
    options = {o: action for action in parser._actions for o in action.option_strings}
    for i, word in enumerate(words):
        if not word.startswith("-") or word == "-":
            continue
        name, _, value = word.partition("=")
        if command == "evaluate" and name.startswith("--data."):  # the data's options, as in `captioner fit`
            continue
        assert name in options, f"`captioner {command}` has no option {name}"
        choices = options[name].choices
        if choices is not None:
            value = value or (words[i + 1] if i + 1 < len(words) else "")
            assert value in choices, f"`captioner {command} {name}` takes {sorted(choices)}, not {value!r}"


def check_lightning(words: list[str]) -> None:
    """The whole command through LightningCLI's parser, which prints the config it makes and stops."""
    with contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as stopped:
        cli.run_lightning_cli([*words, "--print_config"])
    assert stopped.value.code == 0


@pytest.mark.parametrize("words", DOCUMENTED)
def test_a_documented_command_is_one_the_cli_takes(words, monkeypatch):
    assert words, "`captioner` alone"
    command = words[0]
    assert command in cli.COMMANDS, f"no command {command!r}"
    for word in words:
        value = word.partition("=")[2] or word
        if value.startswith(REPOSITORY_PATHS):
            assert (REPO / value).exists(), f"{value}: not in the repository"
    if command in LIGHTNING:
        check_lightning(words)
    else:
        check_ours(command, words[1:], monkeypatch)


def test_the_docs_hold_commands_of_every_kind():
    """The extraction finds what the docs show: each command at least once (a broken pattern would check nothing)."""
    shown = {words[0] for words in (p.values[0] for p in DOCUMENTED)}
    assert shown >= {"fit", "test", "predict", "caption", "evaluate", "export", "serve"}, shown


def test_every_file_the_docs_name_is_in_the_repository():
    """A repository path or script named in the docs (`benchmarks/decode.py`, or a script by its name alone, such as
    `gpu_check.py`) exists."""
    scripts = {p.name for p in REPO.rglob("*.py") if ".venv" not in p.parts}
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for named in re.findall(r"`([\w./-]+\.(?:py|yaml|ipynb|md))`", text):
            if named.startswith(REPOSITORY_PATHS):
                assert (REPO / named).exists(), f"{path.name} names {named}, which is not in the repository"
            elif "/" not in named and named.endswith(".py"):
                assert named in scripts, f"{path.name} names {named}, which is no file of the repository"


def test_the_readme_s_model_options_are_the_cli_s():
    """Each option in the README's table of `--model.<name>` options is one the model takes (`--print_config`)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## The model and its options", 1)[1].split("\n## ", 1)[0]
    names = {name for row in re.findall(r"^\| (.+?) \|", section, re.M) for name in re.findall(r"`(\w+)`", row)}
    model = printed_config("configs/shapes.yaml")["model"]
    assert names and names <= model.keys(), sorted(names - model.keys())


def printed_config(config: str) -> dict:
    output = io.StringIO()
    with contextlib.redirect_stdout(output), pytest.raises(SystemExit):
        cli.run_lightning_cli(["fit", "--config", config, "--print_config"])
    return yaml.safe_load(output.getvalue())


def has(config: dict, keys: list[str]) -> bool:
    """Whether a printed config holds the key path `keys`."""
    node = config
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def test_every_option_the_docs_name_is_one_the_cli_takes():
    """An option named in prose (`--model.alpha_c=1`, `--data.init_args.cache_dir`, `--trainer.precision`) is one
    that `captioner fit` takes: a key of the config it prints, for the shapes set or for real captions."""
    configs = [printed_config(f"configs/{name}.yaml") for name in ("shapes", "coco_lite0")]
    pattern = r"--((?:model|trainer|data\.init_args|checkpoint|last_checkpoint)(?:\.\w+)+)"
    renamed = {f"model.{old}" for old in RENAMED}  # named as what they were, beside their new names
    for path in DOCS:
        for option in sorted(set(re.findall(pattern, path.read_text(encoding="utf-8"))) - renamed):
            keys = option.split(".")
            if keys[0] == "trainer" and keys[1:2] == ["callbacks"]:  # a list of classes: not keyed by name
                continue

            taken = any(has(config, keys) for config in configs)
            assert taken, f"{path.name} names --{option}, which fit does not take"


def test_what_the_docs_say_of_the_shipped_configs_is_what_they_hold():
    """What docs/usage.md says of the configs, checked in the configs as the CLI makes them: best.ckpt is chosen by
    val/bleu4 for configs/shapes.yaml and debug.yaml, by val/cider for every other config; configs/coco_resnet101.yaml
    runs its encoder on the image cache, not the 84.7 GiB feature cache (which it builds, given room, where the image
    cache is off)."""
    for path in sorted((REPO / "configs").glob("*.yaml")):
        printed = printed_config(f"configs/{path.name}")
        monitor = printed["checkpoint"]["monitor"]
        assert monitor == ("val/bleu4" if path.stem in ("shapes", "debug") else "val/cider"), (path.name, monitor)
    data = printed_config("configs/coco_resnet101.yaml")["data"]["init_args"]
    assert not data["feature_cache"] and data["image_cache"]


def test_what_the_docs_say_of_checkpoint_options_the_training_step_and_exports_is_what_the_code_does(
    monkeypatch, tmp_path, capfd
):
    """What the README and docs/usage.md say, run through the code. (1) `--checkpoint` is a file's option of caption,
    evaluate, export, serve and demo; on fit it is the group of the best checkpoint's options, and a file given there
    is refused. (2) The training step runs at fixed shapes, the padding masked, where `compile` is auto on CUDA, and
    shrinks on a CPU (the two give the same loss and gradients: tests/models/test_fixed_shape.py). (3) An export
    leaves out an encoder still equal to its pretrained source, and `export --include-encoder` keeps it."""
    import torch

    from captioner.checkpoints import model_file
    from captioner.errors import ConfigError
    from captioner.lit_module import CaptioningModule
    from tests.conftest import run_main

    for command in ("caption", "evaluate", "export", "serve", "demo"):
        parser = parser_of(command, monkeypatch)
        assert "--checkpoint" in {o for action in parser._actions for o in action.option_strings}, command
    with pytest.raises(ConfigError, match="checkpoint"):
        cli.run_lightning_cli(["fit", "--config", "configs/debug.yaml", "--checkpoint", "best.ckpt", "--print_config"])

    vocab = ["<pad>", "<start>", "<end>", "<unk>", "a"]
    module = CaptioningModule(vocab, embed_dim=8, decoder_dim=8, attention_dim=8, pretrained=False)
    assert not module.compiles_step() and not module.model.fixed_shape  # auto, on this CPU: the shrinking batch
    with monkeypatch.context() as patch:
        patch.setattr(CaptioningModule, "device", property(lambda self: torch.device("cuda")))
        assert module.compiles_step()  # auto on CUDA, where on_fit_start compiles the fixed-shape step:
    assert module.model.compile_training_step(backend="eager").fixed_shape

    monkeypatch.undo()  # the commands' parsers parse again (parser_of stopped them)
    for options, holds in (([], False), (["--include-encoder"], True)):
        output = tmp_path / f"model{len(options)}.pt"
        ran = run_main(capfd, "export", "--ckpt_path", "shapes", "--output", str(output), *options)
        assert ran.status == 0, ran.err[-2000:]
        assert model_file(output).has_encoder == holds


def benchmark_commands(text: str) -> list[tuple[str, list[str]]]:
    """Each `python <script>.py ...` command of a script in benchmarks/ that a text shows (in a code line, or inline,
    even where the line wraps), as the script's name and its arguments, up to a comment or a shell operator."""
    found = []
    scripts = {path.name for path in BENCHMARKS.glob("*.py")}
    spans = [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", text)]  # inline, wrapped or not
    lines = [line.split("`")[0] for line in text.splitlines()]  # code lines, docstrings' examples, up to any span
    for script, rest in re.findall(r"python3? (?:\S*/)?(\w+\.py)(.*)", "\n".join(spans + lines)):
        try:
            words = shlex.split(rest, comments=True)
        except ValueError:
            continue
        operator = next((i for i, word in enumerate(words) if word in ("&&", "||", ";", "|", ">", "2>&1")), None)
        if script in scripts:
            found.append((script, [word for word in words[:operator] if word != "..."]))
    return found


BENCHMARK_COMMANDS = [
    pytest.param(script, args, id=f"{path.relative_to(REPO)}: {script} {' '.join(args)}"[:150])
    for path in [*DOCS, *sorted(BENCHMARKS.glob("*.py"))]
    for script, args in benchmark_commands(path.read_text(encoding="utf-8"))
]


def test_the_docs_show_every_benchmark_script_s_command():
    """The extraction finds a command of each script (a broken pattern would check nothing)."""
    shown = {script for script, _ in (p.values for p in BENCHMARK_COMMANDS)}
    assert shown == {path.name for path in BENCHMARKS.glob("*.py")}, shown


@pytest.mark.parametrize("script, args", BENCHMARK_COMMANDS)
def test_a_documented_benchmark_command_is_one_its_script_takes(script, args, monkeypatch):
    """The script's own parser (benchmarks/common/harness.py's `Script`, stopped where it would parse) takes the
    command's arguments: each option is the script's, with a value it accepts."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    harness = importlib.import_module("common.harness")

    def start(self, note=""):
        raise _Parsed(self.parser)

    monkeypatch.setattr(harness.Script, "start", start)
    main = runpy.run_path(str(BENCHMARKS / script), run_name="documented")["main"]  # its module, not run as a script
    with pytest.raises(_Parsed) as stopped:
        main()
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        try:
            stopped.value.parser.parse_args(args)
        except SystemExit:
            pytest.fail(f"{script} {' '.join(args)}: {errors.getvalue().strip().splitlines()[-1]}")
