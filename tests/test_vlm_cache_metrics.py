"""Image-cache and collapse-guard metrics (services/metrics.py) folded from the replicas' chat end events."""

from __future__ import annotations

from services import metrics


def _value(metric, **labels) -> float:
    return metric.labels(**labels)._value.get()


def test_cumulative_snapshots_become_counter_increments_per_replica():
    m = "test-model-cache"
    metrics.observe_vlm_end_event(m, {"image_cache": {"replica": "a", "stats": {
        "hits": 0, "misses": 1, "evictions": 0, "entries": 1, "bytes": 147456}}})
    metrics.observe_vlm_end_event(m, {"image_cache": {"replica": "a", "stats": {
        "hits": 3, "misses": 2, "evictions": 1, "entries": 1, "bytes": 147456}}})
    metrics.observe_vlm_end_event(m, {"image_cache": {"replica": "b", "stats": {
        "hits": 1, "misses": 1, "evictions": 0, "entries": 1, "bytes": 1000}}})
    assert _value(metrics.IMAGE_CACHE_HITS, model=m, replica="a") == 3
    assert _value(metrics.IMAGE_CACHE_MISSES, model=m, replica="a") == 2
    assert _value(metrics.IMAGE_CACHE_EVICTIONS, model=m, replica="a") == 1
    assert _value(metrics.IMAGE_CACHE_HITS, model=m, replica="b") == 1
    assert _value(metrics.IMAGE_CACHE_BYTES, model=m, replica="b") == 1000
    # replica a restarted: its counters start again from 0, so the whole new value is new
    metrics.observe_vlm_end_event(m, {"image_cache": {"replica": "a", "stats": {
        "hits": 2, "misses": 0, "evictions": 0, "entries": 0, "bytes": 0}}})
    assert _value(metrics.IMAGE_CACHE_HITS, model=m, replica="a") == 5
    assert _value(metrics.IMAGE_CACHE_MISSES, model=m, replica="a") == 2
    assert _value(metrics.IMAGE_CACHE_ENTRIES, model=m, replica="a") == 0


def test_collapse_reports_are_counted_by_outcome():
    m = "test-model-collapse"
    metrics.observe_vlm_end_event(m, {"collapse": {"collapses": 1, "retries": 1, "cut_short": False}})
    metrics.observe_vlm_end_event(m, {"collapse": {"collapses": 2, "retries": 1, "cut_short": True}})
    metrics.observe_vlm_end_event(m, {"collapse": {"collapses": 0, "retries": 0, "cut_short": False}})
    metrics.observe_vlm_end_event(m, {"type": "end"})
    assert _value(metrics.CHAT_COLLAPSES, model=m, outcome="recovered") == 1
    assert _value(metrics.CHAT_COLLAPSES, model=m, outcome="cut_short") == 1
    assert _value(metrics.CHAT_COLLAPSE_RETRIES, model=m) == 2
