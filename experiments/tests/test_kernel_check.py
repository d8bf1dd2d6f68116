import pytest
import torch

pytest.importorskip("triton")

from experiments.kernel_check import features_sweep_rows, state_sweep_configs
from linearize.ops.gla_window.triton import Config


def _state_knobs(cfg: Config) -> tuple[int, int, int, int]:
    return cfg.state_block_k, cfg.state_block_v, cfg.state_warps, cfg.state_stages


def test_state_sweep_covers_our_default_and_fla_tuned_choice():
    knobs = [_state_knobs(cfg) for cfg in state_sweep_configs()]
    assert len(knobs) == len(set(knobs))
    assert _state_knobs(Config.default(torch.bfloat16)) in knobs
    assert (64, 64, 2, 2) in knobs  # what fla 0.6's autotuner picked for chunk_fwd_kernel_h on the H200
    # No row holds more float32 state registers a thread than a thread has.
    assert all(k * v // (32 * w) <= 256 for k, v, w, _ in knobs)


def test_features_sweep_times_both_weight_dtypes_with_and_without_walking_blocks():
    rows = dict(features_sweep_rows(33))
    assert len(rows) == 4
    assert {(o["weight_dtype"], o["programs"]) for o in rows.values()} == {
        (dtype, programs) for dtype in (torch.bfloat16, torch.float32) for programs in (None, 33)}
