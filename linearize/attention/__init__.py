"""Linearized attention modules, one per method."""

from .base import LinearizedAttention
from .liger import LigerAttention
from .lizard import LizardAttention
from .lolcats import LolcatsAttention
from .still import StillAttention

ATTENTION_CLASSES = {
    "lizard": LizardAttention,
    "still": StillAttention,
    "lolcats": LolcatsAttention,
    "liger": LigerAttention,
}

__all__ = [
    "ATTENTION_CLASSES",
    "LigerAttention",
    "LinearizedAttention",
    "LizardAttention",
    "LolcatsAttention",
    "StillAttention",
]
