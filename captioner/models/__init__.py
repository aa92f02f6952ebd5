from captioner.models.attention import AdditiveAttention, DotAttention, GeneralAttention
from captioner.models.decoder import AttentionDecoder
from captioner.models.encoder import Encoder
from captioner.models.show_attend_tell import ShowAttendTell

__all__ = ["AdditiveAttention", "AttentionDecoder", "DotAttention", "Encoder", "GeneralAttention", "ShowAttendTell"]
