"""Prometheus metrics, recorded in the ingress process (Ray replicas are other processes).

Per-endpoint request counts and latency; time to first token (TTFT) and inter-token latency (ITL) of chat;
each family adds its block below. Exposed at ``GET /metrics``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

# --- before-scrape hooks: refresh gauges whose truth lives elsewhere (another process, a store) -------------
BEFORE_SCRAPE: dict[str, Callable[[], Awaitable[None]]] = {}


def before_scrape(name: str, hook: Callable[[], Awaitable[None]]) -> None:
    """Register the async ``hook`` to run before each ``GET /metrics`` (a later one of the same ``name``
    replaces it, so rebuilding an app never piles up hooks)."""
    BEFORE_SCRAPE[name] = hook


async def run_before_scrape(timeout_s: float = 2.0) -> None:
    """Run every before-scrape hook, each within ``timeout_s`` seconds; a failing hook is logged (warning) and
    leaves its metrics as they were."""
    for name, hook in list(BEFORE_SCRAPE.items()):
        try:
            await asyncio.wait_for(hook(), timeout_s)
        except Exception as exc:  # noqa: BLE001 - a scrape never fails because one refresh did
            logging.getLogger("chimera").warning("metrics hook %s failed: %s", name, exc)


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

#: The ``status`` label of a request whose client went away before any response was sent (nginx's "client closed
#: request"): nothing was sent, so it is not counted as a 500. A response that had started keeps its status.
CLIENT_CLOSED = 499
REQUESTS = Counter("chimera_requests_total", "HTTP requests by endpoint (route template), method and the status "
                   f"code sent ({CLIENT_CLOSED}: the client went away before any response)",
                   ["endpoint", "method", "status"], registry=REGISTRY)
REQUEST_LATENCY = Histogram("chimera_request_latency_seconds", "HTTP request latency until the response ends (s)",
                            ["endpoint", "method"], buckets=LATENCY_BUCKETS, registry=REGISTRY)

# --- chat (grafted VLM) --------------------------------------------------------------------------------------
TTFT = Histogram("chimera_time_to_first_token_seconds", "Time to first token of a chat completion (s)",
                 ["model"], buckets=LATENCY_BUCKETS, registry=REGISTRY)
ITL = Histogram("chimera_inter_token_latency_seconds", "Time between consecutive streamed tokens (s)",
                ["model"], buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
                registry=REGISTRY)
TOKENS = Counter("chimera_generated_tokens_total", "Completion tokens generated", ["model"], registry=REGISTRY)
ACTIVE_CHAT = Gauge("chimera_chat_streams_active", "Chat completions being generated", ["model"], registry=REGISTRY)

# --- video jobs (owned by the video family) ------------------------------------------------------------------
VIDEO_JOBS = Counter("chimera_video_jobs_created_total", "Video jobs accepted (creations and extensions)",
                     registry=REGISTRY)
VIDEO_QUEUE = Gauge("chimera_video_queue_length", "Video jobs queued or running (refreshed from the job store "
                    "on every scrape and video request)",
                    registry=REGISTRY)
VIDEO_JOB_SECONDS = Histogram("chimera_video_job_duration_seconds",
                              "Video job duration from creation to completion/failure (s)", ["status"],
                              buckets=(1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 3600), registry=REGISTRY)

# --- speech (Orpheus-style TTS) ------------------------------------------------------------------------------
TTS_TIME_TO_FIRST_AUDIO = Histogram("chimera_tts_time_to_first_audio_seconds",
                                    "Time from request (or websocket utterance piece) to its first audio bytes (s)",
                                    ["model", "endpoint"], buckets=LATENCY_BUCKETS, registry=REGISTRY)
TTS_REAL_TIME_FACTOR = Histogram("chimera_tts_real_time_factor",
                                 "Synthesis wall time divided by audio duration (below 1 = faster than real time)",
                                 ["model", "endpoint"],
                                 buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10), registry=REGISTRY)
TTS_AUDIO_SECONDS = Counter("chimera_tts_audio_seconds_total", "Seconds of speech audio generated", ["model"],
                            registry=REGISTRY)
TTS_WS_SESSIONS = Gauge("chimera_tts_websocket_sessions_active", "Open speech websocket sessions", ["model"],
                        registry=REGISTRY)

# --- VLM image-embedding cache and chat collapse guard (counted from the replicas' chat end events) ----------
IMAGE_CACHE_HITS = Counter("chimera_vlm_image_cache_hits_total",
                           "Images whose projected features came from a replica's image-embedding cache",
                           ["model", "replica"], registry=REGISTRY)
IMAGE_CACHE_MISSES = Counter("chimera_vlm_image_cache_misses_total",
                             "Images that went through the vision tower and projector (not in the cache)",
                             ["model", "replica"], registry=REGISTRY)
IMAGE_CACHE_EVICTIONS = Counter("chimera_vlm_image_cache_evictions_total",
                                "Image-cache entries evicted (least recently used) to stay within the byte bound",
                                ["model", "replica"], registry=REGISTRY)
IMAGE_CACHE_BYTES = Gauge("chimera_vlm_image_cache_bytes", "Bytes of image features held in a replica's cache",
                          ["model", "replica"], registry=REGISTRY)
IMAGE_CACHE_ENTRIES = Gauge("chimera_vlm_image_cache_entries", "Images held in a replica's cache",
                            ["model", "replica"], registry=REGISTRY)
CHAT_COLLAPSES = Counter("chimera_chat_collapses_total",
                         "Chat answers in which the collapse guard saw one token repeat min_run+ times, by outcome "
                         "(recovered: the retry finished the answer; cut_short: it ended at the collapse)",
                         ["model", "outcome"], registry=REGISTRY)
CHAT_COLLAPSE_RETRIES = Counter("chimera_chat_collapse_retries_total",
                                "Retries started by the chat collapse guard", ["model"], registry=REGISTRY)

# --- VLM speculative decoding (each replica's vLLM server's counters, carried by its chat end events) ---------
SPEC_DRAFTS = Counter("chimera_vlm_spec_decode_drafts_total",
                      "Drafts proposed by speculative decoding in a replica's vLLM server (vllm:spec_decode_num_drafts)",
                      ["model", "replica"], registry=REGISTRY)
SPEC_DRAFT_TOKENS = Counter("chimera_vlm_spec_decode_draft_tokens_total",
                            "Draft tokens proposed (vllm:spec_decode_num_draft_tokens)", ["model", "replica"],
                            registry=REGISTRY)
SPEC_ACCEPTED = Counter("chimera_vlm_spec_decode_accepted_tokens_total",
                        "Draft tokens accepted by the verifier (vllm:spec_decode_num_accepted_tokens)",
                        ["model", "replica"], registry=REGISTRY)
SPEC_ACCEPTED_PER_POS = Counter("chimera_vlm_spec_decode_accepted_tokens_per_pos_total",
                                "Draft tokens accepted at each draft position (0 = first; "
                                "vllm:spec_decode_num_accepted_tokens_per_pos)", ["model", "replica", "position"],
                                registry=REGISTRY)
SPEC_MEAN_ACCEPTANCE = Gauge("chimera_vlm_spec_decode_mean_acceptance_length",
                             "Tokens per verifier step, 1 + accepted / drafts, since the replica's vLLM server started "
                             "(as of its last answer; absent before its first draft)", ["model", "replica"],
                             registry=REGISTRY)

# --- VLM traffic capture (grafting.traffic; opt-in per profile; counted from the replicas' chat end events) ---
TRAFFIC_PROMPTS = Counter("chimera_vlm_traffic_capture_prompts_total",
                          "Served conversations offered to a replica's traffic dataset, by outcome (written; dropped: "
                          "the file is at its max_mb cap)", ["model", "replica", "outcome"], registry=REGISTRY)
TRAFFIC_FULL = Gauge("chimera_vlm_traffic_capture_full",
                     "1 when a replica's traffic dataset has reached its cap and nothing more is written",
                     ["model", "replica"], registry=REGISTRY)

_SEEN: dict[tuple[str, str, str], float] = {}  # (family block, model, replica) -> last cumulative value


def _grow(counter, labels: tuple[str, ...], key: tuple[str, str, str], now: float) -> None:
    """Grow ``counter.labels(*labels)`` (made at 0 when new) to a replica's cumulative value ``now``: by the
    difference to the last value seen under ``key`` (all of ``now`` when it went back: the replica or its engine
    restarted)."""
    before = _SEEN.get(key, 0.0)
    delta = now - before if now >= before else now
    series = counter.labels(*labels)
    if delta > 0:
        series.inc(delta)
    _SEEN[key] = now


def observe_image_cache(model: str, replica: str, stats: dict[str, int]) -> None:
    """Fold one replica's cumulative image-cache counters (``grafting.image_cache.CacheStats.as_dict()``) into
    the metrics: counters grow by the difference to the last snapshot seen from that replica (all of it when
    the replica restarted and its counters went back), gauges are set."""
    for name, counter in (("hits", IMAGE_CACHE_HITS), ("misses", IMAGE_CACHE_MISSES),
                          ("evictions", IMAGE_CACHE_EVICTIONS)):
        _grow(counter, (model, replica), (f"image_cache.{name}", model, replica), int(stats.get(name, 0)))
    IMAGE_CACHE_BYTES.labels(model, replica).set(int(stats.get("bytes", 0)))
    IMAGE_CACHE_ENTRIES.labels(model, replica).set(int(stats.get("entries", 0)))


def observe_spec_decode(model: str, replica: str, counters: dict) -> None:
    """Fold one replica's vLLM speculative-decoding counters (:func:`core.spec.acceptance.spec_counters`: cumulative
    ``drafts``, ``draft_tokens``, ``accepted``, ``accepted_per_pos``) into the metrics like
    :func:`observe_image_cache`, and set the mean acceptance length ``1 + accepted / drafts`` (vLLM's) once there
    are drafts."""
    for name, counter in (("drafts", SPEC_DRAFTS), ("draft_tokens", SPEC_DRAFT_TOKENS), ("accepted", SPEC_ACCEPTED)):
        _grow(counter, (model, replica), (f"spec.{name}", model, replica), float(counters.get(name) or 0.0))
    for pos, value in enumerate(counters.get("accepted_per_pos") or []):
        _grow(SPEC_ACCEPTED_PER_POS, (model, replica, str(pos)), (f"spec.pos{pos}", model, replica), float(value))
    drafts = float(counters.get("drafts") or 0.0)
    if drafts > 0:
        SPEC_MEAN_ACCEPTANCE.labels(model, replica).set(1.0 + float(counters.get("accepted") or 0.0) / drafts)


def observe_traffic_capture(model: str, replica: str, stats: dict) -> None:
    """Fold one replica's traffic writer counters (``grafting.traffic.TrafficWriter.stats()``: cumulative
    ``written``, ``dropped``; ``full``) into the metrics like :func:`observe_image_cache`."""
    for outcome in ("written", "dropped"):
        _grow(TRAFFIC_PROMPTS, (model, replica, outcome), (f"traffic.{outcome}", model, replica),
              float(stats.get(outcome, 0)))
    TRAFFIC_FULL.labels(model, replica).set(1 if stats.get("full") else 0)


def observe_collapse(model: str, report: dict[str, int | bool]) -> None:
    """Count one answer's collapse-guard report (``grafting.collapse_guard.GuardReport`` as a dict)."""
    if report.get("collapses", 0) > 0:
        CHAT_COLLAPSES.labels(model, "cut_short" if report.get("cut_short") else "recovered").inc()
    if report.get("retries", 0) > 0:
        CHAT_COLLAPSE_RETRIES.labels(model).inc(int(report["retries"]))


