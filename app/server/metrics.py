"""Prometheus metrics under vLLM's names, so existing dashboards work.

Per-request metrics (tokens, latencies) are recorded in each frontend worker and summed across
gunicorn workers by prometheus-client's multiprocess mode (the bootstrap sets
PROMETHEUS_MULTIPROC_DIR). Engine state (running, waiting, KV usage, prefix cache, preemptions)
comes from the engine's heartbeat and is exported as it was last reported.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                   80.0, 160.0)


class Metrics:
    def __init__(self, model_name: str):
        labels = ["model_name"]
        self.model = model_name
        # registry=None: values live in the multiprocess files; render() collects them from there
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", labels, registry=None)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens processed.", labels,
                                         registry=None)
        self.success = Counter("vllm:request_success", "Finished requests.", labels + ["finished_reason"],
                               registry=None)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=LATENCY_BUCKETS, registry=None)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Time per output token.", labels,
                              buckets=LATENCY_BUCKETS, registry=None)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", labels,
                             buckets=LATENCY_BUCKETS, registry=None)

    def first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model).observe(seconds)

    def next_token(self, seconds: float) -> None:
        self.tpot.labels(self.model).observe(seconds)

    def finished(self, reason: str, seconds: float, prompt_tokens: int, output_tokens: int) -> None:
        self.success.labels(self.model, reason).inc()
        self.e2e.labels(self.model).observe(seconds)
        self.prompt_tokens.labels(self.model).inc(prompt_tokens)
        self.generation_tokens.labels(self.model).inc(output_tokens)


class EngineCollector:
    """The engine's own numbers, from the latest heartbeat this worker received."""

    def __init__(self, model_name: str, engine):
        self.model, self.engine = model_name, engine

    def collect(self):
        """One sample per replica, labelled `engine` (its index) as vLLM labels its engines."""
        replicas = self.engine.replicas
        gauges = [("vllm:num_requests_running", "Requests running in the engine.", lambda r: r.stats.running),
                  ("vllm:num_requests_waiting", "Requests waiting for a slot.", lambda r: r.stats.waiting),
                  ("vllm:kv_cache_usage_perc", "KV-cache usage (1 = all blocks in use).", lambda r: r.stats.kv_usage),
                  ("appliance:kv_cache_blocks_in_use", "KV blocks held by requests.", lambda r: r.stats.kv_blocks_used),
                  ("appliance:engine_ready", "1 when the engine is ready and alive.", lambda r: int(r.ready()))]
        counters = [("vllm:prefix_cache_queries", "Prefix-cache queries, in tokens.", lambda r: r.stats.prefix_queries),
                    ("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.", lambda r: r.stats.prefix_hits),
                    ("vllm:num_preemptions", "Preempted requests.", lambda r: r.stats.preemptions),
                    ("vllm:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens computed.",
                     lambda r: r.stats.draft_tokens),
                    ("vllm:spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens kept.",
                     lambda r: r.stats.accepted_tokens)]
        for kind, metrics in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, doc, value in metrics:
                family = kind(name, doc, labels=["model_name", "engine"])
                for replica in replicas:
                    family.add_metric([self.model, str(replica.replica)], value(replica))
                yield family


def render(collector: EngineCollector, multiprocess_dir: str | None) -> bytes:
    registry = CollectorRegistry()
    if multiprocess_dir:
        multiprocess.MultiProcessCollector(registry, path=multiprocess_dir)
    registry.register(collector)
    return generate_latest(registry)
