"""Speech latency on a profile (default cpu): time to first audio and total time, 1 sentence vs 10 sentences.

Runs the speech engine in-process (the one the service wraps) on a 1-sentence and a 10-sentence input, side by
side, several rounds each, and prints medians of: time to first audio (TTFA), total time, audio seconds and the
real-time factor (RTF = wall time / audio seconds; below 1 is faster than real time), then the ratio
TTFA(10 sentences) / total(10 sentences) (target <= 25%).

    .venv/bin/python bench/tts_latency.py [--profile cpu] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.", "I never thought I would see the ocean again.",
    "Please leave the keys on the kitchen table.", "The train to the city leaves at half past eight.",
    "She laughed <chuckle> and told the story once more.", "Rain is expected for most of the weekend.",
    "We should plant tomatoes before the end of May.", "His old radio still picks up the evening news.",
    "Turn left at the bakery and walk two blocks.", "Thank you for listening, and good night.",
]


def run_once(engine, text: str, seed: int) -> dict:
    """One synthesis; returns seconds to first audio, total seconds, audio seconds."""
    from audio.engine import SpeechAudio, SpeechDone

    t0, c0 = time.perf_counter(), time.process_time()
    first, n = None, 0
    usage = {}
    for ev in engine.synthesize(text, voice="tara", seed=seed):
        if isinstance(ev, SpeechAudio) and len(ev.audio):
            first = first if first is not None else time.perf_counter() - t0
            n += len(ev.audio)
        elif isinstance(ev, SpeechDone):
            usage = ev.usage
    total = time.perf_counter() - t0
    return {"ttfa": first, "total": total, "audio": n / 24000, "frames": usage.get("frames", 0),
            "cpu": time.process_time() - c0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the cpu profile's replica uses 1)")
    ap.add_argument("--chunk-frames", type=int, default=None, help="override the profile's SNAC chunk_frames")
    args = ap.parse_args()

    import torch

    from audio.build import prepare
    from audio.engine import TTSEngine
    from services.config.profiles import load_profile

    torch.set_num_threads(args.threads)
    profile = load_profile(args.profile)
    model_dir = profile.resolved_model_dir()
    cfg = profile.tts.engine.model_copy(update={"backend": "transformers"})  # the in-process engine
    if args.chunk_frames:
        cfg = cfg.model_copy(update={"chunk_frames": args.chunk_frames})
    prepare(cfg, model_dir)
    engine = TTSEngine.from_config(cfg, model_dir)
    inputs = {"1 sentence": SENTENCES[0], "10 sentences": " ".join(SENTENCES)}
    run_once(engine, "Warm up.", 0)
    results = {k: [] for k in inputs}
    for r in range(args.rounds):
        for name, text in inputs.items():  # interleaved: both see the same machine load
            results[name].append(run_once(engine, text, seed=r))

    med = {k: {m: statistics.median(x[m] for x in v) for m in ("ttfa", "total", "audio", "frames", "cpu")}
           for k, v in results.items()}
    print(f"profile={args.profile} torch_threads={args.threads} rounds={args.rounds} "
          f"device={cfg.device} chunk_frames={cfg.chunk_frames} (medians)")
    print(f"{'input':<14}{'frames':>8}{'audio s':>10}{'TTFA s':>10}{'total s':>10}{'RTF':>8}{'CPU RTF':>9}"
          f"{'TTFA/total':>12}")
    for name, m in med.items():
        print(f"{name:<14}{m['frames']:>8.0f}{m['audio']:>10.2f}{m['ttfa']:>10.3f}{m['total']:>10.2f}"
              f"{m['total'] / m['audio']:>8.2f}{m['cpu'] / m['audio']:>9.2f}{m['ttfa'] / m['total']:>11.1%}")
    print("RTF = wall seconds / audio seconds; CPU RTF = this process's CPU seconds / audio seconds (less "
          "sensitive to other load on a shared machine)")
    one, ten = med["1 sentence"], med["10 sentences"]
    ratio = ten["ttfa"] / ten["total"]
    print(f"TTFA(10 sentences) / total(10 sentences) = {ratio:.1%} (target <= 25%: {'met' if ratio <= 0.25 else 'NOT met'})")
    print(f"TTFA(10 sentences) / TTFA(1 sentence) = {ten['ttfa'] / one['ttfa']:.2f}x  "
          f"(long input does not delay the first audio)")


if __name__ == "__main__":
    main()