def observe_vlm_end_event(model: str, event: dict) -> None:
    """Metrics carried by a VLM ``end`` event: ``image_cache`` ``{"replica", "stats"}``, ``traffic_capture``
    ``{"replica", "stats"}``, ``spec_decode`` ``{"replica", "counters"}`` and ``collapse`` (a guard report); any
    may be absent."""
    cache = event.get("image_cache")
    if isinstance(cache, dict) and isinstance(cache.get("stats"), dict):
        observe_image_cache(model, str(cache.get("replica", "")), cache["stats"])
    traffic = event.get("traffic_capture")
    if isinstance(traffic, dict) and isinstance(traffic.get("stats"), dict):
        observe_traffic_capture(model, str(traffic.get("replica", "")), traffic["stats"])
    spec = event.get("spec_decode")
    if isinstance(spec, dict) and isinstance(spec.get("counters"), dict):
        observe_spec_decode(model, str(spec.get("replica", "")), spec["counters"])
    if isinstance(event.get("collapse"), dict):
        observe_collapse(model, event["collapse"])


class MetricsMiddleware:
    """Counts requests and records latency per route template (``/v1/videos/{video_id}``), status included.

    The label is the matched route's template, read from ``scope["route"]`` after routing (FastAPI's routes);
    a request the router answered through a plain Starlette route or a mount (``/docs``, ``/openapi.json``,
    ``/playground/{path}``) gets that route's path (``router``: the app's router, matched against the request's
    scope as it came in); requests matching no route are labelled ``unmatched`` so arbitrary paths cannot create
    new series.

    The status is the one sent (``http.response.start``). A request that ends before any response was sent is
    counted as :data:`services.api.CLIENT_CLOSED` (``499``, nginx's "client closed request") when the client
    went away (its task was cancelled, as Serve does on a disconnect, or the app saw ``http.disconnect`` and
    returned), else ``500`` (Starlette's ``ServerErrorMiddleware`` outside this one, or the server, answers 500)."""

    def __init__(self, app, router=None):
        self.app = app
        self.router = router

    def _label(self, scope, original) -> str:
        route = scope.get("route")
        if getattr(route, "path", None):
            return route.path
        from starlette.routing import Match, Mount

        for r in getattr(self.router, "routes", ()):
            if r.matches(original)[0] != Match.NONE:
                return f"{r.path}/{{path}}" if isinstance(r, Mount) else r.path
        return "unmatched"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status, original = time.perf_counter(), {"code": None, "gone": False}, dict(scope)

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        async def receive_wrapper():
            message = await receive()
            if message["type"] == "http.disconnect":
                status["gone"] = True
            return message

        try:
            await self.app(scope, receive_wrapper, send_wrapper)
        except asyncio.CancelledError:
            status["gone"] = True
            raise
        finally:
            ep = self._label(scope, original)
            sent = status["code"] or (CLIENT_CLOSED if status["gone"] else 500)
            REQUESTS.labels(ep, scope["method"], str(sent)).inc()
            REQUEST_LATENCY.labels(ep, scope["method"]).observe(time.perf_counter() - t0)
