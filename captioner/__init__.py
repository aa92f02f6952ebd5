"""captioner: Show, Attend and Tell (Xu et al. 2015) image captioning with visual attention."""

from captioner.api import Captioner
from captioner.data.vocab import Vocabulary
from captioner.models.show_attend_tell import ShowAttendTell

__all__ = ["Captioner", "ShowAttendTell", "Vocabulary"]
__version__ = "0.1.0"
