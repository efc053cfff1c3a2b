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
greedy search). Ratios are against float32 in the same run. Each quantized model's graft accuracy is also
compared with the reference's question by question (:func:`grafting.train.freeform.paired_difference`: the paired
difference, its standard error and the discordant counts). ``--accuracy-only`` skips the speed and memory rows;
``--scheme fp8 --profile gpu`` makes the same comparison on CUDA (the reference is then the profile's bf16);
``--select all,greedy`` picks the quantized rows; ``--checkpoint-dir`` puts the checkpoints elsewhere than
``<model_dir>/vlm``.

    .venv/bin/python bench/quantization.py [--profile cpu] [--scheme w8a8-int8] [--questions 60] [--rebuild]
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


def ensure_checkpoint(ck_dir: Path, args_: list[str], name: str, rebuild: bool) -> Path:
    """The checkpoint ``<ck_dir>/<name>``, made with ``chimera quantize <args_>`` when missing."""
    out = ck_dir / name
    if rebuild or not (out / "fidelity.json").exists():
        cmd = [str(ROOT / ".venv/bin/chimera"), "quantize", *args_, "--out", str(out)]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT)
    return out


def scene_rows(n: int, tmp: Path) -> list[dict]:
    """``n`` held-out scene questions (rows of ``test.jsonl``, each with its image path resolved)."""
    from grafting.train.data import read_jsonl
    from grafting.train.scenes import SERVED_CANVAS, write_dataset

    paths = write_dataset(tmp, n_train=0, n_test=max(1, n // 4) + 1, seed=7, canvas=SERVED_CANVAS)
    return read_jsonl(paths["test"])[:n]


def image_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def gpu_used_gib() -> float | None:
    """GPU memory in use on all devices (``nvidia-smi``, GiB), or None without one."""
    try:
        text = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(float(x) for x in text.split()) / 1024  # MiB


def measure(svc: Service, rows: list[dict], speed: bool = True) -> dict:
    """Throughput at 1 and 8 clients, median TTFT, memory (``speed``) and graft accuracy (with ``correct``, one
    bool per row) of one ready service."""
    from grafting.train.freeform import score_generated

    def one(p):
        return svc.chat(text_msgs(p), max_tokens=MAX_TOKENS, temperature=0).usage.completion_tokens

    svc.chat(text_msgs("Hello"), max_tokens=4, temperature=0)  # warm-up
    out = {}
    if speed:
        out = {"rss_gib": svc.rss() / 2**30, "gpu_gib": gpu_used_gib(),
               "ttft_s": statistics.median(svc.ttft(text_msgs(p)) for p in PROMPTS[:4])}
        for clients in (1, 8):
            t0 = time.perf_counter()
            with ThreadPoolExecutor(clients) as pool:
                n = sum(pool.map(one, PROMPTS))
            out[f"tok_s_{clients}"] = n / (time.perf_counter() - t0)

    def answer(row):
        q = row["conversations"][0]["value"].replace("<image>", "").strip()
        msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(Path(row["_root"]) / row["image"])}},
                                             {"type": "text", "text": q}]}]
        return svc.chat(msgs, max_tokens=12, temperature=0).choices[0].message.content or ""

    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:  # greedy answers: the order of arrival does not change them
        texts = list(pool.map(answer, rows))
    out["answer_s"] = time.perf_counter() - t0
    scored = score_generated(rows, texts)
    out["correct"] = scored["correct"]
    out["graft_acc"] = sum(out["correct"]) / max(1, len(rows))
    return out


