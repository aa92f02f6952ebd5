"""Caption without PyTorch: a model that `captioner export --format onnx` wrote, run on ONNX Runtime with numpy and
Pillow (`Captioner`). Importing this package imports no torch (tests/test_onnx.py checks it); installed alone, from
`deploy/`, it needs none either.

    from captioner.onnx import Captioner
    results = Captioner("shapes_onnx/").caption(["photo.jpg"])
    results[0].text, results[0].score, results[0].alphas, results[0].grid_hw
"""

__all__ = ["CaptionResult", "Captioner", "is_export"]


def __getattr__(name: str):
    """The runtime's names, imported when first asked for: `captioner.onnx.layout` alone imports no ONNX Runtime (the
    full package's model-file rules read it without the onnx extra)."""
    if name in __all__:
        from . import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
