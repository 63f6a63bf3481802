"""Prometheus metrics of the gateway, in a registry of its own (served at /metrics).

Engine load figures arrive with every engine message and are labelled with the engine's address
(one gateway may front several engines); the cumulative ones (prefix cache, preemptions) are
turned into counter increments, starting over when an engine restarts.

With ``--workers N`` every worker process writes its figures to files in a directory the workers
share (prometheus_client's multiprocess mode), and whichever worker answers /metrics reports them
all: request counters and histograms summed over the workers (a worker that died still counts),
engine load gauges as the most recent figure any worker saw. The engine's cumulative figures are
the same for every worker (each reads them on its own stream), so there each worker keeps its
running total in a gauge and /metrics reports the largest, as a counter, not N times the truth.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from frontend_svc.config import shared_metrics_dir
from frontend_svc.engine_types import LoadFigures

CONTENT_TYPE = CONTENT_TYPE_LATEST
# The engine's cumulative figures (see Metrics.observe_load), by name, with their help text.
ENGINE_TOTALS = {
    "tandem:prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "tandem:prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "tandem:num_preemptions": "Engine preemptions.",
}
_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)


class Metrics:
    """All gateway metrics, labelled with the served model name."""

    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._token_children: tuple[str, Counter, Histogram, Histogram] | None = None
        self._shared_dir = shared_metrics_dir()  # None: this process serves alone
        r, label = self.registry, ["model_name"]
        per_engine = [*label, "engine"]
        self.running = Gauge(
            "tandem:num_requests_running",
            "Requests running on the engine.",
            per_engine,
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.waiting = Gauge(
            "tandem:num_requests_waiting",
            "Requests waiting on the engine.",
            per_engine,
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.kv_usage = Gauge(
            "tandem:kv_cache_usage_perc",
            "KV cache usage (1 = full).",
            per_engine,
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.prefix_queries = self._engine_total("tandem:prefix_cache_queries")
        self.prefix_hits = self._engine_total("tandem:prefix_cache_hits")
        self.preemptions = self._engine_total("tandem:num_preemptions")
        self.routed = Counter(
            "tandem:engine_requests",
            "Sequences sent to each engine; affinity=true when sent for its cached prompt prefix.",
            [*per_engine, "affinity"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "tandem:prompt_tokens", "Prompt tokens sent to the engine.", label, registry=r
        )
        self.generation_tokens = Counter(
            "tandem:generation_tokens", "Tokens generated.", label, registry=r
        )
        self.request_success = Counter(
            "tandem:request_success",
            "Finished sequences by finish reason.",
            [*label, "finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "tandem:time_to_first_token_seconds",
            "Time to first token.",
            label,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "tandem:inter_token_latency_seconds",
            "Time between successive engine outputs of a sequence.",
            label,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tandem:e2e_request_latency_seconds",
            "End-to-end sequence latency.",
            label,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._last: dict[str, LoadFigures] = {}

    def _engine_total(self, name: str) -> Counter | Gauge:
        labels, r = ["model_name", "engine"], self.registry
        if self._shared_dir is None:
            return Counter(name, ENGINE_TOTALS[name], labels, registry=r)
        # Each worker's running total of the same engine figures; /metrics reports the largest.
        return Gauge(name, ENGINE_TOTALS[name], labels, registry=r, multiprocess_mode="max")

    def observe_load(self, engine: str, load: LoadFigures) -> None:
        m = self.model_name
        self.running.labels(m, engine).set(load.num_running)
        self.waiting.labels(m, engine).set(load.num_waiting)
        self.kv_usage.labels(m, engine).set(load.kv_cache_usage)
        last = self._last.get(engine, LoadFigures())
        for counter, new, old in (
            (self.prefix_queries, load.prefix_cache_queries, last.prefix_cache_queries),
            (self.prefix_hits, load.prefix_cache_hits, last.prefix_cache_hits),
            (self.preemptions, load.num_preemptions, last.num_preemptions),
        ):
            delta = new - old if new >= old else new  # a smaller total: the engine restarted
            if delta:
                counter.labels(m, engine).inc(delta)
        self._last[engine] = load

    def forget_engine(self, engine: str) -> None:
        """An engine left for good: drop its load gauges (its counters stay, as totals do)."""
        for gauge in (self.running, self.waiting, self.kv_usage):
            if self._shared_dir is not None:
                # Nothing is ever removed from the workers' files: a NaN, newer than any
                # worker's last figure for the engine, tells /metrics to leave the engine out.
                gauge.labels(self.model_name, engine).set(math.nan)
                continue
            try:
                gauge.remove(self.model_name, engine)
            except KeyError:
                pass
        self._last.pop(engine, None)

    def observe_routed(self, engine: str, affinity_tokens: int) -> None:
        self.routed.labels(self.model_name, engine, str(affinity_tokens > 0).lower()).inc()

    def observe_prompt(self, num_tokens: int) -> None:
        self.prompt_tokens.labels(self.model_name).inc(num_tokens)

    def observe_tokens(self, num_tokens: int, since_last_s: float | None, first: bool) -> None:
        """New tokens of one sequence; ``since_last_s`` is the TTFT (first) or the ITL.

        Called for every delta of every stream: the labelled children are looked up once per
        model name, not per call (``labels()`` takes a lock and checks its arguments)."""
        children = self._token_children
        if children is None or children[0] != self.model_name:
            m = self.model_name
            ttft, itl = self.ttft.labels(m), self.itl.labels(m)
            children = (m, self.generation_tokens.labels(m), ttft, itl)
            self._token_children = children
        if num_tokens:
            children[1].inc(num_tokens)
        if since_last_s is not None:
            (children[2] if first else children[3]).observe(since_last_s)

    def observe_finished(self, finish_reason: str, e2e_s: float) -> None:
        self.request_success.labels(self.model_name, finish_reason).inc()
        self.e2e.labels(self.model_name).observe(e2e_s)

    def exposition(self) -> bytes:
        """The text format of every figure: this process's, or with workers all of theirs."""
        if self._shared_dir is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        registry.register(_AllWorkers(self._shared_dir))
        return generate_latest(registry)


class _AllWorkers(Collector):
    """The figures of every worker, merged from the files in ``path`` (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def collect(self) -> Iterable[Metric]:
        for metric in MultiProcessCollector(None, self.path).collect():
            if metric.name in ENGINE_TOTALS:  # the largest of the workers' gauges
                total = CounterMetricFamily(metric.name, metric.documentation)
                for sample in metric.samples:
                    total.add_sample(metric.name + "_total", sample.labels, sample.value)
                yield total
                continue
            if metric.type == "gauge":  # NaN: an engine that left (forget_engine)
                metric.samples = [s for s in metric.samples if not math.isnan(s.value)]
            yield metric
