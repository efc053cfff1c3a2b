"""VLM serving through the running service: the ``transformers`` backend (the in-project baseline) vs ``vllm``.

Everything goes over HTTP to ``chimera serve`` (the openai SDK is the client), one service at a time, in one run:

1. repeated-image time to first token: one new photo asked about 5 times; first vs the mean of the next four
   (target >= 5x lower with vllm: the image cache skips tower + projector, vLLM's prefix cache the prefill);
2. throughput (completion tokens/s) of 8 text requests at 1 (= sequential), 4 and 8 concurrent clients
   (target: vllm at 8 >= 4x the transformers backend's sequential);
3. ``response_format`` (``json_schema``, strict) on 50 requests: the share that parses and matches the schema
   (target 100%; the transformers backend refuses JSON modes with a 400, reported as such);
4. n-gram speculative decoding on vs off (vllm; the profile's ``vlm.engine.vllm.speculative``): tokens/s of a
   copy-the-passage answer, where n-gram lookup proposes well, and of a free answer alternated with it (its
   rate tracks the machine's load, so copy/free compares the two services fairly), and whether the greedy
   answers are equal;
5. HTTP overhead: median latency of the same image question over HTTP vs the same engine in this process
   (alternated request by request, so both see the same load);
6. 2-replica routing: 6 photos asked 4 times each on a 2-replica deployment (transformers backend: the router is
   the same for both and one replica costs far less), image-cache hit rate of the repeats from ``/metrics``.

Each service runs a vlm-only copy of the profile (video and tts left out) with ``max_batch_size`` and
``max_ongoing_requests`` 8 for both backends, so 8 clients are decoded together in each. Absolute times on a
shared 2-core machine are noisy; the ratios measured side by side are the point.

    .venv/bin/python bench/vlm_serving.py [--profile cpu] [--quick] [--only json|ttft]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # the replicas' torch_threads in the cpu profile

import httpx  # noqa: E402
import yaml  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.served import ServedChimera  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# A sensible request bounds what it asks for: with unbounded strings the small model ran on inside a string until
# max_tokens cut it (12 of 50 at 200 tokens). Bounded, the longest answer the schema admits is about 40 + 5 * 20
# characters of content plus ~40 of structure, i.e. at most ~210 tokens (a token is at least one character), so
# JSON_MAX_TOKENS = 300 lets every answer finish (xgrammar enforces minLength/maxLength and minItems/maxItems).
JSON_MAX_TOKENS = 300
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "colours": {"type": "array", "minItems": 1, "maxItems": 5,
                                     "items": {"type": "string", "minLength": 1, "maxLength": 20}}},
          "required": ["name", "age", "colours"], "additionalProperties": False}
PASSAGE = ("The quick brown fox jumps over the lazy dog. The lazy dog sleeps in the warm sun. The warm sun shines "
           "on the green hills. The green hills roll down to the blue sea.")
# A ~670-token document asked about with the image: long enough that prefill, not the fixed per-request cost,
# dominates the first answer's time to first token (the case prefix caching is for).
FACTS = " ".join(f"Fact {i}: the {c} box on shelf {i % 7} holds {i * 3 % 11} {o}." for i, (c, o) in enumerate(
    [(c, o) for c in ("red", "green", "blue", "yellow", "black") for o in ("apples", "pens", "stones", "cards")] * 2))
TEXT_PROMPTS = ["What is the capital of France?", "Name three colours.", "Write a haiku about rain.",
                "How do plants grow?", "Explain what a computer is.", "Describe a cat.",
                "Why is the sky blue?", "Give me a tip for cooking rice."]


def photo_url(index: int) -> str:
    """A distinct real photograph per index (skimage samples, cropped and flipped), as a PNG data URL."""
    from PIL import Image, ImageOps
    from skimage import data

    srcs = [data.astronaut(), data.coffee(), data.chelsea(), data.rocket()]
    img = Image.fromarray(srcs[index % len(srcs)])
    k = index // len(srcs)
    w, h = img.size
    img = img.crop((k * 7 % (w // 4), k * 5 % (h // 4), w - k * 3 % (w // 4), h - k * 11 % (h // 4)))
    if k % 2:
        img = ImageOps.mirror(img)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_msgs(url: str, text: str = "What is in this picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def text_msgs(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def bench_profile(base: dict, backend: str, replicas: int = 1, spec: bool = False) -> dict:
    """A vlm-only copy of the profile dict for one service of this benchmark."""
    prof = json.loads(json.dumps(base))
    prof.pop("video", None)
    prof.pop("tts", None)
    prof["name"] = f"bench-{backend}{'-spec' if spec else ''}{'-x2' if replicas > 1 else ''}"
    prof["model_dir"] = str((ROOT / prof.get("model_dir", ".chimera/models/cpu")).resolve())
    vlm = prof["vlm"]
    vlm["deployment"] = dict(vlm.get("deployment", {}), num_replicas=replicas, max_ongoing_requests=8)
    eng = vlm["engine"]
    eng.update(backend=backend, max_batch_size=8)
    eng["vllm"] = dict(eng.get("vllm", {}), speculative=NGRAM if spec else None)  # off unless measuring it
    return prof


class Service(ServedChimera):
    """``chimera serve`` with a bench profile dict (bench/served.py), plus the VLM client calls measured here."""

    def __init__(self, profile: dict, timeout_s: float = 900):
        super().__init__(profile, ready_ceiling_s=timeout_s)
        import openai

        self.client = openai.OpenAI(base_url=f"{self.base}/v1", api_key="unused", max_retries=0, timeout=900)
        self.model = profile["vlm"]["model_id"]

    def chat(self, messages, **kw):
        """One non-streamed chat completion."""
        return self.client.chat.completions.create(model=self.model, messages=messages, **kw)

    def ttft(self, messages, max_tokens: int = 8) -> float:
        """Seconds to the first content chunk of a streamed, greedy answer."""
        t0 = time.perf_counter()
        first = None
        for ch in self.client.chat.completions.create(model=self.model, messages=messages, max_tokens=max_tokens,
                                                      temperature=0, stream=True):
            if first is None and ch.choices and ch.choices[0].delta.content:
                first = time.perf_counter() - t0
        return first if first is not None else time.perf_counter() - t0

    def metrics(self) -> str:
        return httpx.get(f"{self.base}/metrics", timeout=30).text


def metric_sum(text: str, name: str) -> float:
    """Sum of a Prometheus metric's samples over all label sets."""
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


