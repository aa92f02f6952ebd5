"""captioner's own commands, apart from the entry point (`captioner.cli`): caption, evaluate, export, serve and demo,
each an argparse parser of its own over the library. Mistakes in the user's input end with one `error: ...` line
(`captioner.errors.CaptionerError`, which the entry point prints); nothing here imports torch before a command
runs."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from captioner.errors import ConfigError, install_hint

DEFAULT_MODEL = "shapes"  # the bundled model that caption and serve use when no --ckpt_path is given


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each option's default after its description, unless it has none or is a flag."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False) or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _parser(command: Callable, **kwargs) -> argparse.ArgumentParser:
    """A subcommand's parser: its docstring as the description, and every option's default in --help."""
    name = command.__name__.removesuffix("_model")
    return argparse.ArgumentParser(
        prog=f"captioner {name}", description=command.__doc__, formatter_class=_Help, **kwargs
    )


def _add_checkpoint(parser: argparse.ArgumentParser, help: str, bundled: bool = False) -> None:
    """The checkpoint option: `--ckpt_path`, as LightningCLI spells it, or `--checkpoint`, its old spelling here.
    With `bundled`, it may be left out: the bundled model is used, with a note (`_bundled_unless_given`)."""
    if bundled:
        help += (
            f" (default: the bundled model `{DEFAULT_MODEL}`, trained on synthetic shapes only; `ucm`: aerial photos)"
        )
    parser.add_argument(
        "--ckpt_path", "--checkpoint", dest="checkpoint", metavar="PATH", required=not bundled, help=help
    )


def _add_decoding(parser: argparse.ArgumentParser) -> None:
    """The search's options, as `caption` and `evaluate` share them (`_decoding`)."""
    parser.add_argument("--beam-size", type=int, default=3, help="hypotheses kept per image (1: greedy)")
    parser.add_argument(
        "--length-penalty",
        type=float,
        help="beam search ranks captions by log-probability / length**this (default: the library's, per word; 0: "
        "the raw sum, which favours short ones)",
    )
    parser.add_argument("--max-len", type=int, default=30, help="longest caption, in words")


def _decoding(args: argparse.Namespace) -> dict:
    """The search's options as `generate` and `Captioner.iter_captions` take them: the length penalty only if given,
    so that its default is the library's own (captioner.models.decoding.LENGTH_PENALTY, which imports torch)."""
    options = {"beam_size": args.beam_size, "max_len": args.max_len}
    return options if args.length_penalty is None else {**options, "length_penalty": args.length_penalty}


def load_captioner(checkpoint: str | None):
    """The captioner of `checkpoint`, or of the default bundled model where none is given; a model whose card says what
    it has seen (`captioner.checkpoints.ModelFile.card`: the bundled ones) says it once on stderr."""
    from captioner.api import Captioner

    captioner = Captioner.load(checkpoint or DEFAULT_MODEL)  # an ONNX export folder: ONNX Runtime's
    note = captioner.card.get("note")
    if checkpoint is None:
        print(f"note: no --ckpt_path given: the bundled model `{DEFAULT_MODEL}`, {note}", file=sys.stderr)
    elif note:
        print(f"note: {checkpoint}: {note}", file=sys.stderr)
    return captioner


def _check_config_paths(argv: list[str]) -> None:
    """A missing --config file is the most common mistake; name it plainly."""
    for i, arg in enumerate(argv):
        path = None
        if arg in ("-c", "--config") and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        if path is not None and not Path(path).is_file():
            raise ConfigError(f"{path}: config file not found")


def _overlay_folder(path: str | None) -> Path | None:
    """The folder for --overlays, created if missing; a path that cannot be a folder is the user's mistake."""
    if not path:
        return None
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{folder}: cannot write overlays there: {err.strerror or err}") from None
    return folder


