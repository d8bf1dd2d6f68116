"""linearize: turn a pretrained Transformer LLM into a subquadratic one, distil it, evaluate it, run it.

The public names load on first use (PEP 562 `__getattr__`), so `import linearize` and `linearize --help`
import neither torch nor transformers.

Hugging Face convention: after `import linearize`, `AutoModelForCausalLM.from_pretrained(<a linearized
checkpoint>)` finds our model types, which `linearize.modeling` registers with the Auto classes. It is
imported at once when transformers already is; otherwise `_RegisterAfterTransformers` (a `sys.meta_path`
finder) imports it right after transformers first finishes importing, or, when that happens inside the
import of one of our own modules, right after that import ends (modeling needs our half-imported modules
complete). The finder only wraps the loaders of `transformers` and `linearize.*`, and removes itself once
it has registered.
"""

import importlib
import sys
import types

from ._lazy import lazy_exports

# Public name -> the submodule that defines it.
_EXPORTS = {
    "METHOD_CONFIGS": "config", "ConfigError": "config", "make_method_config": "config",
    "LinearizeCacheLayer": "cache", "cache_nbytes": "cache",
    "UnsupportedModelError": "convert", "convert": "convert", "set_inference_options": "convert",
    "ModelSpecError": "loading", "load_model": "loading", "load_tokenizer": "loading",
    "DistillConfig": "train", "distill": "train",
}

__all__ = ["METHOD_CONFIGS", "ConfigError", "DistillConfig", "LinearizeCacheLayer", "ModelSpecError", "UnsupportedModelError",
           "cache_nbytes", "convert", "distill", "load_model", "load_tokenizer", "make_method_config",
           "set_inference_options"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


class _Package(types.ModuleType):
    """`linearize.convert` is the exported function, not the submodule of that name, whether or not
    that submodule has been imported (by the lazy export or by any of our modules): the import
    system's setattr of a submodule onto its package is ignored for names the package exports."""

    def __setattr__(self, name, value):
        if name in _EXPORTS and isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.{name}":
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


class _RegisterAfterTransformers:
    """A `sys.meta_path` finder that imports `linearize.modeling` once transformers is imported and none
    of our modules is mid-import (see the module docstring). Not thread-safe across concurrent imports:
    at worst the registration happens at the next import of one of our modules."""

    def __init__(self):
        self.executing = 0  # imports of watched modules under way

    def find_spec(self, name, path=None, target=None):
        if name != "transformers" and not name.startswith(f"{__name__}."):
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _WatchedLoader(spec.loader, self)
                return spec
        return None

    def register_if_ready(self):
        if self.executing or "transformers" not in sys.modules or self not in sys.meta_path:
            return
        sys.meta_path.remove(self)
        importlib.import_module(f"{__name__}.modeling")


class _WatchedLoader:
    """A module's own loader, telling the finder when the module has executed."""

    def __init__(self, loader, finder: _RegisterAfterTransformers):
        self._loader, self._finder = loader, finder

    def __getattr__(self, name):  # get_code, get_source, get_resource_reader, is_package, ...
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._finder.executing += 1
        try:
            self._loader.exec_module(module)
        finally:
            self._finder.executing -= 1
        self._finder.register_if_ready()


if "transformers" in sys.modules:
    from . import modeling  # noqa: F401  (registers the linearized model types with transformers' Auto classes)
elif not any(type(finder).__name__ == "_RegisterAfterTransformers" for finder in sys.meta_path):  # once, even on reload
    sys.meta_path.insert(0, _RegisterAfterTransformers())