def throughput(svc: Service, clients: int, max_tokens: int) -> tuple[float, int]:
    """(completion tokens/s, tokens) of the 8 text prompts answered by ``clients`` concurrent clients."""
    def one(p):
        return svc.chat(text_msgs(p), max_tokens=max_tokens, temperature=0).usage.completion_tokens

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        n = sum(pool.map(one, TEXT_PROMPTS))
    return n / (time.perf_counter() - t0), n


def json_rate(svc: Service, n: int) -> str:
    """Share of ``n`` json_schema (strict) answers that parse and match the schema, and how many finished with
    ``finish_reason`` "stop" (the rest were cut by ``max_tokens``), or why none was made."""
    import jsonschema
    import openai

    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}

    def one(i):
        r = svc.chat(text_msgs(f"Invent a person number {i} with a name, an age and favourite colours, as JSON."),
                     max_tokens=JSON_MAX_TOKENS, temperature=0.7, seed=i, response_format=rf)
        try:
            jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
            return True, r.choices[0].finish_reason
        except (ValueError, jsonschema.ValidationError):
            return False, r.choices[0].finish_reason

    try:
        with ThreadPoolExecutor(8) as pool:
            outcomes = list(pool.map(one, range(n)))
    except openai.BadRequestError as err:
        return f"refused (400 {err.code})"
    ok = sum(valid for valid, _ in outcomes)
    stop = sum(reason == "stop" for _, reason in outcomes)
    return f"{ok}/{n} = {100 * ok / n:.0f}% valid; {stop}/{n} finished with stop (max_tokens {JSON_MAX_TOKENS})"


def spec_run(svc: Service, rounds: int) -> tuple[float, float, str]:
    """(median tokens/s of a greedy copy-the-passage answer, median tokens/s of a free answer, the copy answer),
    the two alternated. n-gram lookup proposes nothing on the free answer, so its rate tracks the machine's load
    and copy / free compares services measured at different times."""
    copy = text_msgs(f"Repeat this text exactly, twice:\n{PASSAGE}")
    free = text_msgs("Write a short story about a lighthouse keeper.")
    svc.chat(copy, max_tokens=8, temperature=0)
    rates: dict[str, list[float]] = {"copy": [], "free": []}
    text = ""
    for _ in range(rounds):
        for name, msgs in (("copy", copy), ("free", free)):
            t0 = time.perf_counter()
            r = svc.chat(msgs, max_tokens=96, temperature=0)
            rates[name].append(r.usage.completion_tokens / (time.perf_counter() - t0))
            if name == "copy":
                text = r.choices[0].message.content
    return statistics.median(rates["copy"]), statistics.median(rates["free"]), text