def demo(argv: list[str]) -> None:
    """Caption a few held-out images beside a reference, then print the validation BLEU-4 as the last line."""
    parser = _parser(demo)
    _add_checkpoint(parser, "a checkpoint written by `captioner fit --config configs/shapes.yaml`")
    parser.add_argument("--samples", type=int, default=5, help="held-out test images to caption")
    parser.add_argument("--overlays", metavar="DIR", help="write one PNG per image: the image and one tile per word")
    args = parser.parse_args(argv)
    if args.samples < 0:
        raise ConfigError(f"--samples must be >= 0, got {args.samples}")
    overlays = _overlay_folder(args.overlays)

    import lightning as L
    import torch

    from captioner.data.datamodules import ShapesDataModule
    from captioner.data.vocab import detokenize
    from captioner.lightning_cli import captions_with_overlays, load_module, quiet_lightning

    module = load_module(args.checkpoint).eval()
    datamodule = ShapesDataModule.load_from_checkpoint(args.checkpoint, weights_only=True)
    test = datamodule.split("test")
    pictures = [test.load_image(i) for i in range(min(args.samples, len(test)))]
    with torch.inference_mode():
        captioned = captions_with_overlays(module, pictures)
    for i, (words, sheet) in enumerate(captioned):
        print(f"test image {i}\n  generated: {detokenize(words)}\n  reference: {test.captions(i)[0]}")
        if overlays:
            path = overlays / f"test_{i}.png"
            sheet.save(path)
            print(f"  overlay: {path}")
    with quiet_lightning():
        trainer = L.Trainer(
            accelerator="auto", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False
        )
        metrics = trainer.validate(module, datamodule=datamodule, verbose=False)[0]
    print(f"val/bleu4={metrics['val/bleu4']:.3f}")


def caption(argv: list[str]) -> int:
    """Caption image files and folders; print `path<TAB>caption` (or JSON lines). Exit status 1 if any file failed."""
    parser = _parser(caption)
    parser.add_argument("paths", nargs="+", help="image files, or folders searched recursively for images")
    _add_checkpoint(
        parser,
        "a checkpoint of `captioner fit`, a model file or ONNX folder of `captioner export`, or a bundled model's name",
        True,
    )
    _add_decoding(parser)
    parser.add_argument("--batch-size", type=int, default=16, help="images captioned at once")
    parser.add_argument("--overlays", metavar="DIR", help="write one PNG per image: the image and one tile per word")
    parser.add_argument(
        "--per-word-scale",
        action="store_true",
        help="scale each overlay to its own word's largest α (default: one scale for all words, with a colour bar)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per line: path, caption, tokens, score")
    args = parser.parse_args(argv)
    if args.beam_size < 1 or args.batch_size < 1:
        raise ConfigError("--beam-size and --batch-size must be positive")
    from tqdm import tqdm

    from captioner.data.images import ImageError, find_images
    from captioner.visualize import attention_grid

    overlays = _overlay_folder(args.overlays)
    captioner = load_captioner(args.checkpoint)
    paths, errors = find_images(args.paths)
    # A bar with an ETA on stderr when it is a terminal, and when there is more than one image; never with --json
    progress = tqdm(total=len(paths), unit="image", disable=True if args.json or len(paths) < 2 else None)

    def say(line: str, stream=sys.stdout) -> None:
        with progress.external_write_mode(file=stream):
            print(line, file=stream, flush=True)

    for error in errors:
        say(f"error: {error}", sys.stderr)
    failed = len(errors)
    results = captioner.iter_captions(paths, batch_size=args.batch_size, **_decoding(args))
    for index, result in enumerate(results):
        progress.update()
        if isinstance(result, ImageError):
            say(f"error: {result}", sys.stderr)
            failed += 1
            continue
        if args.json:
            record = {"path": result.source, "caption": result.text, "tokens": result.tokens, "score": result.score}
            say(json.dumps(record))
        else:
            say(f"{result.source}\t{result.text}")
        if overlays:
            sheet = attention_grid(
                result.image, result.tokens, result.alphas, result.grid_hw, per_word=args.per_word_scale
            )
            sheet.save(overlays / f"{index:05d}_{Path(result.source).stem}.png")
    progress.close()
    return 1 if failed else 0


