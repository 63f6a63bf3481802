"""Prometheus metrics of the gateway, in a registry of its own (served at /metrics).

Names, types, labels, buckets and help texts are vLLM's (``vllm:...``, v1 engine), so vLLM's
Grafana dashboard, KEDA triggers and alerts work unchanged. Every series has vLLM's
``model_name`` label; the figures of one engine also have ``engine`` (its address here, where
vLLM has an engine index). Where the figures come from:

* engine load (``num_requests_running`` / ``waiting``, KV usage) arrives with every engine
  message (``num_requests_waiting_by_reason``: the waiting ones split into ``capacity`` and
  ``deferred``, those the engine steps over for now: a grammar compiling, no LoRA slot); its
  cumulative figures (prefix cache, preemptions) are turned into counter increments,
  starting over when an engine restarts;
* token counts (``prompt_tokens``, ``generation_tokens``, ``iteration_tokens_total``) are
  counted as vLLM's front end counts its engine's outputs: a request's prompt once, with its
  first token, and the tokens generated; the iteration histogram per engine step (a message
  that merges steps lists each one's count); several gateways (or ``--workers``) each count
  their own requests' share of a step, as vLLM's API servers do;
* per-sequence latencies (TTFT, inter-token, end to end) are timed by the gateway; the queue,
  prefill and decode times are the engine's own (RequestOutput.queued_time_s ...), except the
  decode time of a sequence the gateway ended itself (a stop string), timed here;
* ``request_success`` counts each sequence once, by its finish reason; one the gateway aborted
  because its client left is an ``abort``, as in vLLM (the engine's later report of that abort
  goes to no one);
* ``cache_config_info`` (an info gauge, always 1) carries each engine's cache facts as labels.
* ``lora_requests_info`` (an engine serving LoRA adapters) names the adapters its running and
  waiting requests use, from its load figures; its value is when it was last set.

The gauges of an engine that left (or of a model it no longer serves) are removed.
``tandem:engine_requests_total`` (requests sent to each engine, for cache affinity or not) has
no vLLM equivalent and keeps its own prefix.

With ``--workers N`` every worker process writes its figures to files in a directory the workers
share (prometheus_client's multiprocess mode), and whichever worker answers /metrics reports them
all: counters and histograms summed over the workers (a worker that died still counts), gauges as
the most recent figure any worker saw. The engine's cumulative figures are the same for every
worker (each reads them on its own stream), so there each worker keeps its running total in a
gauge and /metrics reports the largest, as a counter, not N times the truth.
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from frontend_svc.config import shared_metrics_dir
from frontend_svc.engine.events import EngineEvents
from protos.types import EngineOutput, FinishReason, LoadFigures, ModelInfo

CONTENT_TYPE = CONTENT_TYPE_LATEST
# The engine's cumulative figures (see Metrics.observe_load), by name, with their help text.
ENGINE_TOTALS = {
    "vllm:prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "vllm:prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "vllm:num_preemptions": "Cumulative number of preemption from the engine.",
    # Speculative decoding (series appear with an engine's first verification step).
    "vllm:spec_decode_num_drafts": "Number of spec decoding drafts.",
    "vllm:spec_decode_num_draft_tokens": "Number of draft tokens.",
    "vllm:spec_decode_num_accepted_tokens": "Number of accepted tokens.",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "Accepted tokens per draft position.",
}
SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"

# Families vLLM also serves under an older name, with the same observations: name -> (old name,
# its help text). Added at exposition (_WithAliases), not observed twice.
ALIASES = {
    "vllm:inter_token_latency_seconds": (
        "vllm:time_per_output_token_seconds",
        "Histogram of time per output token in seconds. "
        "DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
    ),
}
# vLLM's buckets.
REQUEST_N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's
TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
ITL_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
REQUEST_LATENCY_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
    *(120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# vllm:cache_config_info's labels besides model_name and engine (vLLM's CacheConfig names).
CACHE_INFO_LABELS = ("block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype")
LORA_INFO_LABELS = ("max_lora", "waiting_lora_adapters", "running_lora_adapters")
WAITING_REASONS = ("capacity", "deferred")  # vllm:num_requests_waiting_by_reason's


def observe_many(histogram: Histogram, amount: float, times: int) -> None:
    """``times`` observations of ``amount`` at the cost of one: the additions ``observe`` makes,
    ``times`` over (prometheus_client has no weighted observe; 16 observes cost ~8 us, this
    ~0.5). Its stores (``_sum``, ``_buckets``, ``_upper_bounds``) are not public API: without
    them, ``observe`` ``times`` times."""
    bounds = getattr(histogram, "_upper_bounds", None)
    total = getattr(histogram, "_sum", None)
    buckets = getattr(histogram, "_buckets", None)
    if bounds is None or total is None or buckets is None:
        for _ in range(times):
            histogram.observe(amount)
        return
    total.inc(amount * times)
    buckets[bisect.bisect_left(bounds, amount)].inc(times)  # observe's: first bound >= amount


def length_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50 ... up to ``max_value`` (vLLM's buckets of token counts)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class Metrics:
    """All gateway metrics, labelled with the served model name. ``clock`` times sequences."""

    def __init__(self, model_name: str = "", clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.clock = clock
        self._shared_dir = shared_metrics_dir()  # None: this process serves alone
        r, model = self.registry, ["model_name"]
        per_engine = [*model, "engine"]

        def gauge(name: str, doc: str, labels: list[str] = per_engine) -> Gauge:
            return Gauge(name, doc, labels, registry=r, multiprocess_mode="mostrecent")

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(name, doc, model, buckets=tuple(buckets), registry=r)

        self.running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.waiting_by_reason = gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of requests waiting to be processed, by reason: capacity (not yet "
            "scheduled for want of room) or deferred (held back by a transient constraint).",
            [*per_engine, "reason"],
        )
        self.kv_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.gpu_cache_usage = gauge(
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage. "
            "DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
        )
        self.cache_info = gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [*per_engine, *CACHE_INFO_LABELS],
        )
        # With LoRA adapters (the engine's max_loras > 0), as vLLM: one series whose labels
        # name the adapters in use, its value the time it was last set. Only an engine's
        # current label set is kept (vLLM leaves the old ones, a series per combination ever
        # seen); it is set again when it changes and at most once a second otherwise.
        self.lora_info = gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            [*per_engine, *LORA_INFO_LABELS],
        )
        self.prefix_queries = self._engine_total("vllm:prefix_cache_queries")
        self.prefix_hits = self._engine_total("vllm:prefix_cache_hits")
        self.preemptions = self._engine_total("vllm:num_preemptions")
        self.spec_drafts = self._engine_total("vllm:spec_decode_num_drafts")
        self.spec_draft_tokens = self._engine_total("vllm:spec_decode_num_draft_tokens")
        self.spec_accepted = self._engine_total("vllm:spec_decode_num_accepted_tokens")
        self.spec_per_pos = self._engine_total(SPEC_PER_POS, "position")
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", per_engine, registry=r
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            per_engine,
            registry=r,
        )
        self.iteration_tokens = Histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            per_engine,
            buckets=ITERATION_TOKENS_BUCKETS,
            registry=r,
        )
        self.request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*model, "finished_reason"],
            registry=r,
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        # Token counts per request: their buckets go up to max_model_len, so they are made when
        # the first engine's model info arrives (no sequence finishes before that).
        self.request_prompt_tokens: Histogram | None = None
        self.request_generation_tokens: Histogram | None = None
        self.request_max_tokens: Histogram | None = None
        self.request_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", REQUEST_N_BUCKETS
        )
        self._request_histograms = [
            self.request_n,
            self.ttft,
            self.itl,
            self.e2e,
            self.queue_time,
            self.inference_time,
            self.prefill_time,
            self.decode_time,
        ]
        self.routed = Counter(
            "tandem:engine_requests",
            "Sequences sent to each engine; affinity=true when sent for its cached prompt prefix.",
            [*per_engine, "affinity"],
            registry=r,
        )
        self._last: dict[str, LoadFigures] = {}
        # Per engine: the model name its gauges carry, and its cache_config_info labels.
        self._gauge_model: dict[str, str] = {}
        self._cache_info: dict[str, tuple[str, ...]] = {}
        # Per engine serving LoRA adapters: its max_loras, and its lora_requests_info labels
        # with when they were last set.
        self._max_loras: dict[str, int] = {}
        self._lora_info: dict[str, tuple[tuple[str, ...], float]] = {}
        self._children: _SequenceChildren | None = None
        # Labelled children by (metric, label values): ``labels()`` takes a lock and checks its
        # arguments (~1.5 us); the gateway asks for the same few children on every engine
        # message and every finished request. A child removed by _drop leaves the cache too.
        self._child_cache: dict[tuple[int, tuple[str, ...]], Any] = {}

    def _engine_total(self, name: str, *extra: str) -> Counter | Gauge:
        labels, r = ["model_name", "engine", *extra], self.registry
        if self._shared_dir is None:
            return Counter(name, ENGINE_TOTALS[name], labels, registry=r)
        # Each worker's running total of the same engine figures; /metrics reports the largest.
        return Gauge(name, ENGINE_TOTALS[name], labels, registry=r, multiprocess_mode="max")

    # -- engines ----------------------------------------------------------------------------

    def observe_engine_info(self, engine: str, info: ModelInfo) -> None:
        """An engine (re)connected: its cache facts, and every series it will have, at zero
        until observed (as vLLM makes them when it starts)."""
        m = self._claim_gauges(engine)
        labels = (
            m,
            engine,
            str(info.block_size),
            str(info.num_kv_blocks),
            str(info.enable_prefix_caching),
            info.kv_cache_dtype,
        )
        old = self._cache_info.get(engine)
        if old is not None and old != labels:
            self._drop(self.cache_info, old)
        self.cache_info.labels(*labels).set(1)
        self._cache_info[engine] = labels
        # A (re)connected engine's adapter figures start empty (its earlier ones, perhaps of
        # another model or slot count, go): its load messages fill them in.
        self._forget_lora_info(engine)
        if info.max_loras:
            self._max_loras[engine] = info.max_loras
            self._observe_lora_info(engine, m, info.max_loras, LoadFigures())
        else:
            self._max_loras.pop(engine, None)
        if self.request_prompt_tokens is None:
            self.request_prompt_tokens, self.request_generation_tokens = (
                Histogram(
                    name,
                    doc,
                    ["model_name"],
                    buckets=length_buckets(info.max_model_len),
                    registry=self.registry,
                )
                for name, doc in (
                    ("vllm:request_prompt_tokens", "Number of prefill tokens processed."),
                    ("vllm:request_generation_tokens", "Number of generation tokens processed."),
                )
            )
            self.request_max_tokens = Histogram(
                "vllm:request_params_max_tokens",
                "Histogram of the max_tokens request parameter.",
                ["model_name"],
                buckets=length_buckets(info.max_model_len),
                registry=self.registry,
            )
            self._request_histograms += [
                self.request_prompt_tokens,
                self.request_generation_tokens,
                self.request_max_tokens,
            ]
        for metric in (
            self.prefix_queries,
            self.prefix_hits,
            self.preemptions,
            self.prompt_tokens,
            self.generation_tokens,
            self.iteration_tokens,
        ):
            metric.labels(m, engine)
        for histogram in self._request_histograms:
            histogram.labels(m)
        for reason in FinishReason:
            self.request_success.labels(m, reason.value)
        if engine not in self._last:  # no load yet: the engine's gauges start at zero (vLLM)
            for gauge in self._load_gauges:
                self.child(gauge, m, engine).set(0)
            for why in WAITING_REASONS:
                self.child(self.waiting_by_reason, m, engine, why).set(0)

    def observe_load(self, engine: str, load: LoadFigures) -> None:
        """Every engine message. A gauge is written only when its figure changed (most steps
        change none: with one stream, 4 writes per token), or when this engine's gauges are
        new (first load, or after the served model changed)."""
        fresh = self._gauge_model.get(engine) != self.model_name or engine not in self._last
        m = self._claim_gauges(engine)
        child = self.child
        last = self._last.get(engine, LoadFigures())
        if fresh or load.num_running != last.num_running:
            child(self.running, m, engine).set(load.num_running)
        if fresh or load.num_waiting != last.num_waiting:
            child(self.waiting, m, engine).set(load.num_waiting)
        if fresh or (load.num_waiting, load.num_waiting_deferred) != (
            last.num_waiting,
            last.num_waiting_deferred,
        ):
            deferred = min(load.num_waiting, load.num_waiting_deferred)
            child(self.waiting_by_reason, m, engine, "capacity").set(load.num_waiting - deferred)
            child(self.waiting_by_reason, m, engine, "deferred").set(deferred)
        if fresh or load.kv_cache_usage != last.kv_cache_usage:
            child(self.kv_usage, m, engine).set(load.kv_cache_usage)
            child(self.gpu_cache_usage, m, engine).set(load.kv_cache_usage)
        for counter, new, old in (
            (self.prefix_queries, load.prefix_cache_queries, last.prefix_cache_queries),
            (self.prefix_hits, load.prefix_cache_hits, last.prefix_cache_hits),
            (self.preemptions, load.num_preemptions, last.num_preemptions),
            (self.spec_drafts, load.spec_num_drafts, last.spec_num_drafts),
            (self.spec_draft_tokens, load.spec_num_draft_tokens, last.spec_num_draft_tokens),
            (self.spec_accepted, load.spec_num_accepted_tokens, last.spec_num_accepted_tokens),
        ):
            delta = new - old if new >= old else new  # a smaller total: the engine restarted
            if delta:
                child(counter, m, engine).inc(delta)
        if load.spec_accepted_per_pos != last.spec_accepted_per_pos:
            restarted = load.spec_num_drafts < last.spec_num_drafts
            before = () if restarted else last.spec_accepted_per_pos
            for pos, total in enumerate(load.spec_accepted_per_pos):
                delta = total - (before[pos] if pos < len(before) else 0)
                if delta > 0:
                    child(self.spec_per_pos, m, engine, str(pos)).inc(delta)
        self._last[engine] = load
        max_loras = self._max_loras.get(engine)
        if max_loras is not None:
            self._observe_lora_info(engine, m, max_loras, load)

    def _observe_lora_info(self, engine: str, m: str, max_loras: int, load: LoadFigures) -> None:
        labels = (
            m,
            engine,
            str(max_loras),
            ",".join(load.waiting_lora_adapters),
            ",".join(load.running_lora_adapters),
        )
        now = time.time()
        old = self._lora_info.get(engine)
        if old is not None and old[0] == labels and now - old[1] < 1.0:
            return
        if old is not None and old[0] != labels:
            self._drop(self.lora_info, old[0])
        self.child(self.lora_info, *labels).set(now)
        self._lora_info[engine] = (labels, now)

    def _forget_lora_info(self, engine: str) -> None:
        old = self._lora_info.pop(engine, None)
        if old is not None:
            self._drop(self.lora_info, old[0])

    def observe_step(
        self,
        engine: str,
        prompt_tokens: int,
        generation_tokens: int,
        step_tokens: Sequence[int] = (),
    ) -> None:
        """One engine message: the prompts it completed and the tokens it generated; when it
        merges several engine steps, ``step_tokens``: the engine's count of each one's tokens."""
        m = self.model_name
        if prompt_tokens:
            self.child(self.prompt_tokens, m, engine).inc(prompt_tokens)
        self.child(self.generation_tokens, m, engine).inc(generation_tokens)
        iteration = self.child(self.iteration_tokens, m, engine)
        # The engine's per-step counts take in requests this gateway no longer listens to (left
        # early; their last outputs still come): then one observation of what it did count, so
        # the histogram's sum stays the token totals.
        if step_tokens and sum(step_tokens) == prompt_tokens + generation_tokens:
            # A message merges steps of about the same size (16 steps of 1 token each at one
            # stream): one observation per run of equal counts, not per step.
            for n, run in itertools.groupby(step_tokens):
                observe_many(iteration, n, sum(1 for _ in run))
        else:
            iteration.observe(prompt_tokens + generation_tokens)

    def forget_engine(self, engine: str) -> None:
        """An engine left for good: drop its gauges (its counters stay, as totals do)."""
        # (With workers, one that has seen no load from the engine still hides the others'.)
        model = self._gauge_model.pop(engine, self.model_name)
        for gauge in self._load_gauges:
            self._drop(gauge, (model, engine))
        for reason in WAITING_REASONS:
            self._drop(self.waiting_by_reason, (model, engine, reason))
        info = self._cache_info.pop(engine, None)
        if info is not None:
            self._drop(self.cache_info, info)
        self._max_loras.pop(engine, None)
        self._forget_lora_info(engine)
        self._last.pop(engine, None)

    @property
    def _load_gauges(self) -> tuple[Gauge, ...]:
        return (self.running, self.waiting, self.kv_usage, self.gpu_cache_usage)

    def _claim_gauges(self, engine: str) -> str:
        """The model name for ``engine``'s gauges; the ones of a model it no longer serves go."""
        m, old = self.model_name, self._gauge_model.get(engine)
        if old != m:
            if old is not None:
                for gauge in self._load_gauges:
                    self._drop(gauge, (old, engine))
                for reason in WAITING_REASONS:
                    self._drop(self.waiting_by_reason, (old, engine, reason))
            self._gauge_model[engine] = m
        return m

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, looked up once."""
        key = (id(metric), labels)
        found = self._child_cache.get(key)
        if found is None:
            found = self._child_cache[key] = metric.labels(*labels)
        return found

    def _drop(self, gauge: Gauge, labels: tuple[str, ...]) -> None:
        self._child_cache.pop((id(gauge), labels), None)
        if self._shared_dir is not None:
            # Nothing is ever removed from the workers' files: a NaN, newer than any worker's
            # last figure for these labels, tells /metrics to leave them out.
            gauge.labels(*labels).set(math.nan)
            return
        try:
            gauge.remove(*labels)
        except KeyError:
            pass

    # -- requests ---------------------------------------------------------------------------

    def observe_routed(self, engine: str, affinity_tokens: int) -> None:
        affinity = "true" if affinity_tokens > 0 else "false"
        self.child(self.routed, self.model_name, engine, affinity).inc()

    def sequence(
        self, num_prompt_tokens: int, n: int = 1, max_tokens: int | None = None
    ) -> SequenceTimer:
        """A timer for one sequence just sent to the engine; feed it every output. ``n`` and
        ``max_tokens``: its request's parameters (vLLM's request_params histograms, one
        observation per sequence as vLLM's engine counts its child requests)."""
        children = self._children
        if children is None or children.model_name != self.model_name:
            children = self._children = _SequenceChildren(self)
        return SequenceTimer(self, children, num_prompt_tokens, n, max_tokens)

    def exposition(self) -> bytes:
        """The text format of every figure: this process's, or with workers all of theirs."""
        source: Collector = self.registry
        if self._shared_dir is not None:
            source = _AllWorkers(self._shared_dir)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_WithAliases(source))
        return generate_latest(registry)


