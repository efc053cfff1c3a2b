"""Prometheus metrics, recorded in the ingress process (Ray replicas are other processes).

Per-endpoint request counts and latency; time to first token (TTFT) and inter-token latency (ITL) of chat;
each family adds its block below. Exposed at ``GET /metrics``.
"""

from __future__ import annotations

import asyncio
import logging
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

REQUESTS = Counter("chimera_requests_total", "HTTP requests by endpoint, method and status code",
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
