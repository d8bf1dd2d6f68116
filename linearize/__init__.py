"""linearize: turn a pretrained Transformer LLM into a subquadratic one, distil it, evaluate it, run it."""

from . import modeling  # noqa: F401  (registers the linearized model types with transformers' Auto classes)
from .cache import LinearizeCacheLayer, cache_nbytes
from .config import METHOD_CONFIGS, ConfigError, make_method_config
from .convert import UnsupportedModelError, convert, set_inference_options
from .loading import ModelSpecError, load_model, load_tokenizer
from .train import DistillConfig, distill

__all__ = ["METHOD_CONFIGS", "ConfigError", "DistillConfig", "LinearizeCacheLayer", "ModelSpecError", "UnsupportedModelError",
           "cache_nbytes", "convert", "distill", "load_model", "load_tokenizer", "make_method_config",
           "set_inference_options"]
