"""Concurrent speech streams: today's engine as baseline against the engine as served, side by side in one run,
1, 4 and 8 concurrent streams.

Engines (``--engines``, all by default, interleaved so that all see the same machine load):

- ``transformers``: the baseline, today's engine: the in-process LM (one decode loop per stream) and each
  stream decoding its own SNAC windows in its own thread (``snac_batch_frames: 0``);
- ``transformers-batched``: the same LM, SNAC windows through the engine's shared batched decoder;
- ``vllm-unbatched``: the speech LM on vLLM (one engine batching every stream), per-thread SNAC;
- ``vllm``: the engine as the replica serves ``backend: vllm``: ``TTSEngine.from_config`` with the vLLM client,
  the speech LM on vLLM and the profile's batched SNAC decoder (``snac_batch_frames``).

Each stream synthesizes one sentence (the same text, its own seed) in its own thread, as the service's replica
does. Printed per engine and concurrency: aggregate audio seconds per wall second (all streams' audio over the
wall time from the first start to the last end), time to first audio (TTFA) p50/p90 over the streams of all
rounds, SNAC windows per SNAC call (the batched engines' mean batch), and the ratios the issue targets: the
served engine's aggregate at 8 streams over the baseline's at 8 (target >= 3), and the served engine's TTFA p50
at 8 streams over its TTFA p50 at 1 (target <= 2). Starts a vLLM server (run it under the e2e lock on a shared
machine).

    .venv/bin/python bench/tts_concurrency.py [--profile cpu] [--rounds 2] [--streams 1,4,8] [--engines ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TEXT = "The quick brown fox jumps over the lazy dog near the river bank."
ENGINES = ["transformers", "transformers-batched", "vllm-unbatched", "vllm"]
BASELINE, SERVED = "transformers", "vllm"


def run_streams(engine, n: int, seed0: int) -> tuple[float, float, list[float]]:
    """``n`` concurrent syntheses of :data:`TEXT`; returns (audio seconds, wall seconds, TTFA of each stream)."""
    from audio.engine import SpeechAudio

    audio, ttfa = [0.0] * n, [float("nan")] * n

    def one(i: int, t0: float) -> None:
        for ev in engine.synthesize(TEXT, voice="tara", seed=seed0 + i):
            if isinstance(ev, SpeechAudio) and len(ev.audio):
                if ttfa[i] != ttfa[i]:
                    ttfa[i] = time.perf_counter() - t0
                audio[i] += len(ev.audio) / 24000

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i, t0)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(audio), time.perf_counter() - t0, ttfa


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs`` by linear interpolation (statistics.quantiles, inclusive)."""
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[round(q * 100) - 1]


def parser() -> argparse.ArgumentParser:
    """This benchmark's command line (bench/gpu_quant.py validates bench/gpu_scale.sh's calls with it)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--streams", default="1,4,8")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the cpu profile's replica uses 1)")
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of " + ",".join(ENGINES))
    return ap


def main() -> None:
    args = parser().parse_args()
    streams = [int(x) for x in args.streams.split(",")]
    names = args.engines.split(",")
    if not set(names) <= set(ENGINES) or not {BASELINE, SERVED} <= set(names):
        raise SystemExit(f"--engines: a subset of {ENGINES} holding {BASELINE} and {SERVED}")

    import torch

    from audio.build import prepare
    from audio.engine import TTSEngine
    from services.config.profiles import load_profile
    from services.engines.vllm_server import start_vllm_for

    torch.set_num_threads(args.threads)
    profile = load_profile(args.profile)
    model_dir = profile.resolved_model_dir()
    cfg = profile.tts.engine
    prepare(cfg, model_dir)
    unbatched = {"snac_batch_frames": 0}
    ref = TTSEngine.from_config(cfg.model_copy(update={"backend": "transformers", **unbatched}), model_dir)
    vcfg = cfg.model_copy(update={"backend": "vllm", "max_batch_size": max(cfg.max_batch_size, max(streams))})
    client = start_vllm_for(vcfg, model_dir)
    try:
        if not client.wait_ready(900):
            raise SystemExit(f"vLLM did not start:\n{client.server.log_tail()}")
        served = TTSEngine.from_config(vcfg, model_dir, lm_client=client)  # as services/api/speech.py builds it
        engines = {"transformers": ref,
                   "transformers-batched": TTSEngine(ref.cfg.model_copy(update={"snac_batch_frames":
                                                                               cfg.snac_batch_frames}),
                                                     ref.client, ref.tokenizer, ref.snac),
                   "vllm-unbatched": TTSEngine(vcfg.model_copy(update=unbatched), client,
                                               ref.tokenizer, ref.snac),
                   "vllm": served}
        engines = {k: engines[k] for k in names}
        for e in engines.values():
            run_streams(e, 1, 0)  # warm up
        res = {(b, n): {"audio": 0.0, "wall": 0.0, "ttfa": [], "calls": 0, "windows": 0}
               for b in engines for n in streams}
        for r in range(args.rounds):
            for n in streams:
                for b, e in engines.items():  # interleaved: all see the same machine load
                    dec = e.snac_decoder
                    c0, w0 = (dec.calls, dec.windows) if dec else (0, 0)
                    audio, wall, ttfa = run_streams(e, n, 1000 * r)
                    res[b, n]["audio"] += audio
                    res[b, n]["wall"] += wall
                    res[b, n]["ttfa"] += ttfa
                    if dec:
                        res[b, n]["calls"] += dec.calls - c0
                        res[b, n]["windows"] += dec.windows - w0
    finally:
        client.close()
    print(f"profile {args.profile}, {args.rounds} rounds, text {len(TEXT)} chars, snac_batch_frames "
          f"{cfg.snac_batch_frames}, torch threads {args.threads}")
    print(f"{'engine':<22}{'streams':>8}{'audio s/wall s':>16}{'TTFA p50 s':>12}{'TTFA p90 s':>12}"
          f"{'windows/call':>14}")
    agg = {}
    for (b, n), v in res.items():
        agg[b, n] = v["audio"] / v["wall"]
        per_call = f"{v['windows'] / v['calls']:.2f}" if v["calls"] else "-"
        print(f"{b:<22}{n:>8}{agg[b, n]:>16.3f}{pct(v['ttfa'], 0.5):>12.3f}{pct(v['ttfa'], 0.9):>12.3f}"
              f"{per_call:>14}")
    hi, lo = max(streams), min(streams)
    print(f"{SERVED} (served) / {BASELINE} (today's engine) aggregate at {hi} streams: "
          f"{agg[SERVED, hi] / agg[BASELINE, hi]:.2f}x (target >= 3)")
    t_hi, t_lo = pct(res[SERVED, hi]["ttfa"], 0.5), pct(res[SERVED, lo]["ttfa"], 0.5)
    print(f"{SERVED} (served) TTFA p50 {hi} streams / {lo} stream: {t_hi / t_lo:.2f}x (target <= 2)")


if __name__ == "__main__":
    main()
