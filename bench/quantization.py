"""Quantized vs full-precision VLM, side by side in one run (issue 26): float32 (the cpu profile as shipped), W8A8
int8 on every unit (``--select all``) and the greedy-selected set (``--select greedy --fraction 0.75``), each
served by ``chimera serve`` (a vlm-only copy of the profile, ``vlm.engine.vllm.quantized`` set), one at a time:

1. fidelity: held-out KLD mean and same-top-p % from each checkpoint's ``fidelity.json`` (``chimera quantize``);
2. decode throughput: completion tokens/s of 8 greedy text answers (64 tokens each, every answer runs to the cap)
   at 1 (sequential) and 8 concurrent clients, and the median time to first token of the sequential ones;
3. graft accuracy: generated-answer accuracy on held-out scene questions (``grafting.train.scenes`` test split,
   the image sent as a data URL through the openai SDK), scored by ``grafting.train.freeform.score_generated``;
4. memory: resident bytes of the whole service process tree once ready.

Missing checkpoints are made first (``chimera quantize``, minutes: ``--shortlist``/``--search-prompts`` bound the
greedy search). Ratios are against float32 in the same run.

    .venv/bin/python bench/quantization.py [--profile cpu] [--questions 60] [--rebuild]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.vlm_serving import Service, bench_profile, text_msgs  # noqa: E402

PROMPTS = ["Write a long story about a lighthouse keeper.", "Explain how a steam engine works, in detail.",
           "Describe a walk through a busy market.", "Write a letter to a friend about your holiday.",
           "Explain why the seasons change.", "Tell the history of bread.", "Describe the ocean at night.",
           "Write a speech about kindness."]
MAX_TOKENS = 64


def ensure_checkpoint(model_dir: Path, args_: list[str], name: str, rebuild: bool) -> Path:
    """The checkpoint ``<model_dir>/vlm/<name>``, made with ``chimera quantize <args_>`` when missing."""
    out = model_dir / "vlm" / name
    if rebuild or not (out / "fidelity.json").exists():
        cmd = [str(ROOT / ".venv/bin/chimera"), "quantize", *args_, "--out", str(out)]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT)
    return out


def scene_rows(n: int, tmp: Path) -> list[dict]:
    """``n`` held-out scene questions (rows of ``test.jsonl``, each with its image path resolved)."""
    from grafting.train.data import read_jsonl
    from grafting.train.scenes import write_dataset

    paths = write_dataset(tmp, n_train=0, n_test=max(1, n // 4) + 1, seed=7)
    return read_jsonl(paths["test"])[:n]


def image_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def measure(svc: Service, rows: list[dict]) -> dict:
    """Throughput at 1 and 8 clients, median TTFT, graft accuracy and memory of one ready service."""
    from grafting.train.freeform import score_generated

    def one(p):
        return svc.chat(text_msgs(p), max_tokens=MAX_TOKENS, temperature=0).usage.completion_tokens

    svc.chat(text_msgs("Hello"), max_tokens=4, temperature=0)  # warm-up
    out = {"rss_gib": svc.rss() / 2**30, "ttft_s": statistics.median(svc.ttft(text_msgs(p)) for p in PROMPTS[:4])}
    for clients in (1, 8):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            n = sum(pool.map(one, PROMPTS))
        out[f"tok_s_{clients}"] = n / (time.perf_counter() - t0)
    texts = []
    for row in rows:
        q = row["conversations"][0]["value"].replace("<image>", "").strip()
        msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(Path(row["_root"]) / row["image"])}},
                                             {"type": "text", "text": q}]}]
        texts.append(svc.chat(msgs, max_tokens=12, temperature=0).choices[0].message.content or "")
    scored = score_generated(rows, texts)
    acc, n = scored["accuracy"], scored["n"]
    out["graft_acc"] = sum(acc[k] * n[k] for k in acc) / max(1, sum(n.values()))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--questions", type=int, default=60, help="held-out scene questions for the graft accuracy")
    ap.add_argument("--fraction", type=float, default=0.75)
    ap.add_argument("--shortlist", type=int, default=4)
    ap.add_argument("--search-prompts", type=int, default=4)
    ap.add_argument("--rebuild", action="store_true", help="quantize again even where a checkpoint exists")
    a = ap.parse_args()

    from services.config.profiles import load_profile

    prof = load_profile(a.profile)
    model_dir = prof.resolved_model_dir()
    common = ["--profile", a.profile, "--scheme", "w8a8-int8", "--search-prompts", str(a.search_prompts)]
    cks = {"w8a8 all": ensure_checkpoint(model_dir, common + ["--select", "all"], "llm-w8a8-int8-all", a.rebuild),
           f"w8a8 greedy {a.fraction:g}": ensure_checkpoint(
               model_dir, common + ["--select", "greedy", "--fraction", str(a.fraction), "--shortlist",
                                    str(a.shortlist)], f"llm-w8a8-int8-greedy-{a.fraction:g}", a.rebuild)}
    base = prof.model_dump(mode="json")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        rows = scene_rows(a.questions, Path(tmp))
        for label, ck in [("float32", None), *cks.items()]:
            p = bench_profile(base, "vllm")
            p["name"] = "bench-quant"
            p["vlm"]["engine"]["vllm"]["quantized"] = str(ck) if ck else None
            print(f"== {label}: serving", flush=True)
            with Service(p) as svc:
                results[label] = measure(svc, rows)
            if ck:
                rec = json.loads((ck / "fidelity.json").read_text())
                results[label].update(kld=rec["heldout"]["all"]["kld_mean"], same_top=rec["heldout"]["all"]["same_top_pct"],
                                      units=f"{len(rec['quantized_units'])}/{rec['units_total']}")
            else:
                results[label].update(kld=0.0, same_top=100.0, units="0/120")
            print(label, json.dumps(results[label]), flush=True)
    f = results["float32"]
    print("\n| model | units | held-out KLD | same top p % | tok/s @1 | x fp32 | tok/s @8 | x fp32 | TTFT s | "
          "graft acc % | RSS GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, r in results.items():
        print(f"| {label} | {r['units']} | {r['kld']:.4f} | {r['same_top']:.1f} | {r['tok_s_1']:.1f} | "
              f"{r['tok_s_1'] / f['tok_s_1']:.2f} | {r['tok_s_8']:.1f} | {r['tok_s_8'] / f['tok_s_8']:.2f} | "
              f"{r['ttft_s']:.3f} | {100 * r['graft_acc']:.1f} | {r['rss_gib']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
