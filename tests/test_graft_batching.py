"""Shutting down the continuous batcher: ``close()`` stops and joins its thread, so a process that used one exits
cleanly (issue 10, defect 2: ``bench/vlm_batching.py`` aborted with "terminate called without an active
exception" when the interpreter exited while the daemon batcher thread was still inside torch)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from grafting.batching import BatcherClosed, ContinuousBatcher
from grafting.engine import VLMEngine
from grafting.llm_stream import completion_request

ROOT = Path(__file__).resolve().parent.parent
LONG = [{"role": "user", "content": "Count from one to one hundred in words."}]


@pytest.fixture(scope="module")
def engine(profile, model_dir) -> VLMEngine:
    return VLMEngine.from_config(profile.vlm.engine, model_dir)


def _request(engine, messages, **sampling):
    """The client request of ``messages`` (what ``VLMEngine.stream`` sends the batcher)."""
    return completion_request(engine.model, engine.prepare(messages), engine.sampling_params(**sampling),
                              engine.eos_token_ids)


def _recorder(items: list, on_first_delta=None):
    """An ``emit`` that appends every item; calls ``on_first_delta()`` (from the batcher thread) once."""
    def emit(item):
        items.append(item)
        if on_first_delta is not None and len(items) == 1 and not isinstance(item, Exception):
            on_first_delta()
    return emit


def test_close_mid_decode_fails_running_and_queued_requests_once(engine):
    """close() called while a request is being decoded (from its first token's callback, so the timing is fixed):
    the running request and the one still queued behind it (max_batch_size 1) each get exactly one BatcherClosed
    as their last item, the thread is gone once close() returns, submit() then raises, and close() is idempotent."""
    batcher = ContinuousBatcher(engine.model.llm, engine.tokenizer, max_batch_size=1)
    req = _request(engine, LONG, max_tokens=64, temperature=0)
    running, queued = [], []
    batcher.submit(req, None, _recorder(running, on_first_delta=batcher.close))
    batcher.submit(req, None, _recorder(queued))
    batcher._thread.join(300)  # close() from the callback does not join its own thread; this waits for the end
    batcher.close()  # from the main thread: joins (already stopped), and a second close is harmless
    assert not batcher._thread.is_alive()
    assert len(running) == 2 and running[0].finish_reason is None and isinstance(running[1], BatcherClosed)
    assert len(queued) == 1 and isinstance(queued[0], BatcherClosed)
    assert batcher.active == 0
    with pytest.raises(BatcherClosed):
        batcher.submit(req, None, _recorder([]))


def test_engine_close_stops_its_batcher_and_a_new_one_serves(engine):
    """VLMEngine.close() joins the batcher its client started; the next request starts a fresh one that answers."""
    first = engine.client.batcher()
    engine.close()
    assert not first._thread.is_alive()
    engine.close()  # idempotent
    second = engine.client.batcher()
    assert second is not first
    items, done = [], threading.Event()
    second.submit(_request(engine, LONG, max_tokens=3, temperature=0), None,
                  lambda d: (items.append(d), d.completion_tokens is not None and done.set()))
    assert done.wait(300)
    assert not any(isinstance(d, Exception) for d in items)
    assert items[-1].completion_tokens == 3 and items[-2].finish_reason == "length"
    engine.close()
    assert not second._thread.is_alive()


def test_process_closing_batcher_mid_decode_exits_0():
    """A process that closes its batcher from the main thread while two requests are being decoded exits with
    code 0 and no "terminate called" (before the fix the same program aborted with SIGABRT, code 134)."""
    script = textwrap.dedent("""
        import threading
        from grafting.engine import VLMEngine
        from grafting.llm_stream import completion_request
        from services.config.profiles import load_profile
        prof = load_profile("cpu")
        engine = VLMEngine.from_config(prof.vlm.engine, prof.resolved_model_dir())
        first = threading.Event()
        for n in range(2):
            req = completion_request(engine.model, engine.prepare([{"role": "user", "content": f"Count to {100 + n}."}]),
                                     engine.sampling_params(max_tokens=200, temperature=0), engine.eos_token_ids)
            engine.client.batcher().submit(req, None, lambda d: first.set())
        assert first.wait(300)
        engine.close()
        print("closed")
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "closed"
    assert "terminate called" not in proc.stderr