def parser() -> argparse.ArgumentParser:
    """This benchmark's command line (bench/gpu_quant.py validates bench/gpu_scale.sh's calls with it)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--questions", type=int, default=60, help="held-out scene questions for the graft accuracy")
    ap.add_argument("--fraction", type=float, default=0.75)
    ap.add_argument("--shortlist", type=int, default=4)
    ap.add_argument("--search-prompts", type=int, default=4)
    ap.add_argument("--rebuild", action="store_true", help="quantize again even where a checkpoint exists")
    ap.add_argument("--scheme", default="w8a8-int8", help="chimera quantize --scheme (fp8: CUDA only)")
    ap.add_argument("--select", default="all,greedy", help="comma list of the quantized rows: all, greedy")
    ap.add_argument("--checkpoint-dir", type=Path, default=None, help="where the checkpoints are (default "
                                                                      "<model_dir>/vlm)")
    ap.add_argument("--accuracy-only", action="store_true", help="graft accuracy only (no speed or memory rows)")
    ap.add_argument("--answers-dir", type=Path, default=None,
                    help="with --accuracy-only: keep each model's per-question correctness here (<label>.json) and "
                         "reuse it for the same questions instead of serving that model again (a run with "
                         "--select none measures the reference alone)")
    return ap


def check_args(a: argparse.Namespace) -> list[str]:
    """The quantized rows ``--select`` names (``none``: the reference alone). Raises ValueError when it names no
    row or another method, or for ``--answers-dir`` without ``--accuracy-only``."""
    selects = [x.strip() for x in a.select.split(",") if x.strip()]
    if selects == ["none"]:
        selects = []
    elif not selects or any(x not in ("all", "greedy") for x in selects):
        raise ValueError(f"--select {a.select!r}: none, or a comma list of all, greedy")
    if a.answers_dir is not None and not a.accuracy_only:
        raise ValueError("--answers-dir keeps graft answers only: it needs --accuracy-only")
    return selects


def main() -> int:
    ap = parser()
    a = ap.parse_args()
    try:
        selects = check_args(a)
    except ValueError as e:
        ap.error(str(e))

    from grafting.train.freeform import paired_difference
    from services.config.profiles import load_profile

    prof = load_profile(a.profile)
    model_dir = prof.resolved_model_dir()
    ck_dir = a.checkpoint_dir or model_dir / "vlm"
    common = ["--profile", a.profile, "--scheme", a.scheme, "--search-prompts", str(a.search_prompts)]
    cks = {}
    if "all" in selects:
        cks[f"{a.scheme} all"] = ensure_checkpoint(ck_dir, common + ["--select", "all"], f"llm-{a.scheme}-all",
                                                   a.rebuild)
    if "greedy" in selects:
        cks[f"{a.scheme} greedy {a.fraction:g}"] = ensure_checkpoint(
            ck_dir, common + ["--select", "greedy", "--fraction", str(a.fraction), "--shortlist", str(a.shortlist)],
            f"llm-{a.scheme}-greedy-{a.fraction:g}", a.rebuild)
    base = prof.model_dump(mode="json")
    ref = base["vlm"]["engine"]["vllm"].get("dtype") or "float32"
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        rows = scene_rows(a.questions, Path(tmp))
        for label, ck in [(ref, None), *cks.items()]:
            p = bench_profile(base, "vllm")
            p["name"] = "bench-quant"
            p["vlm"]["engine"]["vllm"]["quantized"] = str(ck) if ck else None
            kept = a.answers_dir / f"{label.replace(' ', '_')}.json" if a.answers_dir else None
            ids = [r["id"] for r in rows]
            if kept and kept.exists() and json.loads(kept.read_text())["ids"] == ids:
                print(f"== {label}: answers of {kept}", flush=True)
                results[label] = json.loads(kept.read_text())["result"]
            else:
                print(f"== {label}: serving", flush=True)
                with Service(p) as svc:
                    results[label] = measure(svc, rows, speed=not a.accuracy_only)
                if kept:
                    kept.parent.mkdir(parents=True, exist_ok=True)
                    kept.write_text(json.dumps({"ids": ids, "result": results[label]}))
            if ck:
                rec = json.loads((ck / "fidelity.json").read_text())
                results[label].update(kld=rec["heldout"]["all"]["kld_mean"], same_top=rec["heldout"]["all"]["same_top_pct"],
                                      units=f"{len(rec['quantized_units'])}/{rec['units_total']}")
            else:
                results[label].update(kld=0.0, same_top=100.0, units="0")
            print(label, json.dumps({k: v for k, v in results[label].items() if k != "correct"}), flush=True)
    f = results[ref]
    if not a.accuracy_only:
        print(f"\n| model | units | held-out KLD | same top p % | tok/s @1 | x {ref} | tok/s @8 | x {ref} | TTFT s | "
              "graft acc % | RSS GiB | GPU GiB |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for label, r in results.items():
            print(f"| {label} | {r['units']} | {r['kld']:.4f} | {r['same_top']:.1f} | {r['tok_s_1']:.1f} | "
                  f"{r['tok_s_1'] / f['tok_s_1']:.2f} | {r['tok_s_8']:.1f} | {r['tok_s_8'] / f['tok_s_8']:.2f} | "
                  f"{r['ttft_s']:.3f} | {100 * r['graft_acc']:.1f} | {r['rss_gib']:.2f} | "
                  f"{'-' if r['gpu_gib'] is None else format(r['gpu_gib'], '.1f')} |")
    print(f"\nGraft accuracy, paired against {ref} on the same {len(rows)} held-out scene questions:\n")
    print(f"| model | {ref} acc % | quantized acc % | difference (points) ± SE | right by {ref} only | "
          "right by quantized only | McNemar p |")
    print("|---|---|---|---|---|---|---|")
    for label, r in results.items():
        if label == ref:
            continue
        d = paired_difference(f["correct"], r["correct"])
        print(f"| {label} | {100 * d['acc_base']:.1f} | {100 * d['acc_other']:.1f} | {d['diff_points']:+.1f} ± "
              f"{d['se_points']:.1f} | {d['base_only']} | {d['other_only']} | {d['p_mcnemar']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
