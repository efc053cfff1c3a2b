"""Load at the queue limits, loopback only, bounded: the cpu profile with the VLM's queue at 16 requests.

Starts ``chimera serve`` (``bench/served.py``) on 127.0.0.1 with ``vlm.deployment.max_queued_requests = 16`` and
the video store in a temporary folder, then, all at once:
- 64 concurrent chat completions (``max_tokens`` 8), 16 concurrent video creates (one step, 32x32; deleted at
  the end), 32 concurrent speech requests (a short sentence, WAV);
and checks every response: a correct 200 (chat: a ``chat.completion`` with ``usage.completion_tokens`` >= 1;
video: a ``video`` object ``queued``; speech: a RIFF/WAVE file with samples) or a 429 in OpenAI's error shape with
``Retry-After``; none lost (one answer per request), no 5xx, nothing else. Prints counts and latency percentiles
(p50/p90/p99, seconds) per family. Then a 30 MB chat body: 413 ``request_too_large`` in under 1 s, and the
resident memory of the ingress, proxy and VLM replica processes does not grow by more than ``RSS_BOUND``
(a 30 MB body read whole would add at least its own size). Exit status 1 if any check fails.

    .venv/bin/python bench/load.py
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.served import ServedChimera  # noqa: E402

CHAT_N, VIDEO_N, SPEECH_N, VLM_QUEUE = 64, 16, 32, 16
BIG_BODY = 30 * 10**6
RSS_BOUND = 16 * 2**20
TIMEOUT_S = 600


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _ok_chat(r) -> bool:
    j = r.json()
    return j["object"] == "chat.completion" and j["usage"]["completion_tokens"] >= 1 \
        and isinstance(j["choices"][0]["message"]["content"], str)


def _ok_video(r) -> bool:
    j = r.json()
    return j["object"] == "video" and j["status"] == "queued" and j["id"].startswith("video_")


def _ok_speech(r) -> bool:
    return r.content[:4] == b"RIFF" and r.content[8:12] == b"WAVE" and len(r.content) > 44


def _is_429(r) -> bool:
    try:
        err = r.json()["error"]
    except Exception:  # noqa: BLE001
        return False
    return bool(r.headers.get("retry-after")) and set(err) == {"message", "type", "param", "code"}


async def _one(client, family: str, method: str, path: str, body: dict, results: list) -> None:
    t0 = time.perf_counter()
    try:
        r = await client.request(method, path, json=body)
        results.append((family, r.status_code, time.perf_counter() - t0, r))
    except Exception as exc:  # noqa: BLE001 - a lost request is counted as such
        results.append((family, f"lost: {type(exc).__name__}", time.perf_counter() - t0, None))


def main() -> int:
    """Run the burst and the 30 MB check (module doc); print the table and figures. Returns the exit status."""
    import httpx

    from services.config.profiles import load_profile

    prof = load_profile("cpu").model_dump(mode="json")
    prof["vlm"]["deployment"]["max_queued_requests"] = VLM_QUEUE
    tmp = Path(tempfile.mkdtemp(prefix="chimera-load-"))
    prof["video"]["engine"]["jobs"].update(store_url=f"sqlite:///{tmp}/jobs.sqlite", results_dir=str(tmp / "results"))
    failures: list[str] = []
    with ServedChimera(prof, ready_ceiling_s=900) as server:
        print(f"service ready in {server.startup_s:.0f} s at {server.base}")

        async def burst():
            results: list = []
            limits = httpx.Limits(max_connections=CHAT_N + VIDEO_N + SPEECH_N)
            async with httpx.AsyncClient(base_url=server.base, timeout=TIMEOUT_S, limits=limits) as c:
                chat = {"model": "chimera-vlm", "max_tokens": 8, "messages": [{"role": "user", "content": "Hello"}]}
                tasks = [_one(c, "chat", "POST", "/v1/chat/completions", chat, results) for _ in range(CHAT_N)]
                tasks += [_one(c, "video", "POST", "/v1/videos", {"prompt": f"a dot {i}", "size": "32x32",
                                                                  "seconds": "4", "num_inference_steps": 1},
                               results) for i in range(VIDEO_N)]
                tasks += [_one(c, "speech", "POST", "/v1/audio/speech",
                               {"input": "Hello there.", "response_format": "wav", "stream": False}, results)
                          for _ in range(SPEECH_N)]
                t0 = time.perf_counter()
                await asyncio.gather(*tasks)
                wall = time.perf_counter() - t0
                for fam, status, _, r in results:  # delete the jobs this created
                    if fam == "video" and status == 200:
                        await c.delete(f"/v1/videos/{r.json()['id']}")
            return results, wall

        results, wall = asyncio.run(burst())
        check = {"chat": _ok_chat, "video": _ok_video, "speech": _ok_speech}
        sent = {"chat": CHAT_N, "video": VIDEO_N, "speech": SPEECH_N}
        print(f"burst of {sum(sent.values())} requests in {wall:.1f} s")
        print(f"{'family':8s} {'sent':>5s} {'200':>5s} {'429':>5s} {'other':>5s}   p50     p90     p99   (s, 200s)")
        for fam in ("chat", "video", "speech"):
            mine = [x for x in results if x[0] == fam]
            ok = [x for x in mine if x[1] == 200 and check[fam](x[3])]
            busy = [x for x in mine if x[1] == 429 and _is_429(x[3])]
            other = [x for x in mine if x not in ok and x not in busy]
            lat = [x[2] for x in ok] or [float("nan")]
            print(f"{fam:8s} {sent[fam]:5d} {len(ok):5d} {len(busy):5d} {len(other):5d}  "
                  f"{_pct(lat, .5):6.2f}  {_pct(lat, .9):6.2f}  {_pct(lat, .99):6.2f}")
            if len(mine) != sent[fam]:
                failures.append(f"{fam}: {sent[fam] - len(mine)} requests lost")
            for x in other:
                failures.append(f"{fam}: unexpected answer {x[1]}: {x[3].text[:200] if x[3] is not None else ''}")
            if not ok:
                failures.append(f"{fam}: no request succeeded")

        # 30 MB body: refused at the edge, and nothing grows
        procs = {m: server.members(m) for m in ("ServeReplica:chimera:ingress", "ProxyActor",
                                                   "ServeReplica:chimera:vlm")}
        before = {m: sum(p.memory_info().rss for p in ps) for m, ps in procs.items()}
        body = b'{"model": "chimera-vlm", "messages": [{"role": "user", "content": "' + b"x" * BIG_BODY + b'"}]}'
        t0 = time.perf_counter()
        r = httpx.post(f"{server.base}/v1/chat/completions", content=body,
                       headers={"content-type": "application/json"}, timeout=60)
        took = time.perf_counter() - t0
        code = r.json().get("error", {}).get("code") if r.headers.get("content-type", "").startswith(
            "application/json") else None
        print(f"30 MB body: {r.status_code} {code} in {took:.3f} s")
        if r.status_code != 413 or code != "request_too_large" or took >= 1.0:
            failures.append(f"30 MB body: {r.status_code} {code} in {took:.3f} s (want 413 request_too_large < 1 s)")
        time.sleep(1.0)  # let a body that did get through reach the replicas before measuring
        for m, ps in procs.items():
            grown = sum(p.memory_info().rss for p in ps) - before[m]
            print(f"  RSS growth {m}: {grown / 2**20:+.1f} MiB")
            if grown > RSS_BOUND:
                failures.append(f"{m} grew {grown / 2**20:.1f} MiB after the 30 MB body")
    for f in failures:
        print("FAIL", f)
    print("load: ok" if not failures else f"load: {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
