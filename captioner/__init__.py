"""captioner: Show, Attend and Tell (Xu et al. 2015) image captioning with visual attention.

The public names are imported when first used, so that `captioner --help` starts without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from captioner.api import Captioner
    from captioner.data.vocab import Vocabulary
    from captioner.models.show_attend_tell import ShowAttendTell

__all__ = ["Captioner", "ShowAttendTell", "Vocabulary"]
__version__ = "0.1.0"

_MODULES = {
    "Captioner": "captioner.api",
    "ShowAttendTell": "captioner.models.show_attend_tell",
    "Vocabulary": "captioner.data.vocab",
}


def __getattr__(name: str):
    if name in _MODULES:
        return getattr(importlib.import_module(_MODULES[name]), name)
    raise AttributeError(f"module 'captioner' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_MODULES])
