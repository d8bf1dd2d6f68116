"""Register use of kernels compiled for the H200 (sm_90): Triton compiles without a GPU.

The tests that pin a tuning snapshot (registers, spills, programs an SM of the launched configurations)
are in the GPU/perf group (`gpu`): they run with `pytest -m gpu` on the machine where the kernels are
tuned, since a compiler update may move them without any change in behaviour."""

import pytest
import torch

from experiments import kernel_resources as res

pytestmark = pytest.mark.skipif(not (res.TOOLS / "cuobjdump").exists(), reason="triton ships no cuobjdump here")
on_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU tuning snapshot: pytest -m gpu on a GPU")


@pytest.fixture(scope="module")
def still_triton():
    from linearize.ops.still import triton as still_triton

    return still_triton


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("d", [64, 128])
def test_still_key_kernel_does_not_spill_as_launched(still_triton, d):
    launch = still_triton.key_kernel_launch(torch.bfloat16, d, d)
    found = res.resources(still_triton._bwd_dkv_kernel, res.still_key_kernel_types("bf16"),
                          {"D": d, "F": d, "DT": still_triton.DOT_DTYPES[torch.bfloat16], "BM": launch["BM"],
                           "BN": launch["BN"]}, divisible=("L",), num_warps=launch["num_warps"],
                          num_stages=launch["num_stages"])
    assert found["spilled"] == 0
    assert 0 < found["registers"] <= 255 and 0 < found["shared"] <= 227 * 1024


@pytest.mark.gpu
@on_gpu
def test_square_tiles_on_four_warps_spill(still_triton):
    """Square 64 x 64 tiles on four warps, the configuration the launch avoids: the check sees their spills."""
    found = res.resources(still_triton._bwd_dkv_kernel, res.still_key_kernel_types("bf16"),
                          {"D": 64, "F": 64, "DT": still_triton.DOT_DTYPES[torch.bfloat16], "BM": 64, "BN": 64},
                          divisible=("L",), num_warps=4, num_stages=3)
    assert found["registers"] == 255 and found["spilled"] > 0


@pytest.mark.gpu
@on_gpu
def test_alignment_hints_as_at_launch_save_registers(still_triton):
    constants = {"D": 64, "F": 64, "DT": still_triton.DOT_DTYPES[torch.bfloat16], "BM": 64, "BN": 64}
    hinted, plain = (res.resources(still_triton._bwd_dkv_kernel, res.still_key_kernel_types("bf16"), constants,
                                   divisible=("L",), aligned=aligned, num_warps=4, num_stages=3)
                     for aligned in (True, False))
    assert hinted["spilled"] < plain["spilled"]


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("gate, save", [(True, False), (False, True)])
@pytest.mark.parametrize("features", [64, 128])
def test_still_wide_forward_fits_its_shared_memory(still_triton, gate, save, features):
    """The wide tiles where `forward_launch` takes them (a gated prefill, a continued call's parts): in
    exactly the shared memory it checks the GPU for at that many features, with no spills at 64 features
    and a few bytes at 128 (measured faster all the same); a gated pass saving the parts, which it
    leaves on square tiles, spills far more."""
    found = res.still_forward(still_triton.WIDE_FORWARD, gate, save, features)
    assert found["shared"] == still_triton.WIDE_FORWARD_SHARED[features]
    assert found["spilled"] <= (0 if features == 64 else 16), found
    assert res.still_forward(still_triton.WIDE_FORWARD, True, True, features)["spilled"] > 100


def test_every_argument_needs_a_type_or_value(still_triton):
    with pytest.raises(ValueError, match="no type or value for .*BN"):
        res.resources(still_triton._bwd_dkv_kernel, res.still_key_kernel_types("bf16"),
                      {"D": 64, "F": 64, "DT": still_triton.DOT_DTYPES[torch.bfloat16], "BM": 64})


@pytest.mark.gpu
@on_gpu
def test_lizard_window_key_pass_does_not_spill_as_launched():
    from linearize.ops.gla_window.triton import Config

    cfg = Config.default(torch.bfloat16)
    found = res.lizard_window_dkv(cfg.window_dkv_block, cfg.warps, cfg.stages)
    assert found["spilled"] == 0 and 0 < found["registers"] <= 255


