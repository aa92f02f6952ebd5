"""captioner_onnx: caption images with a model that `captioner export --format onnx` wrote, on ONNX Runtime, without
PyTorch. It is the full package's `captioner.onnx`, with the image reading and errors it uses, installed under a name
of its own (deploy/pyproject.toml), so that it and the full `captioner` can share an environment.

    from captioner_onnx import Captioner
    results = Captioner("shapes_onnx/").caption(["photo.jpg"])
    results[0].text, results[0].score, results[0].alphas, results[0].grid_hw
"""

from .errors import CaptionerError
from .onnx import Captioner, CaptionResult, is_export

__all__ = ["CaptionResult", "Captioner", "CaptionerError", "is_export"]
