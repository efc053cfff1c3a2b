"""The speech LM on vLLM (``tts.engine.backend: vllm``) against the in-process ``transformers`` reference.

One vLLM server of the cpu profile's speech LM runs for the module (started like the deployment does, with
``services.engines.vllm_server.start_vllm_for``; no Ray; run it under the e2e lock). Asserted:

- inside vLLM, the frame-position logits processor lets no out-of-position id through even when the request's
  ``logit_bias`` (+100, far above the random model's logits) prefers wrong-position ids, end_of_speech and a text
  id; without the processor's ``vllm_xargs`` the same request does emit them (the bias works: a control);
- greedy decoding on vLLM gives the reference's frames and audio exactly (both fp32: greedy picks agree unless two
  logits tie within rounding, which these sentences do not), loop guard and retries included;
- the loop guard fires on streamed tokens (a scripted stand-in: ``logit_bias`` makes every frame the same): the
  attempt's stream is closed when the guard fires and a new request is sent with the raised penalty;
- cancelling a synthesis stops it at the next token and vLLM then holds no request (running + waiting 0). (vLLM's
  ``request_success_total`` does not count these aborts, measured: a proof that the abort is immediate, not the
  end of a request run out, is not asserted here yet);
- 8 concurrent syntheses all complete, batched in the one engine.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import numpy as np
import pytest

from audio.config import SamplingConfig
from audio.engine import Cancelled, SpeechAudio, SpeechDone, TTSEngine
from audio.generate import SentenceReport, generate_frames
from audio.layout import parse_frames
from audio.lm_stream import SpeechLM, frame_request
from core.vllm_client import request_body
from services.engines.vllm_server import start_vllm_for

CEILING_S = 120.0  # a hang guard for polls of vLLM's metrics, far above any real wait


@pytest.fixture(scope="module")
def engines(profile, model_dir):
    """``{"vllm": TTSEngine, "transformers": TTSEngine}`` of the cpu profile's speech section."""
    cfg = profile.tts.engine.model_copy(update={"backend": "vllm"})
    client = start_vllm_for(cfg, model_dir)
    try:
        assert client.wait_ready(600), client.server.log_tail()
        ref = TTSEngine.from_config(cfg.model_copy(update={"backend": "transformers"}), model_dir)
        vllm = TTSEngine(cfg, client, ref.tokenizer, ref.snac)
        yield {"vllm": vllm, "transformers": ref}
        vllm.close()
    finally:
        client.close()


