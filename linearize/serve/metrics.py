"""The server's metrics, as `GET /metrics` gives them (`prometheus` text format): vLLM's metrics of the same
meaning, named `linearize:` where vLLM's are `vllm:`, each labelled with the served model's name.

Times are measured where the web layer sees a request: from its submission to the engine to its first
token, between its tokens, and to its end.
"""

from __future__ import annotations

from collections.abc import Callable

from .prometheus import Counter, Gauge, Histogram, ReadCounter, exposition

# Seconds; the bounds vLLM's histograms of the same names use, cut to the range a served request spans.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                       40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
FINISHED_REASONS = ("stop", "length")


class ServeMetrics:
    """What the web layer counts (`request_started`, `token`, `request_finished`) and the engine's gauges,
    read when scraped from `stats` (the engine's `stats()`: "running", "waiting" and "prefix_cache")."""

    def __init__(self, model_name: str, stats: Callable[[], dict]):
        labels = {"model_name": model_name}
        self.running = Gauge("linearize:num_requests_running", "Requests prefilling or generating.",
                             lambda: stats()["running"], labels)
        self.waiting = Gauge("linearize:num_requests_waiting", "Requests waiting for a place.",
                             lambda: stats()["waiting"], labels)
        self.prompt_tokens = Counter("linearize:prompt_tokens_total", "Prompt tokens of the requests taken.", labels)
        self.generation_tokens = Counter("linearize:generation_tokens_total", "Tokens generated.", labels)
        self.success = Counter("linearize:request_success_total", "Requests finished, by why they ended.", labels,
                               label="finished_reason", values=FINISHED_REASONS)
        self.ttft = Histogram("linearize:time_to_first_token_seconds", "Seconds from a request's submission to "
                              "its first token.", TTFT_BUCKETS, labels)
        self.inter_token = Histogram("linearize:inter_token_latency_seconds", "Seconds between a request's "
                                     "successive tokens.", INTER_TOKEN_BUCKETS, labels)
        self.e2e = Histogram("linearize:e2e_request_latency_seconds", "Seconds from a request's submission to "
                             "its end.", E2E_BUCKETS, labels)
        def prefix_stat(name: str):
            return lambda: stats().get("prefix_cache", {}).get(name, 0)

        # Counted in prompt tokens, as vLLM counts them: hits / queries is the share of the prompts' tokens
        # restored from the cache, and hits the tokens it saved the prefill (0 while the cache is off).
        self.prefix_queries = ReadCounter("linearize:prefix_cache_queries_total", "Prompt tokens of the requests "
                                          "looked up in the prefix cache.",
                                          prefix_stat("query_tokens"), labels)
        self.prefix_hits = ReadCounter("linearize:prefix_cache_hits_total", "Prompt tokens restored from the "
                                       "prefix cache instead of prefilled.",
                                       prefix_stat("hit_tokens"), labels)
        # The host tier (`--prefix-cache-host-memory`): what it holds, and the snapshots moved into it and back.
        self.prefix_host_bytes = Gauge("linearize:prefix_cache_host_bytes", "Bytes of prefix cache snapshots "
                                       "kept in host memory.",
                                       prefix_stat("host_bytes"), labels)
        self.prefix_offloads = ReadCounter("linearize:prefix_cache_offloads_total", "Prefix cache snapshots moved "
                                           "from the device to host memory.",
                                           prefix_stat("offloads"), labels)
        self.prefix_reloads = ReadCounter("linearize:prefix_cache_reloads_total", "Prefix cache snapshots moved "
                                          "back from host memory to the device.",
                                          prefix_stat("reloads"), labels)
        self._all = [self.running, self.waiting, self.prompt_tokens, self.generation_tokens, self.success, self.ttft,
                     self.inter_token, self.e2e, self.prefix_queries, self.prefix_hits, self.prefix_host_bytes,
                     self.prefix_offloads, self.prefix_reloads]

    def request_started(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def token(self, since_last: float, first: bool) -> None:
        """A token arrived `since_last` seconds after the request's previous one (after its submission if
        `first`)."""
        self.generation_tokens.inc()
        (self.ttft if first else self.inter_token).observe(since_last)

    def request_finished(self, reason: str, seconds: float) -> None:
        """A request ended well (`reason`: "stop" or "length") `seconds` after its submission."""
        self.success.inc(value=reason)
        self.e2e.observe(seconds)

    def exposition(self) -> str:
        return exposition(self._all)
