"""The ops' public interface stays small: every public function takes at most 12 parameters (the
method's options travel as one object), and every form lists its kernels first and its PyTorch
implementation that takes every call last."""

import importlib
import inspect
import pkgutil

import pytest

import linearize.ops
from linearize.ops import backend, delta_rule, features, gla_window, lolcats, sparse_cache, still

MAX_PARAMETERS = 12


def op_modules():
    """Every module of `linearize.ops` but the test helpers (`testing`) and the interpreter patch; the
    Triton modules where triton is installed."""
    for info in pkgutil.walk_packages(linearize.ops.__path__, "linearize.ops."):
        leaf = info.name.rsplit(".", 1)[-1]
        if leaf in ("testing", "_interpreter"):
            continue
        try:
            yield importlib.import_module(info.name)
        except ImportError as e:
            if "triton" not in str(e):
                raise


def public_functions(module):
    exported = set(getattr(module, "__all__", ()))
    for name, value in vars(module).items():
        if not inspect.isfunction(value):
            continue
        if name in exported or (not name.startswith("_") and value.__module__ == module.__name__):
            yield name, value


def test_no_public_op_function_takes_more_than_12_parameters():
    checked, too_many = 0, []
    for module in op_modules():
        for name, function in public_functions(module):
            checked += 1
            count = len(inspect.signature(function).parameters)
            if count > MAX_PARAMETERS:
                too_many.append(f"{module.__name__}.{name}: {count}")
    assert checked > 40  # the walk found the ops
    assert not too_many, too_many


@pytest.mark.parametrize("package", [gla_window, still, features, delta_rule])
def test_each_form_ends_with_an_implementation_that_takes_every_call(package):
    assert package.FORMS
    for name, form in package.FORMS.items():
        assert form.name == name and name in package.__all__ + ["lizard_features"]
        *others, last = form.implementations
        # The kernels first, then any PyTorch form that takes only some calls (STILL's chunked one).
        flags = [impl.kernels for impl in others]
        assert flags and flags[0] and flags == sorted(flags, reverse=True)
        assert last.name == "torch" and not last.kernels and last.supports is backend.always


def test_the_forms_are_public_in_each_package():
    assert {"chunk_gla_window", "continue_gla_window", "gla_window_step", "GlaWindowOptions"} <= set(gla_window.__all__)
    assert {"chunk_still", "continue_still", "still_step", "StillOptions"} <= set(still.__all__)
    assert {"chunk_lolcats", "continue_lolcats", "lolcats_step", "LolcatsOptions"} <= set(lolcats.__all__)
    assert {"chunk_delta_rule", "continue_delta_rule", "delta_rule_step", "DeltaRuleOptions"} <= set(delta_rule.__all__)
    assert {"chunk_sparse_cache", "continue_sparse_cache", "sparse_cache_step", "SparseCacheOptions"} <= set(
        sparse_cache.__all__)


def test_the_sparse_cache_forms_run_their_pytorch_implementation_alone():
    for name, form in sparse_cache.FORMS.items():
        assert form.name == name and name in sparse_cache.__all__
        (only,) = form.implementations
        assert only.name == "torch" and not only.kernels and only.supports is backend.always
