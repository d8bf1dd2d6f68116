"""The same equivalences on a CUDA device (skipped without one): decode == prefill, chunked == naive."""

import pytest
import torch
from tiny_models import METHODS, tiny_student
from transformers import DynamicCache

import linearize
from linearize.ops.gla_window import GlaWindowOptions
from linearize.ops.gla_window import naive as gla_window
from linearize.ops.gla_window.chunk import gla_window_chunked

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def cuda_student(method):
    return tiny_student(method).cuda()


@pytest.mark.parametrize("method", METHODS)
def test_prefill_equals_decode_on_cuda(method):
    model = cuda_student(method)
    ids = torch.randint(3, 128, (2, 45), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        steps = torch.cat([model(ids[:, t : t + 1], past_key_values=cache).logits for t in range(45)], 1)
    torch.testing.assert_close(steps, full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("gate_dim", [1, 64])
def test_chunked_equals_naive_on_cuda_at_length_2048(gate_dim):
    g = torch.Generator("cuda").manual_seed(0)
    B, H, HKV, L, D, F = 1, 4, 2, 2048, 64, 64
    rand = lambda *s: torch.randn(*s, device="cuda", generator=g)
    fq, fk = torch.softmax(rand(B, H, L, F), -1), torch.softmax(rand(B, H, L, F), -1)
    log_g = torch.nn.functional.logsigmoid(rand(B, H, L, gate_dim) + 4)
    qw, kw, v = rand(B, H, L, D), rand(B, HKV, L, D), rand(B, HKV, L, D)
    valid = torch.ones(B, L, dtype=torch.bool, device="cuda")
    state = gla_window.init_state(B, H, HKV, F, D, 128, device="cuda")
    opts = GlaWindowOptions(window=128, scale=D**-0.5, sinks=rand(H, 4), alpha=torch.ones(H, device="cuda"))
    y_ref, _ = gla_window.gla_window_parallel(fq, fk, log_g, qw, kw, v, valid, state, opts)
    y, _ = gla_window_chunked(fq, fk, log_g, qw, kw, v, valid, state, opts)
    assert ((y - y_ref).norm() / y_ref.norm()).item() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_real_teacher_bf16_training_step_and_generate(method):
    from linearize.loading import load_model
    from linearize.train.config import DistillConfig
    from linearize.train.losses import stage_loss
    from linearize.train.student import prepare_stage

    model = linearize.convert(load_model("smollm2"), method).cuda()
    cfg = DistillConfig(model="smollm2", method=method, out="unused")
    ids = torch.randint(0, 49152, (2, 1024), device="cuda")
    for stage in ((1, 2) if method != "liger" else (2,)):
        trained, _ = prepare_stage(model, cfg, stage)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = stage_loss(trained, ids, stage)
        loss.backward()
        assert torch.isfinite(loss)
        assert all(torch.isfinite(p.grad).all() for p in trained.parameters() if p.grad is not None)
        if stage == 2:
            model = trained.merge_and_unload()
    with torch.no_grad():
        out = model.generate(ids[:, :16], max_new_tokens=8, do_sample=False)
    assert out.shape == (2, 24)


@pytest.mark.parametrize("method,backend", [("lizard", None), ("liger", None), ("lolcats", None), ("still", None),
                                            ("still", "inductor")])
def test_cuda_graph_decode_equals_eager(method, backend):
    """A captured step (STILL's also through inductor, its attention step compiled once for every
    layer) decodes the eager step's tokens."""
    from linearize.decode import StaticDecoder, greedy_decode

    model = cuda_student(method)
    ids = torch.randint(3, 128, (3, 21), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    graphed = greedy_decode(model, ids, 24, cuda_graph=True, compile_backend=backend)
    eager = greedy_decode(model, ids, 24, cuda_graph=False)
    assert torch.equal(graphed, eager)
    # and the step was captured (and compiled), not left eager by a failed capture (or compile)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    decoder = StaticDecoder(model, cache, batch=ids.shape[0], cuda_graph=True, compile_backend=backend)
    decoder.step(ids[:, -1:])
    if backend is None:
        assert decoder.path.startswith("cuda graph"), decoder.path
    else:
        assert decoder.path == ("cuda graph, fused projections, compiled (inductor, the attention step once for "
                                "every layer)")
    decoder.close()


@pytest.mark.parametrize("method", ["lizard", "still"])
def test_left_padded_graph_decode_equals_hf_generate(method):
    """The evaluation's path on a GPU: left padding, per-row positions, a captured step."""
    from transformers import GenerationConfig

    from linearize.decode import greedy_decode, until_end

    model = cuda_student(method)
    g = torch.Generator("cuda").manual_seed(1)
    ids = torch.randint(3, 128, (3, 30), device="cuda", generator=g)
    mask = torch.ones_like(ids)
    mask[0, :9], mask[2, :4] = 0, 0
    ids = ids.masked_fill(mask == 0, 0)
    eos = model.generation_config.eos_token_id
    config = GenerationConfig(max_new_tokens=16, do_sample=False, num_beams=1, pad_token_id=0, eos_token_id=eos)
    with torch.no_grad():
        expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1]:]
    got = greedy_decode(model, ids, 16, attention_mask=mask, eos_token_id=eos, cuda_graph=True)
    assert until_end(got, eos) == until_end(expected, eos)


def test_decoders_leave_no_memory_behind():
    """Each bench point builds a decoder: the third one must end with as much memory allocated as the second."""
    import gc

    from linearize.decode import greedy_decode

    model = cuda_student("lizard")
    ids = torch.randint(3, 128, (2, 21), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    allocated = []
    for _ in range(3):
        greedy_decode(model, ids, 4, cuda_graph=True)
        gc.collect()
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    assert allocated[2] == allocated[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", METHODS)
def test_graphed_static_prefill_equals_eager_and_captures(method, dtype):
    """The serving engine's paced prefill: chunks replayed from graphs (first and later chunks, two
    sequences through one cache) give the eager chunks' logits and state, and every size captured."""
    from linearize.prefill import StaticPrefill, largest_size, power_of_two_sizes

    model = cuda_student(method).to(dtype)
    graphed = StaticPrefill(model, sizes=power_of_two_sizes(16), cuda_graph=True)
    graphed.capture()
    assert graphed.graphed, graphed.graph_error
    eager = StaticPrefill(model, sizes=graphed.sizes, cuda_graph=False)
    g = torch.Generator().manual_seed(4)
    for length in (45, 23):
        prompt = torch.randint(3, 128, (length,), generator=g).tolist()
        last = []
        for prefill in (graphed, eager):
            prefill.reset()
            done = 0
            while done < length:
                size = largest_size(prefill.sizes, min(16, length - done))
                logits = prefill.run(prompt[done:done + size]).clone()
                done += size
            last.append(logits)
        tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
        torch.testing.assert_close(*last, **tolerance)
        for mine, theirs in zip(graphed.cache.layers, eager.cache.layers, strict=True):
            for name, tensor in theirs.state.items():
                torch.testing.assert_close(mine.state[name], tensor, **tolerance, msg=name)


@pytest.mark.parametrize("method", ["lizard", "still"])
def test_delta_memory_on_cuda_equals_the_cpu_model_and_decodes_as_it_prefills(method):
    """fla's kernels (or the torch form where they do not take the call) against the CPU model, in values
    and gradients, and token-by-token decode against the full forward."""
    cpu = tiny_student(method, memory="delta")
    gpu = tiny_student(method, memory="delta").cuda()
    ids = torch.randint(3, 128, (2, 70), generator=torch.Generator().manual_seed(0))
    logits = {}
    for name, model in (("cpu", cpu), ("gpu", gpu)):
        out = model(ids.to(next(model.parameters()).device)).logits
        out.float().square().mean().backward()
        logits[name] = out.detach().cpu()
    torch.testing.assert_close(logits["gpu"], logits["cpu"], atol=2e-3, rtol=0)
    for (name, p_cpu), p_gpu in zip(cpu.named_parameters(), gpu.parameters(), strict=True):
        if "memory" in name and p_cpu.grad is not None:
            torch.testing.assert_close(p_gpu.grad.cpu(), p_cpu.grad, atol=2e-3, rtol=2e-2, msg=name)
    cache = DynamicCache(config=gpu.config)
    with torch.no_grad():
        steps = torch.cat([gpu(ids[:, t : t + 1].cuda(), past_key_values=cache).logits for t in range(70)], 1)
    torch.testing.assert_close(steps.cpu(), logits["gpu"], atol=2e-3, rtol=0)
