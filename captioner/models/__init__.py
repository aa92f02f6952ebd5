"""The model as plain PyTorch modules. Its names are imported when first asked for, so that
`captioner.models.search_host`, plain numpy, is imported without torch (`captioner.onnx`'s host loop reads it)."""

from importlib import import_module

_WHERE = {
    "AdditiveAttention": "attention",
    "DotAttention": "attention",
    "GeneralAttention": "attention",
    "AttentionDecoder": "decoder",
    "Encoder": "encoder",
    "ShowAttendTell": "show_attend_tell",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(f"captioner.models.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
