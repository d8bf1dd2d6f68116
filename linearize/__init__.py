"""linearize: turn a pretrained Transformer LLM into a subquadratic one, distil it, evaluate it, run it."""

from . import modeling  # noqa: F401  (registers the linearized model types with transformers' Auto classes)
from .cache import LinearizeCacheLayer, cache_nbytes
from .config import METHOD_CONFIGS, make_method_config
from .convert import UnsupportedModelError, convert

__all__ = ["METHOD_CONFIGS", "LinearizeCacheLayer", "UnsupportedModelError", "cache_nbytes", "convert",
           "make_method_config"]