@pytest.mark.gpu
@on_gpu
def test_lizard_fused_backward_fits_two_programs_an_sm_as_launched():
    """The fused chunk kernel holds a chunk's state and state gradient at once; at the default's warps
    two programs must still share an SM (an H200 SM has 64K registers and 228 KB of shared memory, 1
    KB of it reserved per block): the occupancy its timings assume (docs/kernels.md)."""
    from linearize.ops.gla_window.triton import Config

    cfg = Config.default(torch.bfloat16)
    found = res.lizard_chunk_backward(cfg.warps, cfg.stages, cfg.chunk)
    assert res.programs_per_sm(found, cfg.warps) >= 2


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("save", [False, True])
def test_lizard_forward_fits_three_programs_an_sm_as_launched(save):
    """The default caps the forward chunk kernel's registers so that three of its programs share an SM
    (on the H200: 6.05 ms against 7.5 uncapped at B=32, L=8K; docs/kernels.md). What the cap spills stays
    small (8 bytes a thread for inference, 72 saving the backward's parts, compiled here): holding
    y_gla in registers through the window instead spills 256 and is slower."""
    from linearize.ops.gla_window import triton as lizard_triton

    cfg = lizard_triton.Config.default(torch.bfloat16)
    assert cfg.tma
    constants = res.lizard_forward_constants(cfg, 128) | {"SAVE": save}
    capped = res.lizard_forward(constants, cfg.warps, cfg.forward_stages, max_registers=cfg.forward_registers)
    assert res.programs_per_sm(capped, cfg.warps) == 3
    assert capped["spilled"] <= 128
    uncapped = res.lizard_forward(constants, cfg.warps, cfg.forward_stages)
    assert res.programs_per_sm(uncapped, cfg.warps) == 2 and uncapped["spilled"] == 0


@pytest.mark.gpu
@on_gpu
def test_lizard_state_pass_fits_two_programs_an_sm_without_spilling_as_launched():
    """The forward state pass holds a 128 x 128 float32 state a program; at the default's 4 warps and 3
    stages two programs share an SM, unspilled: the occupancy at which it matches fla's state pass on the
    H200 (2.40 ms against fla's 2.50 at B=32, L=8K; docs/kernels.md)."""
    from linearize.ops.gla_window.triton import Config

    cfg = Config.default(torch.bfloat16)
    found = res.lizard_state_pass(cfg.state_block_k, cfg.state_block_v, cfg.state_warps, cfg.state_stages)
    assert found["spilled"] == 0
    assert res.programs_per_sm(found, cfg.state_warps) == 2


@pytest.mark.gpu
@on_gpu
def test_features_kernel_one_pass_on_bf16_weights_spills_least():
    """At the Llama-3-8B shape, the one-pass product on bf16 weights spills least (8 bytes a thread on
    Triton 3.6; 3xTF32 on the same operands 560); walking blocks with the weights held spills more,
    float32 weights most."""
    one_pass, walking = res.features_kernel("bf16", walk=False), res.features_kernel("bf16", walk=True)
    bf16_tf32 = res.features_kernel("bf16", walk=False, native=False)
    tf32, tf32_walking = res.features_kernel("fp32", walk=False), res.features_kernel("fp32", walk=True)
    assert one_pass["spilled"] <= 64
    assert one_pass["spilled"] < walking["spilled"] < tf32_walking["spilled"]
    assert one_pass["spilled"] < min(bf16_tf32["spilled"], tf32["spilled"])
    assert res.programs_per_sm(one_pass, 4) == 2


@pytest.mark.gpu
@on_gpu
def test_features_backward_holds_stage_1_in_registers_at_the_8b_shape():
    """Stage 1's features backward (weights' gradients) at d = 128 as launched, a column block at a
    time: no spills, where holding all 128 columns of x and W takes more registers."""
    from linearize.ops.features import triton as features_triton

    launched = res.features_backward(False, features_triton.BWD_COLUMNS)
    whole = res.features_backward(False, 128)
    assert launched["spilled"] == 0 and launched["registers"] < whole["registers"]


@pytest.mark.gpu
@on_gpu
def test_still_kernels_at_head_dim_256_fit_in_16_bits_and_spill_in_float32():
    """Why `still_triton.supports` takes Gemma's 256-wide heads in 16 bits only."""
    bf16, fp32 = (res.still_kernels(256, 256, dtype) for dtype in (torch.bfloat16, torch.float32))
    assert all(found["spilled"] == 0 and found["shared"] <= 227 * 1024 for found in bf16.values()), bf16
    assert all(found["spilled"] > 0 for found in fp32.values()), fp32
