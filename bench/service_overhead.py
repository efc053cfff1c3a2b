"""Service overhead: HTTP (Ray Serve + FastAPI + openai SDK) latency vs the in-process engine, same request.

Starts ``chimera serve`` as a subprocess on a free port, then alternates the same image-QA request (a real
photograph, greedy, fixed answer length) in-process and over HTTP, and prints the median latency of each and
their ratio (target <= 1.15), plus the resident memory of the whole service process tree (target < 6 GB).

    .venv/bin/python bench/service_overhead.py [--rounds 5] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import statistics
import sys
import time
from pathlib import Path

# The replica runs with OMP_NUM_THREADS=<torch_threads> in its environment (1 in the cpu profile); give the
# in-process engine the same, before torch/numpy start their thread pools, or the comparison is unfair.
os.environ.setdefault("OMP_NUM_THREADS", "1")


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.served import ServedChimera  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()

    import openai
    import torch
    from PIL import Image
    from skimage import data

    from grafting.engine import VLMEngine
    from services.config.profiles import load_profile

    prof = load_profile(args.profile)
    buf = io.BytesIO()
    Image.fromarray(data.astronaut()).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is in this picture?"}]}]

    server = ServedChimera(args.profile, ready_ceiling_s=600)
    try:
        base = server.base
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)
        vlm = prof.vlm
        threads = vlm.deployment.torch_threads or torch.get_num_threads()
        if str(threads) != os.environ["OMP_NUM_THREADS"]:
            raise SystemExit(f"run with OMP_NUM_THREADS={threads} (the profile's torch_threads)")
        torch.set_num_threads(threads)
        engine = VLMEngine.from_config(vlm.engine, prof.resolved_model_dir())

        def in_process() -> tuple[float, int]:
            t0 = time.perf_counter()
            c = engine.complete(messages, max_tokens=args.max_tokens, temperature=0)
            return time.perf_counter() - t0, c.completion_tokens

        def over_http() -> tuple[float, int]:
            t0 = time.perf_counter()
            r = client.chat.completions.create(model=vlm.model_id, messages=messages, max_tokens=args.max_tokens,
                                               temperature=0)
            return time.perf_counter() - t0, r.usage.completion_tokens

        in_process(), over_http()  # warm-up both paths
        eng_t, http_t = [], []
        for _ in range(args.rounds):
            t, n1 = in_process()
            eng_t.append(t)
            t, n2 = over_http()
            http_t.append(t)
            assert n1 == n2, (n1, n2)
        rss = server.rss()
        e, h = statistics.median(eng_t), statistics.median(http_t)
        print(f"request: image QA (512x512 photo -> {engine.prepare(messages).num_image_tokens} image tokens), "
              f"{n1} completion tokens, greedy, {args.rounds} rounds alternated")
        print(f"in-process engine  median {e * 1000:8.1f} ms   (all: {', '.join(f'{x * 1000:.0f}' for x in eng_t)})")
        print(f"HTTP via service   median {h * 1000:8.1f} ms   (all: {', '.join(f'{x * 1000:.0f}' for x in http_t)})")
        print(f"ratio HTTP / in-process: {h / e:.3f}   (target <= 1.15)")
        print(f"service resident memory (whole process tree): {rss / 2**30:.2f} GiB   (target < 6 GB)")
    finally:
        t0 = time.perf_counter()
        rc = server.stop()  # SIGTERM to the CLI alone, as `kill <pid>` does
        print(f"service stop on SIGTERM: exit code {rc} after {time.perf_counter() - t0:.1f} s")
    if rc != 0:
        raise SystemExit(f"chimera serve exited with {rc} on SIGTERM")


if __name__ == "__main__":
    main()
