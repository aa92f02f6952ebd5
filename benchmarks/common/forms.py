"""The forms a captioner runs in, built as the latency and export tables measure them: torch (eager; the decoder
compiled; the encoder too) and `captioner export --format onnx` on ONNX Runtime (float, float16 weights, int8; Pillow's
resize or the exact one), for a bundled model, a checkpoint, or an untrained model at the paper's sizes."""

from __future__ import annotations

from pathlib import Path

import torch

from captioner import Captioner
from captioner.data.vocab import Vocabulary
from captioner.models.show_attend_tell import ShowAttendTell
from common.harness import fail_if_asked

TORCH = {  # form -> `Captioner`'s options
    "torch, eager": {},
    "torch, compiled": {"compile_decoder": True},
    "torch, compiled, encoder too": {"compile_decoder": True, "compile_encoder": True},
}
EXPORTS = {  # export -> `export_onnx`'s options
    "onnx, float": {},
    "onnx, float16": {"float16": True},  # weights stored as float16 (`captioner export --format web`'s default)
    "onnx, int8 step": {"int8": "step"},  # the decoder's matrix products
    "onnx, int8 all": {"int8": "all"},  # the encoder's convolutions too
}
ONNX = {  # form -> (its export, `captioner.onnx.Captioner`'s options)
    "onnx, float": ("onnx, float", {}),
    "onnx, float, exact resize": ("onnx, float", {"resize": "exact"}),  # torchvision's pixels, to the bit
    **{form: (form, {}) for form in EXPORTS if form != "onnx, float"},
}
FORMS = [*TORCH, *ONNX]
GROUPS = {"torch": list(TORCH), "onnx": list(ONNX), "all": FORMS}
PAPER = "paper"  # the model name of `paper_model`


def forms_named(spec: str) -> list[str]:
    """The forms that `spec` names: forms or groups (GROUPS), separated by "|", in FORMS' order."""
    named = {form for name in spec.split("|") for form in GROUPS.get(name.strip(), [name.strip()])}
    if unknown := named - set(FORMS):
        raise SystemExit(f"no form or group named {', '.join(sorted(unknown))} (forms: {', '.join(FORMS)})")
    return [form for form in FORMS if form in named]


def paper_model() -> tuple[ShowAttendTell, Vocabulary]:
    """An untrained model at the paper's sizes (ResNet-101 at 448 pixels pooled to 14x14x2048, a 512-d decoder,
    10,000 words): its speed is a trained one's."""
    torch.manual_seed(0)
    vocab = Vocabulary(f"w{i}" for i in range(10_000 - len(Vocabulary.SPECIALS)))
    sizes = {"embed_dim": 512, "decoder_dim": 512, "attention_dim": 512}
    special = {"pad_index": vocab.pad_index, "start_index": vocab.start_index, "end_index": vocab.end_index}
    model = ShowAttendTell(len(vocab), "resnet101", pretrained=False, grid_size=14, image_size=448, **sizes, **special)
    return model, vocab


def providers(device: torch.device) -> list[str]:
    """ONNX Runtime's execution providers for `device`; where it lacks them, why, as an error."""
    try:
        import onnxruntime
    except ImportError:
        raise RuntimeError("not measured: onnxruntime is not installed (pip install 'captioner[onnx]')") from None
    if device.type != "cuda":
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        raise RuntimeError("not measured: onnxruntime has no CUDAExecutionProvider (pip install onnxruntime-gpu)")
    return ["CUDAExecutionProvider", "CPUExecutionProvider"]


def exports_of(model: str, forms: list[str], folder: Path) -> dict[str, Path | BaseException]:
    """The exports that `forms` run on, made in `folder`: each export's folder, or the error that kept it from being
    made (BENCHMARKS_FAIL may name it)."""
    exports: dict[str, Path | BaseException] = {}
    for export in dict.fromkeys(ONNX[form][0] for form in forms if form in ONNX):
        try:
            if model == PAPER:
                raise RuntimeError("not measured: an untrained model in memory has no file to export")
            fail_if_asked(export)
            from captioner.onnx_export import export_onnx

            name = export.replace(", ", "_").replace(" ", "_")
            exports[export] = export_onnx(model, folder / name, **EXPORTS[export])
        except Exception as err:
            exports[export] = err
    return exports


def captioner(model: str, form: str, device: torch.device, exports: dict[str, Path | BaseException]):
    """`form`'s captioner of `model` (a bundled model's name, a checkpoint, or PAPER) on `device`, an ONNX form's on
    its export in `exports` (`exports_of`). Raises what keeps it from being built."""
    fail_if_asked(form)
    if form in TORCH:
        if model == PAPER:
            return Captioner(*paper_model(), device=device, **TORCH[form])
        return Captioner.load(model, device=device, **TORCH[form])
    export, options = ONNX[form]
    runtime = providers(device)
    if isinstance(exports[export], BaseException):
        raise exports[export]
    from captioner.onnx import Captioner as OnnxCaptioner

    return OnnxCaptioner(exports[export], runtime, **options)


def captioners(
    model: str, forms: list[str], device: torch.device, exports: dict[str, Path | BaseException]
) -> dict[str, object | BaseException]:
    """Each form's captioner of `model` in this process (`captioner`), or the error that kept it from being built."""
    made: dict[str, object | BaseException] = {}
    for form in forms:
        try:
            made[form] = captioner(model, form, device, exports)
        except Exception as err:
            made[form] = err
    return made
