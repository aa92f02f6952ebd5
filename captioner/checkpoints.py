"""Every read and write of a model file: `captioner fit` checkpoints, `captioner export` files, and `init_from`.

A file may leave out its encoder's weights when they are those of the encoder's pretrained source (ImageNet weights,
installed with the package or in torch's cache), which loading rebuilds bit for bit: they would ride in every
checkpoint unchanged. Whether they are is decided in one place, `encoder_left_out`, by comparing the weights with the
source's (their fingerprints, `Encoder.fingerprint`), never by a flag such as "frozen": a frozen encoder started from
a fine-tuned checkpoint is not its source. The file then records the fingerprint, and loading checks it
(`with_encoder`): the weights alone, so that a file loads into a model of another image size or grid. Files are read
with torch.load(weights_only=True): loading never unpickles code.
"""

from __future__ import annotations

import inspect
import pickle
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from captioner.errors import CaptionerError, ConfigError, WeightsUnavailableError
from captioner.files import replace_atomically
from captioner.models.decoder import AttentionDecoder
from captioner.models.encoder import Encoder
from captioner.models.show_attend_tell import ShowAttendTell
from captioner.onnx.layout import CONFIG

FINGERPRINT = "encoder_weights"  # in a file that leaves out its encoder: the fingerprint of the weights left out
# What files written before FINGERPRINT recorded instead: the encoder's annotation_fingerprint (weights, preprocessing
# and grid). They are checked against it, so they load into a model of the image size and grid they were written with.
ANNOTATION_FINGERPRINT = "encoder_fingerprint"
EXPORT_FORMAT = "captioner-model/1"
ENCODER = "encoder."  # the encoder's weights' prefix in a ShowAttendTell's state_dict
ASSETS = Path(__file__).parent / "assets"
# The models that ship with the package, by name; each file holds its card (`ModelFile.card`)
BUNDLED = {"shapes": ASSETS / "shapes.pt", "ucm": ASSETS / "ucm.pt"}


@dataclass(frozen=True)
class Located:
    """Where a model named by the user is: a torch model file (a fit checkpoint, an export, a bundled model's file),
    or a folder of ONNX graphs (`onnx`)."""

    path: Path
    onnx: bool = False


def locate(checkpoint: str | Path) -> Located:
    """The one rule for what `--ckpt_path`, `Captioner.load` and `init_from` name, used by every command and the API:

    1. a bundled model's name ("shapes", "ucm") is that model, unless a model file or ONNX export folder of that name
       is in the working directory too: then it is refused in one line, for the user to say which (`./shapes` is
       the path; a path spelled with a folder, absolute or not, is never a bundled name);
    2. a folder holding `captioner.json` is an ONNX export; another folder is refused in one line;
    3. anything else is a torch model file (a missing one is said when it is read).
    """
    name, path = str(checkpoint), Path(checkpoint)
    model_here = path.is_file() or (path / CONFIG).is_file()
    if name in BUNDLED:
        if model_here:
            raise CaptionerError(
                f"{name!r} is both the bundled model's name and a model in this folder: write ./{name} for this "
                "folder's, or another path"
            )
        if not BUNDLED[name].exists():
            raise CaptionerError(f"the bundled {name!r} model is missing at {BUNDLED[name]}; see README, 'Caption'")
        return Located(BUNDLED[name])
    if path.is_dir():
        if not (path / CONFIG).is_file():
            raise CaptionerError(
                f"{path}: a folder without {CONFIG}, so not a model that `captioner export --format onnx` wrote"
            )
        return Located(path, onnx=True)
    return Located(path)


def resolve(checkpoint: str | Path) -> Path:
    """The torch model file that `checkpoint` names (`locate`); an ONNX export folder is refused in one line, where a
    torch model is needed (export, init_from, evaluation)."""
    located = locate(checkpoint)
    if located.onnx:
        raise CaptionerError(f"{checkpoint}: an ONNX export folder; this needs a torch model file (a checkpoint)")
    return located.path


BASELINE = "reward_baseline"  # hard attention's running baseline b (a buffer)


