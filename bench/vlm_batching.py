"""Continuous batching vs one request at a time, same requests, side by side in one run.

N chat requests (half with a photograph, half text only; greedy, fixed answer length) are answered one by one,
then submitted together to the engine's ContinuousBatcher. Prints wall time of each, the speed-up, tokens/s, and
checks both give the same answers.

    OMP_NUM_THREADS=1 .venv/bin/python bench/vlm_batching.py [--requests 4] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()

    import torch
    from PIL import Image
    from skimage import data

    from grafting.batching import ContinuousBatcher
    from grafting.llm_stream import completion_request
    from grafting.engine import VLMEngine
    from services.config.profiles import load_profile

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    prof = load_profile(args.profile)
    engine = VLMEngine.from_config(prof.vlm.engine, prof.resolved_model_dir())
    photo = Image.fromarray(data.astronaut())
    questions = ["What is in this picture?", "Describe the colours.", "What is the capital of France?",
                 "Write a haiku about the sea.", "Who is in the photo?", "Name three animals."]
    convs = []
    for i in range(args.requests):
        q = questions[i % len(questions)]
        content = [{"type": "image", "image": photo}, {"type": "text", "text": q}] if i % 2 == 0 else q
        convs.append([{"role": "user", "content": content}])
    params = engine.sampling_params(max_tokens=args.max_tokens, temperature=0)

    engine.complete(convs[0], max_tokens=4, temperature=0)  # warm-up
    t0 = time.perf_counter()
    one_by_one = [engine.complete(c, max_tokens=args.max_tokens, temperature=0) for c in convs]
    t_seq = time.perf_counter() - t0

    texts = [[] for _ in convs]
    done = [threading.Event() for _ in convs]
    errors: list[Exception] = []

    def emitter(i):
        def emit(d):
            if isinstance(d, Exception):  # a failed request ends the bench with that error, not a hang
                errors.append(d)
                done[i].set()
                return
            texts[i].append(d.text)
            if d.completion_tokens is not None:  # the usage chunk: the last one
                done[i].set()
        return emit

    requests = [completion_request(engine.model, engine.prepare(c), params, engine.eos_token_ids) for c in convs]
    # closed on leaving the block: a batcher thread still alive at interpreter exit aborts the process
    with ContinuousBatcher(engine.model.llm, engine.tokenizer, args.requests) as batcher:
        t0 = time.perf_counter()
        for i, r in enumerate(requests):
            batcher.submit(r, None, emitter(i))
        for d in done:
            d.wait()
        t_batch = time.perf_counter() - t0
    if errors:
        raise errors[0]
    tokens = sum(c.completion_tokens for c in one_by_one)
    same = all("".join(t) == c.text for t, c in zip(texts, one_by_one))
    print(f"{args.requests} requests ({(args.requests + 1) // 2} with a photo), {tokens} completion tokens in all, "
          f"greedy, {os.environ['OMP_NUM_THREADS']} torch thread(s)")
    print(f"one by one          {t_seq:7.2f} s   {tokens / t_seq:6.1f} tokens/s")
    print(f"continuous batching {t_batch:7.2f} s   {tokens / t_batch:6.1f} tokens/s   (max batch {batcher.max_batch_seen})")
    print(f"speed-up: {t_seq / t_batch:.2f}x   same answers: {same}")


if __name__ == "__main__":
    main()
