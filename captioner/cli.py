"""The `captioner` command: LightningCLI subcommands (fit, validate, test, predict), plus caption, evaluate, export,
serve and demo.

    captioner fit --config configs/shapes.yaml
    captioner demo --ckpt_path checkpoints/shapes/best.ckpt
    captioner caption photos/ --beam-size 3 --overlays overlays/
    captioner evaluate --config configs/coco_lite0.yaml --ckpt_path checkpoints/coco_lite0/best.ckpt
    captioner export --ckpt_path checkpoints/ucm/best.ckpt --output ucm.pt --float16
    captioner export --ckpt_path shapes --format onnx --output shapes_onnx/
    captioner serve --ckpt_path ucm --port 7860

The checkpoint is `--ckpt_path` in every command, as LightningCLI spells it (`--checkpoint` still works where it
used to). Mistakes in the user's input (a missing config, an unknown backbone, a negative weight) end with one
`error: ...` line on stderr and exit status 2, never a traceback. Nothing here imports torch before a command runs:
`captioner --help` answers at once.
"""

from __future__ import annotations

import pickle
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from captioner.commands import _check_config_paths, caption, demo, evaluate, export_model, serve
from captioner.errors import CaptionerError, ConfigError

if TYPE_CHECKING:
    from captioner.lightning_cli import CaptionerCLI


def _check_renamed(argv: list[str]) -> None:
    """An option renamed since (`captioner.checkpoints.RENAMED`), on the command line or in a config file, is refused
    in one line that names its new name (jsonargparse's own error would list every option)."""
    import yaml

    from captioner.checkpoints import RENAMED

    configs = []
    for i, arg in enumerate(argv):
        for old, new in RENAMED.items():
            if arg == f"--model.{old}" or arg.startswith(f"--model.{old}="):
                raise ConfigError(f"--model.{old} is now --model.{new}")
        if arg in ("-c", "--config") and i + 1 < len(argv):
            configs.append(argv[i + 1])
        elif arg.startswith("--config="):
            configs.append(arg.split("=", 1)[1])
    for path in configs:
        try:
            config = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError):  # said by the parser, in its own words
            continue
        model = config.get("model") if isinstance(config, dict) else None
        for old, new in RENAMED.items():
            if isinstance(model, dict) and old in model:
                raise ConfigError(f"{path}: model.{old} is now model.{new}")


def run_lightning_cli(argv: list[str]) -> CaptionerCLI:
    _check_config_paths(argv)
    _check_renamed(argv)
    from jsonargparse import ArgumentError

    from captioner.data.datamodules import CaptionDataModule
    from captioner.lightning_cli import CaptionerCLI, quiet_lightning
    from captioner.lit_module import CaptioningModule

    try:
        with quiet_lightning():
            return CaptionerCLI(
                CaptioningModule,
                CaptionDataModule,
                subclass_mode_data=True,
                args=None if argv == sys.argv[1:] else argv,
                parser_kwargs={"exit_on_error": False},
                save_config_kwargs={"overwrite": True},
            )
    except ArgumentError as err:  # a mistake on the command line or in the config
        raise ConfigError(_one_line(str(err))) from None
    except pickle.UnpicklingError as err:  # LightningCLI reads --ckpt_path's hyper-parameters (weights only) first
        from captioner.checkpoints import unpickling_error

        raise unpickling_error(_option_value(argv, "--ckpt_path") or "--ckpt_path", err) from None


def _option_value(argv: list[str], option: str) -> str | None:
    """The last value given to `option` on the command line (`--option VALUE` or `--option=VALUE`), if any."""
    value = None
    for i, arg in enumerate(argv):
        if arg == option and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(option + "="):
            value = arg.split("=", 1)[1]
    return value


def _one_line(message: str) -> str:
    """jsonargparse's error, which gives its reason on the lines after 'Parser key "K":', as one line: its innermost
    'Expected a T. Got value: V' (or a union's subtypes and given value) said as 'K: expected T, got V', or else its
    lines joined."""
    found = re.findall(r'Parser key "([^"]+)":\s+Expected a (.+?)\. Got value: (.+)', message)
    subtypes = r'Parser key "([^"]+)":\s+Does not validate .*?Subtypes: \[([^\n]*)\].*Given value: (.+)'
    union = re.search(subtypes, message, re.S)
    if found:
        key, expected, value = found[-1]
    elif union:
        key, expected, value = union.group(1), f"one of {union.group(2)}", union.group(3)
    else:
        return " ".join(line.strip() for line in message.splitlines() if line.strip())
    expected = re.sub(r"<class '(\w+)'>", r"\1", expected).replace("typing.", "")
    return f"{key}: expected {expected}, got {value.strip()}"


COMMANDS = {
    "fit": "train a model on a config's dataset (LightningCLI)",
    "validate": "score a checkpoint on the validation split (LightningCLI)",
    "test": "score a checkpoint on the test split (LightningCLI)",
    "predict": "caption the test split to a JSON-lines file (LightningCLI)",
    "caption": "caption image files and folders, optionally writing per-word attention overlays",
    "evaluate": "score a checkpoint with the coco-caption metrics (BLEU, METEOR, ROUGE-L, CIDEr)",
    "export": "write a small self-contained model file from a checkpoint, or ONNX graphs (--format onnx)",
    "serve": "a web page and JSON API that caption uploaded images and show each word's attention",
    "demo": "caption a few held-out shapes images and print val/bleu4 (what `make demo` runs)",
}


def overview() -> str:
    """What `captioner`, `captioner -h` and `captioner --help` print: every subcommand, one line each."""
    width = max(map(len, COMMANDS))
    lines = [f"  {name.ljust(width)}  {what}" for name, what in COMMANDS.items()]
    return "\n".join(
        ["usage: captioner <command> [options]   (captioner <command> --help for its options)", "", "commands:", *lines]
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(overview())
        sys.exit(0 if argv else 2)
    ours = {"demo": demo, "evaluate": evaluate, "export": export_model, "serve": serve}
    try:
        if argv[0] == "caption":
            sys.exit(caption(argv[1:]))  # 1 when a file failed
        elif argv[0] in ours:
            ours[argv[0]](argv[1:])
        else:
            run_lightning_cli(argv)
            end_process_group()
    except CaptionerError as err:
        message = str(err).strip().splitlines()
        # One write of the whole line: the processes of a DDP run share the stream, and each says it
        sys.stderr.write(f"error: {message[0] if message else type(err).__name__}\n")
        sys.stderr.flush()
        end_process_group()
        sys.exit(2)


def end_process_group() -> None:
    """Destroy the DDP process group, as PyTorch asks each process to before it exits (Lightning does it for NCCL only).
    A gloo group left to the interpreter's exit aborts the process now and then: "terminate called without an active
    exception", status -6, after a run that had done all its work. Called where a command has ended, or has refused
    with a one-line error; not after an unexpected exception, where another process may still wait in a collective."""
    if "torch" not in sys.modules:  # the command never imported torch, so no group exists
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
