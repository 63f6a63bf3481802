"""Per-engine load metrics: labelled by engine, totals turned into counters, engines forgotten."""

from __future__ import annotations

from frontend_svc.engine_types import LoadFigures
from frontend_svc.metrics import Metrics


def _sample(metrics: Metrics, name: str, engine: str) -> float | None:
    for line in metrics.exposition().decode().splitlines():
        if line.startswith(name + "{") and f'engine="{engine}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def test_load_is_labelled_per_engine_and_dropped_when_the_engine_leaves() -> None:
    m = Metrics("m")
    m.observe_load("a:1", LoadFigures(num_running=3, prefix_cache_queries=10, prefix_cache_hits=4))
    m.observe_load("b:2", LoadFigures(num_running=1, prefix_cache_queries=5, prefix_cache_hits=5))
    m.observe_load("a:1", LoadFigures(num_running=2, prefix_cache_queries=30, prefix_cache_hits=9))
    assert _sample(m, "tandem:num_requests_running", "a:1") == 2
    assert _sample(m, "tandem:num_requests_running", "b:2") == 1
    assert _sample(m, "tandem:prefix_cache_hits_total", "a:1") == 9  # totals become increments
    assert _sample(m, "tandem:prefix_cache_hits_total", "b:2") == 5
    m.observe_load("a:1", LoadFigures(prefix_cache_hits=2))  # a restarted engine counts anew
    assert _sample(m, "tandem:prefix_cache_hits_total", "a:1") == 11
    m.forget_engine("a:1")
    assert _sample(m, "tandem:num_requests_running", "a:1") is None
    assert _sample(m, "tandem:num_requests_running", "b:2") == 1
    m.forget_engine("never-seen:3")  # no error