class MetricsEvents(EngineEvents):
    """The engine events /metrics shows, handed to ``metrics``."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def accepted(self, address: str, info: ModelInfo) -> None:
        self.metrics.observe_engine_info(address, info)

    def left(self, address: str) -> None:
        self.metrics.forget_engine(address)

    def load(self, address: str, load: LoadFigures) -> None:
        self.metrics.observe_load(address, load)

    def step(
        self,
        address: str,
        prompt_tokens: int,
        generation_tokens: int,
        step_tokens: Sequence[int],
    ) -> None:
        self.metrics.observe_step(address, prompt_tokens, generation_tokens, step_tokens)

    def routed(self, address: str, affinity_tokens: int) -> None:
        self.metrics.observe_routed(address, affinity_tokens)


class _SequenceChildren:
    """The labelled children a sequence observes on every output, held as attributes (the
    per-token path skips even :meth:`Metrics.child`'s dict lookup), renewed per model name."""

    def __init__(self, metrics: Metrics) -> None:
        m = self.model_name = metrics.model_name
        self.ttft = metrics.child(metrics.ttft, m)
        self.itl = metrics.child(metrics.itl, m)


class SequenceTimer:
    """One sequence's latencies, from its outputs as they reach the gateway (vLLM's request
    stats): TTFT and inter-token times as they come, the rest once it finishes."""

    __slots__ = (
        "_metrics",
        "_children",
        "_num_prompt_tokens",
        "_num_generated",
        "_start",
        "_first_token",
        "_last_token",
        "_queued",
        "_prefill",
        "_ended",
        "_n",
        "_max_tokens",
    )

    def __init__(
        self,
        metrics: Metrics,
        children: _SequenceChildren,
        num_prompt_tokens: int,
        n: int = 1,
        max_tokens: int | None = None,
    ) -> None:
        self._metrics = metrics
        self._children = children
        self._num_prompt_tokens = num_prompt_tokens
        self._n, self._max_tokens = n, max_tokens
        self._num_generated = 0
        self._start = metrics.clock()
        self._first_token: float | None = None
        self._last_token = self._start
        self._queued: float | None = None  # the engine's phase times, with the first token
        self._prefill = 0.0
        self._ended = False  # counted as finished (or aborted): never twice

    def observe(self, out: EngineOutput, finish_reason: str | None) -> None:
        """One engine output (several merged, when the reader fell behind); ``finish_reason``:
        the sequence's, when this output ends it (the engine's, or "stop" for a stop string)."""
        now = self._metrics.clock()
        if out.queued_time_s is not None:
            self._queued, self._prefill = out.queued_time_s, out.prefill_time_s or 0.0
        if out.new_token_ids:
            c = self._children
            if self._first_token is None:
                self._first_token = now
                c.ttft.observe(now - self._start)
            else:
                c.itl.observe(now - self._last_token)
            self._last_token = now
            self._num_generated += len(out.new_token_ids)
        if finish_reason is not None:
            self._finished(finish_reason, now, out.num_prompt_tokens, out.decode_time_s)

    def aborted(self) -> None:
        """The gateway aborted the sequence before it finished (its client went away, or a
        sibling sequence failed): counted as vLLM counts a request it aborts, with
        ``finished_reason="abort"`` and the latencies so far. Nothing once it has finished, so
        a sequence is counted once however it ends."""
        self._finished(FinishReason.ABORT.value, self._metrics.clock(), 0, None)

    def _finished(
        self, reason: str, now: float, num_prompt_tokens: int, decode_time_s: float | None
    ) -> None:
        if self._ended:
            return
        self._ended = True
        metrics, m = self._metrics, self._children.model_name
        child = metrics.child
        child(metrics.request_success, m, reason).inc()
        child(metrics.e2e, m).observe(now - self._start)
        if self._queued is not None:  # the engine reported its phases
            decode = decode_time_s
            if decode is None:  # ended here (a stop string, an abort): the gateway's clock
                decode = now - self._first_token if self._first_token is not None else 0.0
            child(metrics.queue_time, m).observe(self._queued)
            child(metrics.prefill_time, m).observe(self._prefill)
            child(metrics.decode_time, m).observe(decode)
            child(metrics.inference_time, m).observe(self._prefill + decode)
        if metrics.request_prompt_tokens is not None:
            child(metrics.request_prompt_tokens, m).observe(
                num_prompt_tokens or self._num_prompt_tokens
            )
        if metrics.request_generation_tokens is not None:
            child(metrics.request_generation_tokens, m).observe(self._num_generated)
        child(metrics.request_n, m).observe(self._n)
        if metrics.request_max_tokens is not None and self._max_tokens is not None:
            child(metrics.request_max_tokens, m).observe(self._max_tokens)


class _WithAliases(Collector):
    """Every family of ``source``, plus each one in ``ALIASES`` again under its older name: the
    same samples, observed once (an observation costs ~1 us, and the ITL is one per token)."""

    def __init__(self, source: Collector) -> None:
        self.source = source

    def describe(self) -> Iterable[Metric]:
        return ()

    def collect(self) -> Iterable[Metric]:
        for metric in self.source.collect():
            yield metric
            alias = ALIASES.get(metric.name)
            if alias is not None:
                name, documentation = alias
                copy = Metric(name, documentation, metric.type, metric.unit)
                copy.samples = [
                    s._replace(name=name + s.name[len(metric.name) :]) for s in metric.samples
                ]
                yield copy


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
            if metric.type == "gauge":  # NaN: an engine (or model) that left
                metric.samples = [s for s in metric.samples if not math.isnan(s.value)]
            yield metric