def http_vs_in_process(svc: Service, profile: dict, rounds: int, max_tokens: int) -> tuple[list, list]:
    """Latencies (s) of the same greedy image question over HTTP and on a VLMEngine in this process (for vllm
    with its own vLLM server), alternated round by round so both see the same machine load."""
    import torch

    from grafting.engine import VLMEngine
    from services.config.profiles import parse_profile
    from services.engines.vllm_server import start_vllm_for

    prof = parse_profile(profile)
    torch.set_num_threads(prof.vlm.deployment.torch_threads or torch.get_num_threads())
    cfg, model_dir = prof.vlm.engine, prof.resolved_model_dir()
    client = start_vllm_for(cfg, model_dir) if cfg.backend == "vllm" else None
    try:
        eng = VLMEngine.from_config(cfg, model_dir, backend=cfg.backend, llm_client=client)
    except BaseException:
        if client is not None:
            client.close()
        raise
    msgs = image_msgs(photo_url(0))
    try:
        if not eng.wait_ready(900):
            raise SystemExit("the in-process vllm engine did not become ready")
        eng.complete(msgs, max_tokens=max_tokens, temperature=0)  # warm-up (and the image cached), both paths
        svc.chat(msgs, max_tokens=max_tokens, temperature=0)
        http, local = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            n1 = eng.complete(msgs, max_tokens=max_tokens, temperature=0).completion_tokens
            local.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            n2 = svc.chat(msgs, max_tokens=max_tokens, temperature=0).usage.completion_tokens
            http.append(time.perf_counter() - t0)
            if n1 != n2:
                raise SystemExit(f"in-process and HTTP answers differ in length ({n1} vs {n2})")
        return http, local
    finally:
        eng.close()
        if client is not None:  # stops the in-process vLLM server
            client.close()


def routing(base: dict, images: int, rounds: int) -> dict:
    svc = Service(bench_profile(base, "transformers", replicas=2))
    try:
        m0 = svc.metrics()
        with ThreadPoolExecutor(images) as pool:  # each round: every photo at once, so load spreads them
            for _ in range(rounds):
                list(pool.map(lambda i: svc.chat(image_msgs(photo_url(100 + i)), max_tokens=4, temperature=0),
                              range(images)))
        m1 = svc.metrics()
        hits = metric_sum(m1, "chimera_vlm_image_cache_hits_total") - metric_sum(m0, "chimera_vlm_image_cache_hits_total")
        misses = (metric_sum(m1, "chimera_vlm_image_cache_misses_total")
                  - metric_sum(m0, "chimera_vlm_image_cache_misses_total"))
        replicas = len(set(re.findall(r'chimera_vlm_image_cache_entries{[^}]*replica="([^"]+)"', m1)))
        return {"hits": hits, "misses": misses, "repeats": images * (rounds - 1), "replicas_used": replicas,
                "startup_s": svc.startup_s}
    finally:
        svc.stop()