def evaluate(argv: list[str]) -> None:
    """Decode each image of a split once and score it with the coco-caption metrics (pycocoevalcap), the share of
    captions that are one of their references word for word, how peaked each word's attention is (the share in its
    strongest tenth of the grid, and its entropy over uniform's, over all words and over content words), and on shapes
    attention correctness and its ceiling."""
    parser = _parser(
        evaluate,
        epilog="Options of the data, as in `captioner fit`, override the config's: --data.init_args.data_dir=...",
    )
    _add_checkpoint(parser, "a checkpoint of `captioner fit`, a file of `captioner export`, or a bundled model's name")
    parser.add_argument(
        "--config",
        help="a YAML whose `data` section names the dataset (default: a fit checkpoint's training data; a model file "
        "or bundled model names none)",
    )
    parser.add_argument("--split", choices=("val", "test"), default="test", help="the split to caption and score")
    _add_decoding(parser)
    parser.add_argument("--output", default="evaluation", help="folder for metrics.json and captions.json")
    parser.add_argument(
        "--ptb-tokenizer",
        action="store_true",
        help="tokenize with coco-caption's PTB tokenizer (Java; English), as published COCO scores are, instead of "
        "captioner's own, which training and validation use and which knows every script",
    )
    args, overrides = parser.parse_known_args(argv)
    if args.ptb_tokenizer and shutil.which("java") is None:  # before the split is decoded, not after
        raise ConfigError(
            "--ptb-tokenizer runs coco-caption's PTB tokenizer, which needs Java: install a JDK (apt-get install "
            "openjdk-17-jre-headless), or leave --ptb-tokenizer out to score with captioner's own tokenizer"
        )

    from captioner.evaluation import evaluated_model, evaluation_data, score_split

    model, vocab = evaluated_model(args.checkpoint)  # first: a missing or foreign file is named in one line
    datamodule = evaluation_data(args.config, args.checkpoint, overrides)
    scores, hypotheses = score_split(model, vocab, datamodule, args.split, _decoding(args), args.ptb_tokenizer)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    (output / "metrics.json").write_text(json.dumps(scores, indent=1))
    results = [{"image_id": k, "caption": v} for k, v in hypotheses.items()]
    (output / "captions.json").write_text(json.dumps(results, indent=1))
    for name, value in scores.items():
        print(f"{name}={value:.4f}")
    if "METEOR" not in scores:
        print("METEOR: skipped (needs Java)")
    print("SPICE: skipped (it downloads Stanford CoreNLP at run time)")
    print(f"wrote {output / 'metrics.json'} and {output / 'captions.json'} ({len(hypotheses)} images)")
    if args.beam_size > 1:
        print(f"beam {args.beam_size}: `captioner test` and validation decode greedily (--beam-size 1 gives theirs)")


