"""Distillation: stage 1 attention transfer, stage 2 LoRA (see distillation.py).

The names load on first use (PEP 562), so the command's parser imports no torch.
"""

from linearize._lazy import lazy_exports

_EXPORTS = {"DistillConfig": "config", "ResumeError": "run_dir", "TrainingDiverged": "losses",
            "distill": "distillation", "ensure_distilled": "distillation"}

__all__ = ["DistillConfig", "ResumeError", "TrainingDiverged", "distill", "ensure_distilled"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
