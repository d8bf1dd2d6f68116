from experiments.scripts.simulate_serve_pacing import simulate

COSTS = {"per_token": 29e-6, "per_call": 0.004, "step_1": 0.0055, "step_64": 0.011}


def test_a_prefill_budget_of_one_step_evens_the_pace_at_a_lower_output_rate():
    """A burst of 64 requests with 4K prompts: whole 16K chunks stall the running requests for a whole
    prompt's prefill (p99 far above p50); chunks sized to one decode step keep p99 within 2x of p50
    and cost output rate."""
    whole = simulate(64, 4096, 256, chunk=16384, budget=0.0, **COSTS)
    paced = simulate(64, 4096, 256, chunk=16384, budget=1.0, **COSTS)
    assert whole["itl_p99_ms"] > 5 * whole["itl_p50_ms"]
    assert paced["itl_p99_ms"] <= 2 * paced["itl_p50_ms"]
    assert paced["tokens_per_s"] < whole["tokens_per_s"]


def test_every_request_gets_all_its_tokens_whatever_the_pacing():
    for budget in (0.0, 0.5, 3.0):
        assert simulate(3, 100, 5, chunk=64, budget=budget, **COSTS)["output_tokens"] == 3 * 5
