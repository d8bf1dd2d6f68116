"""Distillation: stage 1 attention transfer, stage 2 LoRA (see distill.py)."""

from .config import DistillConfig
from .distillation import ResumeError, distill, ensure_distilled

__all__ = ["DistillConfig", "ResumeError", "distill", "ensure_distilled"]
