"""Speculative decoding on vLLM for the cpu profile's LLM: none vs n-gram vs an EAGLE-3 head (``chimera speculator
train``), side by side in one run, at 1 and 8 concurrent requests.

One vLLM server per method, started as the service starts it (:func:`services.engines.vllm_server.server_spec` under
:class:`services.engines.process.ServerProcess`, the profile's ``vlm.engine.vllm`` options with
``vllm.speculative`` set and ``--max-num-seqs`` raised to the highest concurrency), one at a time. The prompts are
the held-out text chat prompts (:data:`grafting.train.evaluate.TEXT_PROMPTS`, chat template applied, token ids, as
the service sends text prompts; image prompts with speculation are refused by vLLM 0.32, see
docs/operations/speculator.md), streamed greedily through :class:`core.vllm_client.VLLMClient` with ``max_tokens``
each. Per method and concurrency: generated tokens per second of wall time, inter-token latency p50/p95 (a chunk
of n tokens that arrives g seconds after the previous one counts n latencies of g / n: speculation delivers
several tokens per step), the mean acceptance length from the difference of vLLM's ``/metrics`` counters
(:func:`core.spec.acceptance.counters_from_metrics`), and the ratios to ``none``. Greedy answers (token ids) must
be identical to ``none``'s at the same concurrency: the mismatches are printed and the exit status is 1.

Every server gets ``LD_PRELOAD`` of the vLLM environment's Intel OpenMP (``lib/libiomp5.so``) unless ``--no-iomp``:
vLLM's CPU worker warns that speculative decoding without it "will cause significant performance loss"
(``vllm/v1/worker/cpu_worker.py``); measured here, n-gram at 1 request 1.2 tok/s without it, 7.1 with it. The
service's vLLM server does not preload it (yet), so ``--no-iomp`` measures what the service serves.

    .venv/bin/python bench/speculator.py [--head DIR ...] [--methods none,ngram,eagle3] [--concurrency 1,8]
        [--prompts 24] [--max-tokens 64] [--quick]

``--head`` (repeatable: one eagle3 arm per head) defaults to ``<model_dir>/vlm/speculator-eagle3`` (where
``chimera speculator train`` writes); a head that is missing or not made for the LLM is skipped with a note. ``--quick`` (``make bench``): 8 prompts, 32 tokens each.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.tts_concurrency import pct  # noqa: E402

IOMP = "libiomp5.so"  # Intel OpenMP, in the vLLM environment's lib/ (vllm/v1/worker/cpu_worker.py asks for it)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def token_latencies(arrivals: list[tuple[float, int]], start: float) -> list[float]:
    """Inter-token latencies (s) of one streamed answer: ``arrivals`` are (time s, tokens in the chunk) in order,
    ``start`` the request's send time. The first chunk's first token is the time to first token, not an
    inter-token latency; every other token of a chunk of n tokens arriving g s after the previous chunk counts
    g / n (the first chunk's other tokens count 0: they came with it)."""
    out: list[float] = []
    prev = None
    for t, n in arrivals:
        if n <= 0:
            continue
        if prev is None:
            out += [0.0] * (n - 1)
        else:
            out += [(t - prev) / n] * n
        prev = t
    return out


def mal(summary: dict) -> str:
    """A summary's mean acceptance length to 2 places, ``-`` without drafts (no speculation)."""
    return "-" if not summary["drafts"] else f"{summary['mean_acceptance_length']:.2f}"


def spec_config(cfg, method: str, head: str | None, k: int, concurrency: int):
    """The profile's VLM engine config ``cfg`` with ``vllm.speculative`` for ``method`` (none | ngram | eagle3,
    ``head`` the EAGLE-3 folder, ``k`` tokens proposed) and room for ``concurrency`` sequences at once."""
    from core.config import DraftSpeculation, NgramSpeculation

    spec = {"none": None, "ngram": NgramSpeculation(**{**NGRAM, "num_speculative_tokens": k}),
            "eagle3": DraftSpeculation(method="eagle3", model=head, num_speculative_tokens=k) if head else None}
    return cfg.model_copy(update={"max_batch_size": max(cfg.max_batch_size, concurrency),
                                  "vllm": cfg.vllm.model_copy(update={"speculative": spec[method]})})


async def run_level(client, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    """Stream every prompt greedily, ``concurrency`` at a time. Returns ``answers`` (token ids per prompt),
    ``tokens``, ``seconds`` (wall), ``itl`` (:func:`token_latencies` of all answers)."""
    from core.llm_client import CompletionRequest

    sem = asyncio.Semaphore(concurrency)
    answers: list[list[int]] = [[] for _ in prompts]
    itl: list[float] = []

    async def one(i: int) -> None:
        async with sem:
            t0, arrivals = time.perf_counter(), []
            async for chunk in client.stream(CompletionRequest(prompt=prompts[i], max_tokens=max_tokens,
                                                               temperature=0.0)):
                if chunk.token_ids:
                    arrivals.append((time.perf_counter(), len(chunk.token_ids)))
                    answers[i] += chunk.token_ids
            itl.extend(token_latencies(arrivals, t0))

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return {"answers": answers, "tokens": sum(map(len, answers)), "seconds": time.perf_counter() - t0, "itl": itl}


def measure(cfg, llm: str, prompts: list[list[int]], levels: list[int], max_tokens: int,
            log_to: Path | None = None) -> dict[int, dict]:
    """Start vLLM for ``cfg`` (serving ``llm``), warm it with one request, run each concurrency level (the
    acceptance counters read from ``/metrics`` before and after each), stop it (its log written to ``log_to``
    when given). Returns per level the :func:`run_level` result plus ``acceptance``
    (:func:`core.spec.acceptance.from_vllm_counters`, NaN without speculation). Raises RuntimeError when the
    server does not become ready (its log's tail)."""
    import httpx

    from core.spec.acceptance import counters_from_metrics, from_vllm_counters
    from core.vllm_client import VLLMClient
    from services.engines.process import ServerProcess
    from services.engines.vllm_server import server_spec

    client = VLLMClient(ServerProcess(server_spec(cfg, llm)).start())
    try:
        if not client.wait_ready(cfg.vllm.startup_timeout_s):
            raise RuntimeError(f"vLLM did not start: {client.server.log_tail()}")

        def counters():
            return counters_from_metrics(httpx.get(f"{client.base_url}/metrics", timeout=30).text)

        async def levels_run():
            await run_level(client, prompts[:1], 1, 4)  # warm-up
            out = {}
            for c in levels:
                d0, a0, p0 = counters()
                out[c] = await run_level(client, prompts, c, max_tokens)
                d1, a1, p1 = counters()
                out[c]["acceptance"] = from_vllm_counters(d1 - d0, a1 - a0, [b - a for a, b in zip(p0, p1)])
            await client.aclose()
            return out

        return asyncio.run(levels_run())
    finally:
        if log_to is not None:
            log_to.write_text(client.server.log_tail(1_000_000))
        client.close()


def parser() -> argparse.ArgumentParser:
    """This benchmark's command line (bench/gpu_quant.py validates bench/gpu_scale.sh's calls with it)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--head", action="append", default=None,
                    help="EAGLE-3 head folder, repeatable: one eagle3 arm each (default <model_dir>/vlm/speculator-eagle3)")
    ap.add_argument("--methods", default="none,ngram,eagle3")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=3, help="num_speculative_tokens (an EAGLE-3 head's own)")
    ap.add_argument("--quick", action="store_true", help="8 prompts, 32 tokens (make bench)")
    ap.add_argument("--logs", type=Path, default=None, help="a folder for each vLLM server's log")
    ap.add_argument("--no-iomp", action="store_true", help="start vLLM as the service does, without Intel OpenMP "
                                                           "in LD_PRELOAD")
    return ap


def main() -> int:
    """Run the arms, print the table and the greedy check; exit 1 when any answer differs from ``none``'s."""
    a = parser().parse_args()
    if a.quick:
        a.prompts, a.max_tokens = 8, 32
    from core.config import resolve_path
    from core.spec.record import SpeculatorError, verify_head
    from grafting.train.evaluate import TEXT_PROMPTS
    from services.config.profiles import load_profile
    from services.engines.vllm_server import vllm_python
    from video.sparse import cpu_description

    prof = load_profile(a.profile)
    cfg, model_dir = prof.vlm.engine, prof.resolved_model_dir()
    llm = resolve_path(model_dir, cfg.llm)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llm)  # the LLM's own chat template (the VLM's processor applies the same)
    prompts = []
    for text in (TEXT_PROMPTS * (a.prompts // len(TEXT_PROMPTS) + 1))[:a.prompts]:
        r = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompts.append(list(r["input_ids"] if hasattr(r, "keys") else r))
    levels = [int(c) for c in a.concurrency.split(",")]
    methods = a.methods.split(",")
    heads = a.head or [str(Path(model_dir) / "vlm" / "speculator-eagle3")]
    print(cpu_description())
    iomp = Path(vllm_python(cfg.vllm.python)).parent.parent / "lib" / IOMP
    if not a.no_iomp and iomp.exists():  # inherited by each server this process starts
        os.environ["LD_PRELOAD"] = " ".join(filter(None, [os.environ.get("LD_PRELOAD"), str(iomp)]))
        print(f"every arm: LD_PRELOAD={iomp} (vLLM: speculative decoding on CPU without Intel OpenMP preloaded "
              f"loses much; the service does not preload it; --no-iomp measures it as served)")
    else:
        print("every arm: without Intel OpenMP preloaded, as the service starts vLLM")
    print(f"vLLM on {llm}: {len(prompts)} text prompts (token ids), greedy, {a.max_tokens} tokens at most, "
          f"{a.tokens} speculative tokens, OMP threads {cfg.vllm.cpu_threads}")
    arms = [(m, m, None) for m in methods if m != "eagle3"]  # (label, method, head)
    for head in heads if "eagle3" in methods else []:
        try:
            verify_head(head, llm)
            arms.append((f"eagle3 {Path(head).name}", "eagle3", head))
            print(f"eagle3 {Path(head).name}: {head}")
        except SpeculatorError as e:
            print(f"eagle3: skipped ({e}; chimera speculator train writes one)")
    results = {}
    for label, m, head in arms:
        t0 = time.perf_counter()
        log = a.logs / f"{label.replace(' ', '-')}.log" if a.logs else None
        if log:
            log.parent.mkdir(parents=True, exist_ok=True)
        results[label] = measure(spec_config(cfg, m, head, a.tokens, max(levels)), llm, prompts, levels,
                                 a.max_tokens, log)
        print(f"{label}: measured in {time.perf_counter() - t0:.0f} s (server start included)", flush=True)
    methods = [label for label, _, _ in arms]
    print("| method | concurrent | tokens | tok/s | ITL p50 ms | ITL p95 ms | mean acceptance length | tok/s vs none |")
    print("|---|---|---|---|---|---|---|---|")
    bad = 0
    for c in levels:
        base = results["none"][c] if "none" in results else None
        for m in methods:
            r = results[m][c]
            rate = r["tokens"] / r["seconds"]
            ratio = f"{rate / (base['tokens'] / base['seconds']):.2f}x" if base else "-"
            print(f"| {m} | {c} | {r['tokens']} | {rate:.1f} | {1000 * pct(r['itl'], 0.5):.1f} | "
                  f"{1000 * pct(r['itl'], 0.95):.1f} | {mal(r['acceptance'])} | {ratio} |")
    for c in levels:
        for m in methods:
            if m == "none" or "none" not in results:
                continue
            same = sum(x == y for x, y in zip(results[m][c]["answers"], results["none"][c]["answers"]))
            bad += len(prompts) - same
            print(f"greedy answers identical to none ({m}, {c} concurrent): {same}/{len(prompts)}")
    if bad:
        print(f"speculator.py: {bad} answers differ from none's", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
