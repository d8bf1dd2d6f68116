"""GET /metrics: Prometheus's text format, vLLM's metrics under `linearize:`, counting what the requests do."""

import math
import re

import pytest
from fastapi.testclient import TestClient
from serve_helpers import ScriptedEngine
from tiny_models import tiny_tokenizer

from linearize.serve.app import create_app
from linearize.serve.prometheus import Counter, Histogram, exposition

NAME = "tiny"
REPLY = "Hello, world!"
METRICS = {"linearize:num_requests_running": "gauge", "linearize:num_requests_waiting": "gauge",
           "linearize:prompt_tokens_total": "counter", "linearize:generation_tokens_total": "counter",
           "linearize:request_success_total": "counter", "linearize:time_to_first_token_seconds": "histogram",
           "linearize:inter_token_latency_seconds": "histogram", "linearize:e2e_request_latency_seconds": "histogram",
           "linearize:prefix_cache_queries_total": "counter", "linearize:prefix_cache_hits_total": "counter",
           "linearize:prefix_cache_host_bytes": "gauge", "linearize:prefix_cache_offloads_total": "counter",
           "linearize:prefix_cache_reloads_total": "counter"}
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{((?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*",?)*)\})? '
                    r'(\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')


def parse(text: str) -> tuple[dict[str, str], dict[tuple, float]]:
    """The TYPE of each metric and the value of each sample (name, sorted labels), checking every line's
    syntax and that each sample follows its metric's HELP and TYPE."""
    assert text.endswith("\n")
    types, samples, current = {}, {}, None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            current = line.split()[2]
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert name == current and kind in ("counter", "gauge", "histogram")
            types[name] = kind
            continue
        match = SAMPLE.match(line)
        assert match, line
        name, labels, value = match.groups()
        base = re.sub(r"_(bucket|sum|count)$", "", name) if types.get(current) == "histogram" else name
        assert base == current, line
        samples[(name, tuple(sorted(LABEL.findall(labels or ""))))] = float(value)
    return types, samples


def value(samples, name, **labels) -> float:
    return samples[(name, tuple(sorted({"model_name": NAME, **labels}.items())))]


@pytest.fixture
def client():
    tokenizer = tiny_tokenizer()
    engine = ScriptedEngine(tokenizer.encode(REPLY, add_special_tokens=False))
    app = create_app(engine, tokenizer, NAME, 60, max_completion_tokens=64)
    with TestClient(app) as client:
        client.tokenizer, client.engine = tokenizer, engine
        yield client


def scrape(client):
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    return parse(response.text)


def test_metrics_parse_and_name_vllms_metrics_under_linearize(client):
    types, samples = scrape(client)
    assert types == METRICS
    assert value(samples, "linearize:num_requests_running") == 0
    assert value(samples, "linearize:request_success_total", finished_reason="stop") == 0
    assert value(samples, "linearize:time_to_first_token_seconds_bucket", le="+Inf") == 0


def test_counters_and_histograms_grow_with_each_request(client):
    _, before = scrape(client)
    prompt_tokens = len(client.tokenizer.encode("Say hi"))
    for max_tokens in (5, 40):
        response = client.post("/v1/completions", json={"model": NAME, "prompt": "Say hi", "max_tokens": max_tokens})
        assert response.status_code == 200
    _, after = scrape(client)

    def grew(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    generated = 5 + len(client.tokenizer.encode(REPLY, add_special_tokens=False))
    assert grew("linearize:prompt_tokens_total") == 2 * prompt_tokens
    assert grew("linearize:generation_tokens_total") == generated
    assert grew("linearize:request_success_total", finished_reason="length") == 1
    assert grew("linearize:request_success_total", finished_reason="stop") == 1
    assert grew("linearize:time_to_first_token_seconds_count") == 2
    assert grew("linearize:inter_token_latency_seconds_count") == generated - 2
    assert grew("linearize:e2e_request_latency_seconds_count") == 2
    assert value(after, "linearize:e2e_request_latency_seconds_sum") > 0


def test_the_prefix_cache_counters_read_the_engines_token_counts(client):
    """Queries and hits in prompt tokens, as the engine counts them (vLLM's hit rate: hits / queries)."""
    client.engine.prefix_cache.update(query_tokens=120, hit_tokens=40)
    _, samples = scrape(client)
    assert value(samples, "linearize:prefix_cache_queries_total") == 120
    assert value(samples, "linearize:prefix_cache_hits_total") == 40


def test_the_prefix_cache_host_tier_metrics_read_the_engines_stats(client):
    """The host tier's bytes, and the snapshots moved to it and back; 0 while there is none."""
    _, samples = scrape(client)
    assert [value(samples, f"linearize:prefix_cache_{name}") for name in
            ("host_bytes", "offloads_total", "reloads_total")] == [0, 0, 0]
    client.engine.prefix_cache.update(host_bytes=4096, offloads=3, reloads=2)
    _, samples = scrape(client)
    assert value(samples, "linearize:prefix_cache_host_bytes") == 4096
    assert value(samples, "linearize:prefix_cache_offloads_total") == 3
    assert value(samples, "linearize:prefix_cache_reloads_total") == 2


def test_a_histogram_counts_cumulatively_up_to_inf_and_labels_are_escaped():
    histogram = Histogram("h_seconds", "a histogram", (0.1, 1.0), {"model_name": 'a"b\\c\nd'})
    for seconds in (0.05, 0.1, 0.5, 3.0):
        histogram.observe(seconds)
    counter = Counter("c_total", "a counter", label="why", values=("stop",))
    counter.inc(2, value="stop")
    types, samples = parse(exposition([histogram, counter]))
    labels = (("model_name", 'a\\"b\\\\c\\nd'),)
    assert types == {"h_seconds": "histogram", "c_total": "counter"}
    assert [samples[("h_seconds_bucket", tuple(sorted((*labels, ("le", le)))))] for le in ("0.1", "1", "+Inf")] == \
        [2, 3, 4]
    assert samples[("h_seconds_count", labels)] == 4 and math.isclose(samples[("h_seconds_sum", labels)], 3.65)
    assert samples[("c_total", (("why", "stop"),))] == 2
    with pytest.raises(ValueError):
        counter.inc(-1)
