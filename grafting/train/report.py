"""Collecting the caption-vs-QA experiment into one small JSON and a Markdown table (README, notebook)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

TYPES = ("colour", "shape", "count", "size", "position")


def collect(runs: dict[str, dict], out: str | Path | None = None) -> dict:
    """``runs``: ``{name: {"label": str, "eval": eval.json path, "log": log.csv path}}`` -> one dict with each
    run's evaluation (accuracies only) and loss curve (step, stage, loss, seconds); written to ``out`` if given."""
    res = {}
    for name, r in runs.items():
        ev = json.loads(Path(r["eval"]).read_text())
        rows = list(csv.DictReader(open(r["log"])))
        res[name] = {"label": r["label"], "eval": ev,
                     "curve": {"step": [int(x["step"]) for x in rows], "stage": [x["stage"] for x in rows],
                               "loss": [float(x["loss"]) for x in rows]},
                     "seconds_per_step": sum(float(x["seconds"]) for x in rows) / max(1, len(rows)),
                     "labelled_tokens": sum(int(x["tokens"]) for x in rows)}
    if out:
        Path(out).write_text(json.dumps(res, indent=1))
    return res


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def markdown_table(results: dict) -> str:
    """Held-out accuracy per question type for each run and condition, plus chance, as Markdown."""
    head = "| run | condition | " + " | ".join(TYPES) + " | all | unseen pairs |"
    lines = [head, "|" + "---|" * (len(TYPES) + 4)]
    chance = None
    for name, r in results.items():
        ev = r["eval"]
        chance = chance or ev.get("chance")
        for cond in ("image", "shuffled", "blind"):
            if cond not in ev:
                continue
            c = ev[cond]
            lines.append(f"| {r['label']} | {cond} | " + " | ".join(_pct(c["by_type"].get(t)) for t in TYPES)
                         + f" | {_pct(c['accuracy'])} | {_pct(c.get('held_out'))} |")
    if chance:
        lines.append("| chance | - | " + " | ".join(_pct(chance.get(t)) for t in TYPES) + " | | |")
    return "\n".join(lines)


VARIED_TYPES = ("colour", "shape", "count", "yesno", "multi", "size", "position")


def varied_table(ev: dict) -> str:
    """One ``chimera graft eval --generate`` result (held-out phrasings x held-out renderings) as Markdown:
    per question type the multiple-choice accuracy with the image, shuffled and blind, the generated-answer
    accuracy, chance and n; then the one-word format check."""
    types = [t for t in VARIED_TYPES if t in ev.get("chance", {})]
    lines = ["| | " + " | ".join(types) + " |", "|" + "---|" * (len(types) + 1)]
    for cond, label in (("image", "multiple choice, image"), ("shuffled", "multiple choice, shuffled image"),
                        ("blind", "multiple choice, blind")):
        if cond in ev:
            lines.append(f"| {label} | " + " | ".join(_pct1(ev[cond]["by_type"].get(t)) for t in types) + " |")
    gen = ev.get("generated")
    if gen:
        lines.append("| generated (greedy), image | " + " | ".join(_pct1(gen["accuracy"].get(t)) for t in types) + " |")
    lines.append("| chance | " + " | ".join(_pct1(ev["chance"][t]) for t in types) + " |")
    n = ev.get("image", ev.get("blind", {})).get("by_type_n", {})
    lines.append("| n | " + " | ".join(str(n.get(t, "-")) for t in types) + " |")
    if gen:
        lines.append("")
        lines.append(f"One-word instruction obeyed (generated text is one word): {_pct1(gen['format_obeyed'])} "
                     f"of {gen['format_n']}.")
    return "\n".join(lines)


def _pct1(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def smoothed(losses: list[float], window: int = 25) -> list[float]:
    """Trailing moving average of a loss curve (the first values average what exists so far)."""
    return [sum(losses[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(losses))]


def plateau_step(losses: list[float], window: int = 25, tol: float = 0.05) -> int | None:
    """The first step (1-based) from which the smoothed curve (:func:`smoothed`) never falls more than ``tol``
    (relative) below its value there, i.e. where the curve has flattened; None when even the last ``window``
    steps still fall by more than that (not flat yet) or the curve is shorter than ``2 * window``."""
    s = smoothed(losses, window)
    if len(s) < 2 * window:
        return None
    tail_min = s[-1]
    suffix_min = [0.0] * len(s)
    for i in range(len(s) - 1, -1, -1):
        tail_min = min(tail_min, s[i])
        suffix_min[i] = tail_min
    for i, v in enumerate(s):
        if v - suffix_min[i] <= tol * v:
            return i + 1 if i + 1 <= len(s) - window else None
    return None


def collect_varied(arms: dict[str, dict], shipped_eval: str | Path, tower_metrics: dict[str, str | Path],
                   out: str | Path | None = None, window: int = 25, tol: float = 0.05) -> dict:
    """The issue-15 results in one dict (README, notebook): ``arms`` as for :func:`collect` plus each arm's
    ``plateau_step`` (:func:`plateau_step` of its loss curve), the shipped graft's ``eval --generate`` JSON on
    the held-out scenes, and the tower probe accuracies (``{label: pretrain_metrics.json}``); written to
    ``out`` if given."""
    runs = collect(arms)
    for r in runs.values():
        r["plateau_step"] = plateau_step(r["curve"]["loss"], window, tol)
    res = {"arms": runs, "plateau": {"window": window, "tol": tol},
           "shipped": json.loads(Path(shipped_eval).read_text()),
           "tower_probe": {k: json.loads(Path(p).read_text())["test_probe_accuracy"] for k, p in tower_metrics.items()}}
    if out:
        Path(out).write_text(json.dumps(res, indent=1))
    return res