def read(path: str | Path, name: str | None = None, mmap: bool = False) -> dict:
    """A model file's contents; a missing or foreign file is a one-line error naming it (as `name`, if given). With
    `mmap`, its tensors are mapped from the file, not read: what is only looked into costs no reading of weights."""
    name = name or str(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CaptionerError(f"{name}: checkpoint not found") from None
    except pickle.UnpicklingError as err:
        raise unpickling_error(name, err) from None
    except (EOFError, zipfile.BadZipFile, RuntimeError, IsADirectoryError, ValueError):
        raise CaptionerError(f"{name}: not a captioner checkpoint (not a PyTorch checkpoint file)") from None
    if not isinstance(state, dict):
        raise CaptionerError(f"{name}: not a captioner checkpoint")
    return state


def unpickling_error(name: str, err: pickle.UnpicklingError) -> CaptionerError:
    """The one line for a file that torch.load(weights_only=True) would not unpickle: one whose pickle holds objects
    beyond weights, which could run code when loaded (torch's "Weights only load failed"), or a file that is no
    pickle at all."""
    if "weights only" in str(err).lower():
        return CaptionerError(
            f"{name}: refused: it holds pickled objects besides weights, which could run code when loaded; captioner "
            "loads weights only (torch.load(weights_only=True))"
        )
    return CaptionerError(f"{name}: not a captioner checkpoint (not a PyTorch checkpoint file)")


@dataclass(frozen=True)
class Fingerprint:
    """What a file that left out its encoder's weights recorded of them."""

    value: str
    annotations: bool = False  # an older file's ANNOTATION_FINGERPRINT, not the weights' alone

    @classmethod
    def read(cls, state: dict) -> Fingerprint | None:
        """The record of a file's contents (a checkpoint's or an export's top level), if it has one."""
        if FINGERPRINT in state:
            return cls(state[FINGERPRINT])
        return cls(state[ANNOTATION_FINGERPRINT], annotations=True) if ANNOTATION_FINGERPRINT in state else None

    def write(self, state: dict) -> None:
        state[ANNOTATION_FINGERPRINT if self.annotations else FINGERPRINT] = self.value

    def matches(self, encoder: Encoder, written_with: Encoder | None = None) -> bool:
        """Whether `encoder`'s weights are the ones recorded. An older record (`annotations`) also covers the
        preprocessing and grid: compared under those of `written_with`, an encoder of the file's own options."""
        if not self.annotations:
            return self.value == encoder.fingerprint()
        return self.value == encoder.annotation_fingerprint(written_with)


def encoder_left_out(encoder: Encoder) -> str | None:
    """The fingerprint a file records when it leaves out `encoder`'s weights: they are its pretrained source's, which
    any machine can rebuild (a package's, torchvision's or the hub's). None when they are not (fine-tuned, started
    from another file, built without a source, or read from a weights file of this machine's, `backbone_weights`),
    and must be written."""
    source = encoder.source_fingerprint
    portable = encoder.weights_file is None  # a weights file's path means nothing on another machine
    return source if portable and source is not None and encoder.fingerprint() == source else None


# What a model is built with when the file holds its encoder's weights: no pretrained weights, from anywhere
WITHOUT_SOURCE = {"pretrained": False, "backbone_weights": None}


def without_encoder(weights: dict, encoder: Encoder, prefix: str = "") -> tuple[dict, Fingerprint | None]:
    """`weights` (a state_dict whose encoder's keys start with prefix + "encoder.") without the encoder's when it can
    be left out, and the fingerprint to record (None: kept)."""
    fingerprint = encoder_left_out(encoder)
    if fingerprint is None:
        return weights, None
    return {k: v for k, v in weights.items() if not k.startswith(prefix + ENCODER)}, Fingerprint(fingerprint)


def with_encoder(
    weights: dict,
    encoder: Encoder,
    fingerprint: Fingerprint | None,
    name: str,
    prefix: str = "",
    hparams: dict | None = None,
) -> dict:
    """`weights` completed with `encoder`'s own where the file left its encoder out, after checking that they are the
    ones it left out (`fingerprint`; a file without one predates it and is taken as it is). An older file's record
    covers the weights with its preprocessing and grid: where the model asks for another image size or grid, it is
    checked under the file's own (`hparams`), so that only the weights decide, as for a newer file."""
    if any(k.startswith(prefix + ENCODER) for k in weights):
        return weights
    if fingerprint is not None and not fingerprint.matches(encoder):
        written_with = _options_encoder(hparams) if fingerprint.annotations and hparams is not None else None
        if written_with is None or not fingerprint.matches(encoder, written_with):
            raise CaptionerError(
                f"{name}: it left out its {encoder.name} weights, to be rebuilt from their pretrained source, and the "
                f"{encoder.name} weights here are not those it was trained with: install the same"
            )
    return {**{prefix + ENCODER + k: v for k, v in encoder.state_dict().items()}, **weights}


def _options_encoder(hparams: dict) -> Encoder | None:
    """An untrained encoder of a file's options (its preprocessing and grid); None where they do not make one."""
    options = model_options(renamed(hparams))
    names = inspect.signature(Encoder).parameters.keys() - {"pretrained"}
    try:
        return Encoder(**{k: v for k, v in options.items() if k in names}, pretrained=False)
    except (ConfigError, TypeError, ValueError):
        return None


@dataclass
class ModelFile:
    """What a fit checkpoint or an exported file holds of its model, and its card: what a published model says of
    itself (its data and licence, how it was trained, its scores, and a `note` on what it has seen, which the commands
    print when they use it), empty for others."""

    hparams: dict
    vocab: list[str]
    weights: dict[str, torch.Tensor]  # ShowAttendTell's state_dict, maybe without its encoder
    fingerprint: Fingerprint | None  # of the encoder weights it left out, if it did and says so
    card: dict = field(default_factory=dict)

    @property
    def has_encoder(self) -> bool:
        return any(k.startswith(ENCODER) for k in self.weights)


def model_file(path: str | Path, name: str | None = None) -> ModelFile:
    """Read a `captioner fit` checkpoint or a `captioner export` file (one-line errors naming it)."""
    name = name or str(path)
    state = read(path, name)
    if state.get("format") == EXPORT_FORMAT:
        hparams, vocab, weights = state["hparams"], state["vocab"], state["state_dict"]
    elif "hyper_parameters" in state and "state_dict" in state:
        hparams = state["hyper_parameters"]
        vocab = hparams.get("vocab")
        weights = {k.removeprefix("model."): v for k, v in state["state_dict"].items() if k.startswith("model.")}
    else:
        raise CaptionerError(f"{name}: not a captioner checkpoint (no model weights and hyper-parameters)")
    if not vocab:
        raise CaptionerError(f"{name}: not a captioner checkpoint (no vocabulary)")
    card = state.get("card") if isinstance(state.get("card"), dict) else {}
    return ModelFile(renamed(dict(hparams)), list(vocab), weights, Fingerprint.read(state), card)


# Model options renamed since a model file could have been written: old name -> new. A file's hyper-parameters under
# an old name are read under the new one; the command line and config files refuse the old one (`captioner.cli`).
RENAMED = {
    "entropy_weight": "reinforce_entropy_weight",  # hard attention's lambda_e, beside reinforce_weight (lambda_r)
    "attention_entropy_weight": "attention_entropy_penalty",  # soft attention's penalty on each word's entropy
}


def renamed(hparams: dict) -> dict:
    """`hparams` with every option under its current name (`RENAMED`); a value under a current name wins."""
    current = {RENAMED.get(key, key): value for key, value in hparams.items() if key in RENAMED}
    return current | {key: value for key, value in hparams.items() if key not in RENAMED}


def model_options(hparams: dict) -> dict:
    """The model's options among a checkpoint's hyper-parameters (ShowAttendTell's, and its decoder's)."""
    names = {*inspect.signature(ShowAttendTell).parameters, *inspect.signature(AttentionDecoder).parameters}
    names -= {"vocab_size", "encoder_dim", "num_pixels", "decoder_options"}
    return {k: v for k, v in hparams.items() if k in names}


def build_model(file: ModelFile, name: str) -> ShowAttendTell:
    """The model a file describes, with its weights. A file that holds its encoder's weights needs no pretrained
    source; one that left them out has them rebuilt from it, and checked."""
    options = model_options(file.hparams) | (WITHOUT_SOURCE if file.has_encoder else {"pretrained": True})
    try:
        model = ShowAttendTell(len(file.vocab), **options)
    except (WeightsUnavailableError, ConfigError) as err:  # it left its encoder out, and its source is not here
        backbone = file.hparams.get("backbone", "its backbone")
        raise WeightsUnavailableError(
            f"{name}: it left out its {backbone} encoder, to be rebuilt from the pretrained weights, which are not on "
            f"this machine ({err}); where they are, `captioner export --include-encoder` writes a file that holds them"
        ) from None
    weights = with_encoder(file.weights, model.encoder, file.fingerprint, name)
    try:
        model.load_state_dict(weights)
    except RuntimeError as err:
        raise CaptionerError(f"{name}: its weights do not fit its model ({first_misfit(err)})") from None
    return model


def first_misfit(err: RuntimeError) -> str:
    """The first line of load_state_dict's error that names a weight (its first line is a header)."""
    return next((line.strip() for line in str(err).splitlines()[1:] if line.strip()), str(err))[:200]


def load_initial_weights(model: ShowAttendTell, path: str | Path, vocab: list[str]) -> None:
    """`init_from`: start `model` from the weights of a fit checkpoint or exported file, encoder included (fine-tuned
    or not: the file's weights are the run's). Its vocabulary must be `vocab`, and its architecture the model's; else a
    one-line error naming both."""
    name = f"--model.init_from {path}"
    file = model_file(resolve(path), name)
    if file.vocab != list(vocab):
        pairs = enumerate(zip(file.vocab, vocab, strict=False))  # the shorter one's length if one is the other's start
        first = next((i for i, (a, b) in pairs if a != b), min(len(file.vocab), len(vocab)))
        raise CaptionerError(
            f"{name}: its vocabulary ({len(file.vocab)} words) is not the data's ({len(vocab)} words; they part at id "
            f"{first}): start from a checkpoint trained on the same data"
        )
    weights = with_encoder(file.weights, model.encoder, file.fingerprint, name, hparams=file.hparams)
    # Hard attention's running baseline b is training state, not a weight: a hard-attention run may start from a
    # soft-attention file (b starts at 0), and a soft run from a hard one (b is left behind).
    weights = {k: v for k, v in weights.items() if k != BASELINE}
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as err:  # a weight of another shape
        raise CaptionerError(f"{name}: its model does not fit the config's ({first_misfit(err)})") from None
    missing = [k for k in missing if k != BASELINE]
    if missing or unexpected:
        raise CaptionerError(
            f"{name}: its model does not fit the config's (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )


def _source_encoder(file: ModelFile) -> Encoder | None:
    """The file's encoder built from its pretrained source, or None where that source is not on this machine."""
    options = model_options(file.hparams)
    names = inspect.signature(Encoder).parameters.keys() - {"pretrained"}
    try:
        return Encoder(**{k: v for k, v in options.items() if k in names}, pretrained=True)
    except WeightsUnavailableError:
        return None


def export(
    checkpoint: str | Path,
    output: str | Path,
    include_encoder: bool = False,
    float16: bool = False,
    card: dict | None = None,
) -> Path:
    """Write a small self-contained model file (what `Captioner.load` reads) from a `captioner fit` checkpoint (or
    another model file, or a bundled model's name).

    The encoder's weights are written as the checkpoint holds them: left out where it left them out (they are their
    pretrained source's, `encoder_left_out`: the file is then a few MB, and loading rebuilds them), or kept.
    `include_encoder` writes them in any case: rebuilt from their pretrained source, the only time it is built here.
    `float16` stores the floating-point weights in half precision (half the file; loading computes in float32 from
    them, so captions may change where a choice between words was that close). `card` replaces the file's card
    (`ModelFile.card`), which is kept otherwise.
    """
    file = model_file(resolve(checkpoint), str(checkpoint))
    weights, fingerprint = file.weights, file.fingerprint
    if include_encoder and not file.has_encoder:
        encoder = _source_encoder(file)
        if encoder is None:
            raise CaptionerError(f"{checkpoint}: its encoder's pretrained weights are not on this machine to include")
        weights, fingerprint = with_encoder(weights, encoder, fingerprint, str(checkpoint)), None
    if float16:
        weights = {k: v.half() if v.is_floating_point() else v for k, v in weights.items()}
    hparams = {k: v for k, v in file.hparams.items() if isinstance(v, (int, float, str, bool, type(None)))}
    model = {"format": EXPORT_FORMAT, "hparams": hparams, "vocab": file.vocab, "state_dict": weights}
    if card if card is not None else file.card:
        model["card"] = card if card is not None else file.card
    if fingerprint is not None and not any(k.startswith(ENCODER) for k in weights):
        fingerprint.write(model)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    replace_atomically(output, lambda out: torch.save(model, out))  # a kill mid-write leaves the old file whole
    return output