def measure_backend(base: dict, backend: str, a) -> dict:
    """Items 1, 2, 3 and 5 (HTTP part) on one service of ``backend``."""
    prof = bench_profile(base, backend)
    svc = Service(prof)
    res = {"startup_s": svc.startup_s}
    try:
        svc.chat(text_msgs("Hello"), max_tokens=4, temperature=0)  # warm-up
        url = photo_url(7 if backend == "vllm" else 6)  # an image this service has never seen
        msgs = image_msgs(url, f"{FACTS}\nWhat is in this picture?")
        res["ttft_prompt_tokens"] = svc.chat(text_msgs(FACTS), max_tokens=1, temperature=0).usage.prompt_tokens
        t = [svc.ttft(msgs) for _ in range(5)]
        res["ttft"] = (t[0], statistics.mean(t[1:]))
        res["tput"] = {c: throughput(svc, c, a.max_tokens) for c in (1, 4, 8)}
        res["json"] = json_rate(svc, a.json_requests)
        if backend == "vllm":
            res["spec_off"] = spec_run(svc, a.rounds)
        res["rss_gib"] = svc.rss() / 2 ** 30
        res["http"], res["inproc"] = http_vs_in_process(svc, prof, a.rounds + 2, 16)
    finally:
        svc.stop()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--json-requests", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    ap.add_argument("--only", choices=["json", "ttft"],
                    help="json: only item 3; ttft: only item 1, with 3 new photos in a row (its spread); both on the "
                         "vllm backend's service")
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.max_tokens, a.json_requests = 1, 16, 8
    from services.config.profiles import load_profile, profile_path

    load_profile(a.profile)  # validates
    base = yaml.safe_load(profile_path(a.profile).read_text())
    if a.only == "json":
        svc = Service(bench_profile(base, "vllm"))
        try:
            svc.chat(text_msgs("Hello"), max_tokens=4, temperature=0)  # warm-up
            print(f"response_format json_schema (vllm, {a.json_requests} req): {json_rate(svc, a.json_requests)}")
        finally:
            svc.stop()
        return
    if a.only == "ttft":
        svc = Service(bench_profile(base, "vllm"))
        try:
            svc.chat(text_msgs("Hello"), max_tokens=4, temperature=0)  # warm-up
            for k in (11, 12, 13):  # photos no earlier run of this service has seen
                t = [svc.ttft(image_msgs(photo_url(k), f"{FACTS}\nWhat is in this picture?")) for _ in range(5)]
                print(f"TTFT repeated image (vllm), photo {k}: first {t[0]:.3f} s, mean of next 4 "
                      f"{statistics.mean(t[1:]):.3f} s = {t[0] / statistics.mean(t[1:]):.1f}x (target >= 5x)")
        finally:
            svc.stop()
        return
    t_all = time.time()
    tr = measure_backend(base, "transformers", a)
    vl = measure_backend(base, "vllm", a)
    svc = Service(bench_profile(base, "vllm", spec=True))
    try:
        vl["spec_on"] = spec_run(svc, a.rounds)
    finally:
        svc.stop()
    rt = routing(base, images=6, rounds=4)

    def f(x, unit="s"):
        return f"{x:.3f} {unit}" if unit == "s" else f"{x:.1f} {unit}"

    print(f"VLM serving through the service ({a.profile} profile, vlm only, batch 8), {time.time() - t_all:.0f} s")
    print(f"{'':44s}{'transformers':>22s}{'vllm':>22s}")
    print(f"{'service start-up (to /readyz 200)':44s}{f(tr['startup_s']):>22s}{f(vl['startup_s']):>22s}")
    print(f"(TTFT prompt: a new photo, 64 image tokens, + a {tr['ttft_prompt_tokens']}-token text document)")
    for name, key in (("TTFT repeated image: first", 0), ("TTFT repeated image: mean of next 4", 1)):
        print(f"{name:44s}{f(tr['ttft'][key]):>22s}{f(vl['ttft'][key]):>22s}")
    print(f"{'  first / next (target >= 5x with vllm)':44s}{tr['ttft'][0] / tr['ttft'][1]:>21.1f}x"
          f"{vl['ttft'][0] / vl['ttft'][1]:>21.1f}x")
    seq = tr["tput"][1][0]
    for c in (1, 4, 8):
        label = f"throughput, {c} client{'s' if c > 1 else ''}{' (sequential)' if c == 1 else ''}"
        print(f"{label:44s}{f(tr['tput'][c][0], 'tok/s'):>22s}{f(vl['tput'][c][0], 'tok/s'):>22s}")
    print(f"{'  8 clients / transformers sequential':44s}{tr['tput'][8][0] / seq:>21.1f}x"
          f"{vl['tput'][8][0] / seq:>21.1f}x   (target >= 4x with vllm)")
    print(f"{'  8 clients / own sequential':44s}{tr['tput'][8][0] / seq:>21.1f}x"
          f"{vl['tput'][8][0] / vl['tput'][1][0]:>21.1f}x")
    print(f"{f'response_format json_schema valid ({a.json_requests} req)':44s}{tr['json']:>22s}  {vl['json']}")
    h_tr, h_vl = statistics.median(tr["http"]), statistics.median(vl["http"])
    i_tr, i_vl = statistics.median(tr["inproc"]), statistics.median(vl["inproc"])
    print(f"{'image QA (16 tokens) over HTTP, median':44s}{f(h_tr):>22s}{f(h_vl):>22s}")
    print(f"{'same request in-process engine, median':44s}{f(i_tr):>22s}{f(i_vl):>22s}")
    print(f"{'  HTTP overhead (HTTP - in-process)':44s}{f(h_tr - i_tr):>22s}{f(h_vl - i_vl):>22s}")
    print(f"{'service resident memory (process tree)':44s}{f(tr['rss_gib'], 'GiB'):>22s}{f(vl['rss_gib'], 'GiB'):>22s}")
    (on, on_free, on_text), (off, off_free, off_text) = vl["spec_on"], vl["spec_off"]
    print(f"speculative decoding (vllm, n-gram k=4), copy-the-passage answer: off {off:.1f} tok/s, on {on:.1f} "
          f"tok/s = {on / off:.2f}x; free answer (no n-gram match): off {off_free:.1f}, on {on_free:.1f} tok/s; "
          f"load-normalised (copy/free on vs off): {(on / on_free) / (off / off_free):.2f}x; "
          f"greedy copy answers equal: {on_text == off_text}")
    rep = rt["repeats"]
    print(f"2-replica routing (transformers backend, 6 photos at once x 4 rounds): image-cache hits {rt['hits']:.0f} of {rep} "
          f"repeats = {100 * rt['hits'] / rep:.0f}% (misses {rt['misses']:.0f}, first sights 6), "
          f"{rt['replicas_used']} replicas used")


if __name__ == "__main__":
    main()
