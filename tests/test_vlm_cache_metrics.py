"""Image-cache and collapse-guard metrics (services/api/metrics.py) folded from the replicas' chat end events."""

from __future__ import annotations

from services.api import metrics


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


def test_repeated_image_through_the_api_is_a_cache_hit_in_metrics(profile, model_dir, astronaut):
    """The real VLM deployment (transformers backend) in this process behind the real FastAPI app; the openai SDK
    asks about one photo twice: the second answer is the same and /metrics counts one miss then one hit."""
    import asyncio

    import httpx
    import openai

    from services.api.app import build_app
    from services.deployments.backends import LocalBackend
    from services.deployments.vlm import Deployment
    from services.config.profiles import parse_profile
    from tests.conftest import data_url

    data = profile.model_dump(mode="json")
    data["video"] = data["tts"] = None
    data["vlm"]["engine"]["backend"] = "transformers"
    prof = parse_profile(data)
    dep = Deployment(prof.vlm.model_dump(mode="json"), str(model_dir))
    app = build_app(prof, {"vlm": LocalBackend(dep)})
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(astronaut)}},
                                         {"type": "text", "text": "What is in this picture?"}]}]
    text = None

    replica = f'replica="{dep.replica_label()}"'  # this deployment's series only

    def sample(name: str) -> float:
        line = next((x for x in text.splitlines() if x.startswith(name + "{") and 'model="chimera-vlm"' in x
                     and replica in x), None)
        return float(line.rsplit(" ", 1)[1]) if line else 0.0

    async def go():
        nonlocal text
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0)
            text = (await http.get("/metrics")).text
            before = (sample("chimera_vlm_image_cache_hits_total"), sample("chimera_vlm_image_cache_misses_total"))
            answers = [(await client.chat.completions.create(model="chimera-vlm", messages=msgs, max_tokens=8,
                                                              temperature=0)).choices[0].message.content
                       for _ in range(2)]
            text = (await http.get("/metrics")).text
            after = (sample("chimera_vlm_image_cache_hits_total"), sample("chimera_vlm_image_cache_misses_total"))
            return before, answers, after

    before, answers, after = asyncio.run(go())
    assert answers[0] == answers[1]
    assert (after[0] - before[0], after[1] - before[1]) == (1.0, 1.0)
    assert sample("chimera_vlm_image_cache_bytes") == 64 * 576 * 4  # one 224-px photo: 64 tokens x 576 x fp32