def metrics(engine) -> dict[str, float]:
    """vLLM's request count ``held`` (running + waiting now, from its ``/metrics``)."""
    text = httpx.get(f"{engine.client.base_url}/metrics", timeout=10).text
    out = {"held": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            out["held"] += float(line.rsplit(" ", 1)[1])
    return out


def wait_held_zero(engine) -> None:
    deadline = time.monotonic() + CEILING_S
    while metrics(engine)["held"] != 0:
        assert time.monotonic() < deadline, "vLLM still holds requests"
        time.sleep(0.1)


def tokens_of(engine, body: dict) -> tuple[list[int], str | None]:
    async def go():
        ids, finish = [], None
        async for c in engine.client.stream_body(body):
            ids += c.token_ids
            finish = c.finish_reason or finish
        return ids, finish
    return asyncio.run(go())


def test_constraint_holds_inside_vllm_against_biased_logits(engines):
    e = engines["vllm"]
    lay = e.layout
    prompt = e.prompt("tara", "Hello there.")
    wrong = [lay.audio_id(3, 0), lay.audio_id(5, 9), lay.end_of_speech, 42]
    bias = {str(i): 100 for i in wrong}
    greedy = SamplingConfig(temperature=0.0, top_p=1.0, repetition_penalty=1.0)
    body = request_body(frame_request(prompt, len(prompt), greedy, lay, seed=0, max_tokens=21)) | {"logit_bias": bias}
    ids, finish = tokens_of(e, body)
    # positions 3 and 5 take their biased id (allowed there), the others their argmax; end_of_speech (biased) ends
    # the sentence at the first boundary it is allowed at: after one whole frame
    audio = ids[:-1] if ids and ids[-1] == lay.end_of_speech else ids
    assert finish == "stop" and len(audio) == 7
    assert all(lay.position_range(i)[0] <= t < lay.position_range(i)[1] for i, t in enumerate(audio))
    frame = parse_frames(lay, audio + [lay.end_of_speech])[0]
    assert frame[3] == 0 and frame[5] == 9
    control = dict(body)
    control.pop("vllm_xargs")
    ids, _ = tokens_of(e, control)
    assert ids and ids[0] in wrong  # unconstrained, a biased id that is wrong at position 0 wins
    assert metrics(e)["held"] == 0


@pytest.mark.parametrize("text", ["Hello there, how are you today?", "A second, different sentence."])
def test_greedy_vllm_equals_the_transformers_reference(engines, text):
    greedy = {"sampling": SamplingConfig(temperature=0.0, top_p=1.0, repetition_penalty=1.1)}
    out = {}
    for name, e in engines.items():
        g = TTSEngine(e.cfg.model_copy(update=greedy), e.client, e.tokenizer, e.snac)
        events = list(g.synthesize(text, seed=0))
        out[name] = (np.concatenate([ev.audio for ev in events if isinstance(ev, SpeechAudio)]), events[-1].usage)
    (a, ua), (b, ub) = out["vllm"], out["transformers"]
    assert a.shape == b.shape and ua["frames"] == ub["frames"] > 0 and ua["loops"] == ub["loops"]
    assert np.array_equal(a, b)  # the same frames through the same SNAC decode: bit-identical audio


class LoopingVLLM:
    """Scripted stand-in through vLLM: the real client, its bodies with ``logit_bias`` +100 on one code per frame
    position, so every frame is the same whatever the repetition penalty (100 / 1.4 still dominates the random
    model's logits). Records each attempt's (repetition penalty, seed)."""

    def __init__(self, client, layout):
        self.client = client
        self.bias = {str(layout.audio_id(p, 17 * p + 1)): 100 for p in range(layout.positions)}
        self.attempts = []

    def stream(self, request):
        body = request_body(request) | {"logit_bias": self.bias}
        self.attempts.append((body["repetition_penalty"], body["seed"]))
        return self.client.stream_body(body)


def test_loop_guard_closes_and_resubmits_on_vllm(engines):
    e = engines["vllm"]
    looping = LoopingVLLM(e.client, e.layout)
    lm = SpeechLM(looping)
    report = SentenceReport()
    prompt = e.prompt("tara", "This loops.")
    frames = list(generate_frames(lm, e.layout, prompt, e.cfg.sampling, e.cfg.loop_guard, 64, 0, None, report))
    # the 8-frame window fills with one repeated frame: the loop starts at frame 0, so nothing is kept; one retry
    # with penalty 1.1 + 0.3 and seed 0 + 1, then cut short (max_retries 1)
    assert frames == [] and report.retries == 1 and report.cut_short and report.loops == [0, 0]
    assert [p for p, _ in looping.attempts] == pytest.approx([1.1, 1.4])
    assert [s for _, s in looping.attempts] == [0, 1]
    lm.close()
    wait_held_zero(e)


def test_cancel_stops_the_synthesis_and_frees_vllm(engines):
    e = engines["vllm"]
    cancel = threading.Event()
    events = e.synthesize("A sentence long enough to still be speaking when it is cancelled, surely.", seed=1,
                          cancel=cancel)
    first = next(events)
    assert isinstance(first, SpeechAudio)  # after 3 of the sentence's 18 frames
    cancel.set()
    with pytest.raises(Cancelled):  # at the next token
        for _ in events:
            pass
    wait_held_zero(e)


def test_eight_concurrent_syntheses_complete(engines):
    e = engines["vllm"]
    results: dict[int, object] = {}

    def run(i):
        results[i] = list(e.synthesize(f"Stream number {i} says hello.", seed=i))[-1]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(CEILING_S)
    assert sorted(results) == list(range(8))
    assert all(isinstance(d, SpeechDone) and d.usage["frames"] > 0 for d in results.values())
    wait_held_zero(e)
