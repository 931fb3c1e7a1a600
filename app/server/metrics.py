"""Prometheus metrics under vLLM's names, so existing dashboards work.

Per-request metrics (tokens, latencies) are recorded in each frontend worker and summed across
gunicorn workers by prometheus-client's multiprocess mode (the bootstrap sets
PROMETHEUS_MULTIPROC_DIR). Engine state (running, waiting, KV usage, prefix cache, preemptions)
comes from the engine's heartbeat and is exported as it was last reported.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                   80.0, 160.0)
# a request's phases, as vLLM buckets them
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5))  # 1, 2, 5, 10, ... 5,000,000 (vLLM's series)


@dataclass(frozen=True)
class Finished:
    """One finished sequence (a choice of a prompt), as the metrics take it."""

    reason: str
    engine: int  # the replica that ran it
    seconds: float  # from the HTTP request's arrival
    prompt_tokens: int  # counted with its prompt's first choice only (0 for the others)
    output_tokens: int
    generates: bool  # its tokens are shown (not an embedding's one token): it counts in request_generation_tokens
    first_token_at: float | None = None  # time.monotonic() of its first and last shown tokens
    last_token_at: float | None = None
    timings: tuple[float, float] | None = None  # the engine's: seconds queued, then to its first token


class Metrics:
    def __init__(self, model_name: str):
        self.model = model_name
        labels = ["model_name", "engine"]

        # registry=None: values live in the multiprocess files; render() collects them from there
        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=None)

        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", labels, registry=None)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens processed.", labels,
                                         registry=None)
        self.success = Counter("vllm:request_success", "Finished requests.", labels + ["finished_reason"],
                               registry=None)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between two output tokens.", LATENCY_BUCKETS)
        # vLLM's name for the same until 0.11, which dashboards made for it read
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Time per output token (inter-token latency).",
                              LATENCY_BUCKETS)
        self.request_tpot = histogram("vllm:request_time_per_output_token_seconds",
                                      "A request's mean time per output token after its first.", LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", REQUEST_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Time a request waited to be scheduled.",
                               REQUEST_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds", "Time from scheduled to the first token.",
                                 REQUEST_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds", "Time from the first token to the last.",
                                REQUEST_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds", "Time from scheduled to the last token.",
                                   REQUEST_BUCKETS)
        self.request_prompt = histogram("vllm:request_prompt_tokens", "A request's prompt tokens.", TOKEN_BUCKETS)
        self.request_generation = histogram("vllm:request_generation_tokens", "A request's generated tokens.",
                                            TOKEN_BUCKETS)
        self.params_n = histogram("vllm:request_params_n", "The n request parameter.", (1, 2, 5, 10, 20))
        self.params_max_tokens = histogram("vllm:request_params_max_tokens", "The max_tokens request parameter.",
                                           TOKEN_BUCKETS)
        self._per_token: dict[int, tuple] = {}  # replica -> its labelled TTFT, ITL and TPOT histograms

    def first_token(self, engine: int, seconds: float) -> None:
        self._token_histograms(engine)[0].observe(seconds)

    def next_token(self, engine: int, seconds: float) -> None:
        _, itl, tpot = self._token_histograms(engine)
        itl.observe(seconds)
        tpot.observe(seconds)

    def _token_histograms(self, engine: int) -> tuple:
        """A replica's per-token histograms, labelled once (every token of every stream observes them)."""
        found = self._per_token.get(engine)
        if found is None:
            labels = (self.model, str(engine))
            found = self._per_token[engine] = tuple(h.labels(*labels) for h in (self.ttft, self.itl, self.tpot))
        return found

    def request(self, engine: int, n: int, max_tokens: int | None) -> None:
        """A request's parameters (vLLM's request_params_*), once per HTTP request."""
        self.params_n.labels(self.model, str(engine)).observe(n)
        if max_tokens is not None:
            self.params_max_tokens.labels(self.model, str(engine)).observe(max_tokens)

    def finished(self, done: Finished) -> None:
        model, engine = self.model, str(done.engine)
        self.success.labels(model, engine, done.reason).inc()
        self.e2e.labels(model, engine).observe(done.seconds)
        self.prompt_tokens.labels(model, engine).inc(done.prompt_tokens)
        self.generation_tokens.labels(model, engine).inc(done.output_tokens)
        if done.prompt_tokens:
            self.request_prompt.labels(model, engine).observe(done.prompt_tokens)
        if done.generates:
            self.request_generation.labels(model, engine).observe(done.output_tokens)
        first, last = done.first_token_at, done.last_token_at
        if first is not None and last is not None:
            if done.output_tokens > 1:
                self.request_tpot.labels(model, engine).observe((last - first) / (done.output_tokens - 1))
            self.decode.labels(model, engine).observe(last - first)
        if done.timings is not None:
            queued, to_first = done.timings
            self.queue.labels(model, engine).observe(queued)
            self.prefill.labels(model, engine).observe(to_first)
            if first is not None and last is not None:
                self.inference.labels(model, engine).observe(to_first + last - first)


class EngineCollector:
    """The engine's own numbers, from the latest heartbeat this worker received."""

    def __init__(self, model_name: str, engine):
        self.model, self.engine = model_name, engine

    def collect(self):
        """One sample per replica, labelled `engine` (its index) as vLLM labels its engines."""
        replicas = self.engine.replicas

        def now(field: str):  # a replica that stopped answering holds nothing now (its last beat's figures were)
            return lambda r: getattr(r.stats, field) if r.state() in ("ready", "draining") else 0

        gauges = [("vllm:num_requests_running", "Requests running in the engine.", now("running")),
                  ("vllm:num_requests_waiting", "Requests waiting for a slot.", now("waiting")),
                  ("vllm:kv_cache_usage_perc", "KV-cache usage (1 = all blocks in use).", now("kv_usage")),
                  ("appliance:kv_cache_blocks_in_use", "KV blocks held by requests.", now("kv_blocks_used")),
                  ("appliance:engine_ready", "1 when the engine is ready and alive.", lambda r: int(r.ready()))]
        counters = [("vllm:prefix_cache_queries", "Prefix-cache queries, in tokens.", lambda r: r.stats.prefix_queries),
                    ("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.", lambda r: r.stats.prefix_hits),
                    ("vllm:prompt_tokens_cached", "Prompt tokens read from the prefix cache.",
                     lambda r: r.stats.prefix_hits),
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
