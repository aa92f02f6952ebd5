"""Caption without PyTorch: a model that `captioner export --format onnx` wrote, run on ONNX Runtime with numpy and
Pillow (`Captioner`). Importing this package imports no torch (tests/test_onnx.py checks it); installed alone, from
`deploy/`, it needs none either.

    from captioner.onnx import Captioner
    results = Captioner("shapes_onnx/").caption(["photo.jpg"])
    results[0].text, results[0].score, results[0].alphas, results[0].grid_hw
"""

from .runtime import Captioner, CaptionResult, is_export

__all__ = ["CaptionResult", "Captioner", "is_export"]