def export_model(argv: list[str]) -> None:
    """Write a small self-contained model file (what `Captioner.load` and `captioner caption` read); with --format
    onnx, a folder of ONNX graphs that `captioner.onnx.Captioner` runs without PyTorch; with --format web, that folder
    and a page that captions images in the browser with ONNX Runtime Web, for any static host (no server behind it)."""
    parser = _parser(export_model)
    _add_checkpoint(parser, "a checkpoint of `captioner fit`, a file of `captioner export`, or a bundled model's name")
    parser.add_argument(
        "--output", required=True, metavar="PATH", help="the model file (onnx, web: the folder) to write"
    )
    parser.add_argument(
        "--format",
        choices=("model", "onnx", "web"),
        default="model",
        help="model: one file for torch; onnx: the encoder's, the search's start and words' graphs, their shared "
        "weights and captioner.json; web: the onnx folder and a static page that runs it in the browser (its own "
        "format: a folder to publish, with a page, ONNX Runtime Web's place and example images, that "
        "captioner.onnx still loads)",
    )
    parser.add_argument(
        "--ort-dist",
        metavar="DIR",
        help="web: copy ONNX Runtime Web from this local onnxruntime-web/dist (npm's) into the folder, for hosting "
        "offline; default: the page loads it from a CDN (jsDelivr), checked by its hash",
    )
    parser.add_argument(
        "--include-encoder",
        action="store_true",
        help="keep the encoder's weights even when they are its pretrained source's (left out by default; an onnx "
        "export always holds them)",
    )
    parser.add_argument(
        "--float16",
        action="store_true",
        help="model, onnx: store the weights as float16 (half the file; the model computes in float32 from them); "
        "web does by default",
    )
    parser.add_argument("--float32", action="store_true", help="web: store the weights as float32")
    parser.add_argument(
        "--card",
        metavar="JSON",
        help="model: a JSON file of what the model says of itself (data, licence, training, scores, and a `note` on "
        "what it has seen, which the commands print); default: the checkpoint's own, if any",
    )
    parser.add_argument(
        "--int8",
        choices=("step", "all"),
        help="onnx: weights as int8 (ONNX Runtime's dynamic quantization): the decoder step's, or all (the encoder's "
        "convolutions too: slower on CPUs, and most captions change; docs/benchmarks.md)",
    )
    args = parser.parse_args(argv)
    if args.int8 and args.format == "model":
        raise ConfigError("--int8 is for --format onnx and web")
    if args.card and args.format != "model":
        raise ConfigError("--card is for --format model (an ONNX export keeps the model's card)")
    if args.ort_dist and args.format != "web":
        raise ConfigError("--ort-dist is for --format web")
    if args.float32 and args.format != "web":
        raise ConfigError("--float32 is for --format web (the others store float32 unless --float16)")
    if args.float32 and args.float16:
        raise ConfigError("--float16 or --float32, not both")
    card = None
    if args.card:
        try:
            card = json.loads(Path(args.card).read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise ConfigError(f"{args.card}: not a readable JSON file ({err})") from None
        if not isinstance(card, dict):
            raise ConfigError(f"{args.card}: a card is a JSON object")
    if args.format in ("onnx", "web"):
        from captioner.onnx_export import export_onnx
        from captioner.web_export import export_web, folder_size

        if args.format == "onnx":
            folder = export_onnx(args.checkpoint, args.output, int8=args.int8, float16=args.float16)
        else:
            folder = export_web(args.checkpoint, args.output, ort_dist=args.ort_dist, float16=not args.float32,
                                int8=args.int8)  # fmt: skip
        float16 = args.float16 or (args.format == "web" and not args.float32)
        options = "".join([f", int8: {args.int8}" if args.int8 else "", ", float16" if float16 else ""])
        print(f"wrote {folder}/ ({folder_size(folder) / 2**20:.1f} MiB{options})")
        if args.format == "web":
            print(f"serve it from any static host; to try it here: python -m http.server -d {folder}")
        return
    from captioner.checkpoints import export

    path = export(args.checkpoint, args.output, args.include_encoder, args.float16, card)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")


def serve(argv: list[str]) -> None:
    """Serve a page and a JSON API (POST /api/caption) that caption images and show each word's attention.
    There is no authentication: anyone who can reach the port can use the model."""
    parser = _parser(serve)
    _add_checkpoint(
        parser,
        "a checkpoint of `captioner fit`, a model file or ONNX folder of `captioner export`, or a bundled model's name",
        True,
    )
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (others need it said)")
    parser.add_argument("--port", type=int, default=7860, help="the port to listen on")
    parser.add_argument("--max-upload-mb", type=float, default=20, help="larger uploads get a 413, and are not read")
    parser.add_argument(
        "--max-batch", type=int, default=8, help="most waiting requests captioned as one batch, and decoded at once"
    )
    parser.add_argument(
        "--max-pixels", type=float, default="25e6", help="larger images are refused from their header, before decoding"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=30,
        help="seconds a connection may wait for a request's head or body, or stay idle, before it is closed",
    )
    parser.add_argument(
        "--max-connections", type=int, default=256, help="a connection opened over this many gets a 503"
    )
    args = parser.parse_args(argv)
    limits = (args.max_upload_mb, args.max_batch, args.max_pixels, args.timeout, args.max_connections)
    if min(limits) <= 0:
        raise ConfigError("--max-upload-mb, --max-batch, --max-pixels, --timeout, --max-connections must be positive")
    try:
        from captioner.serve import serve as run
    except ImportError as err:
        raise ConfigError(f"captioner serve needs {err.name}: {install_hint('serve')}") from None
    captioner = load_captioner(args.checkpoint)
    name = args.checkpoint or DEFAULT_MODEL
    run(captioner, name, args.host, args.port, *limits[:2], int(args.max_pixels), *limits[3:])
