"""The fidelity tables of ``chimera quantize report`` (Markdown), from a ``fidelity.json`` record.

:func:`comparison_table`: one row per selection method and fraction (the ``compare`` rows: KL against the
fraction of units quantized for each method, on the held-out sets); :func:`detail` the llama.cpp-style listing of
one report (``llama-perplexity --kl-divergence``'s statistics).
"""

from __future__ import annotations

from .kld import PERCENTILES


def _row(select: str, fraction: float, units: int, total: int, search_kl: float, heldout: dict,
         sets: list[str]) -> str:
    a = heldout["all"]
    per_set = " | ".join(f"{heldout[s]['kld_mean']:.5f} / {heldout[s]['same_top_pct']:.1f}" for s in sets)
    return (f"| {select} | {fraction:g} | {units}/{total} | {search_kl:.5f} | {a['kld_mean']:.5f} ± "
            f"{a['kld_se']:.5f} | {a['kld_percentiles']['p99']:.4f} | {a['kld_percentiles']['p100']:.3f} | "
            f"{a['same_top_pct']:.2f} ± {a['same_top_se_pct']:.2f} | {a['dp_rms_pct']:.2f} | "
            f"{a['ppl_ratio']:.4f} | {per_set} |")


def comparison_table(record: dict) -> str:
    """Markdown: every compared (method, fraction) row, else the checkpoint's own row. Columns: units quantized,
    the search KL, held-out mean KLD ± SE (nats), its 99th percentile and maximum, same top p % ± SE, RMS Δp
    (percentage points), PPL(Q)/PPL(base), and per held-out set ``mean KLD / same top %``."""
    sets = [s for s in record["heldout"] if s != "all"]
    head = ("| select | fraction | units | search KL | held-out KLD mean ± SE | KLD p99 | KLD max | same top p % | "
            "RMS Δp % | PPL ratio | " + " | ".join(f"{s}: KLD / same top %" for s in sets) + " |")
    rule = "|" + "---|" * (10 + len(sets))
    total = record["units_total"]
    rows = record.get("compare") or [{"select": record["select"], "fraction": record["fraction"],
                                      "units": len(record["quantized_units"]), "search_kl": record["search_kl"],
                                      "heldout": record["heldout"]}]
    return "\n".join([head, rule] + [_row(r["select"], r["fraction"], r["units"], total, r["search_kl"],
                                          r["heldout"], sets) for r in rows])


def detail(report: dict, title: str = "all held-out sets") -> str:
    """One report (:func:`core.quant.kld.summarize`) listed as llama.cpp prints it."""
    k, d = report["kld_percentiles"], report["dp_percentiles_pct"]
    names = {100.0: "Maximum", 0.0: "Minimum", 50.0: "Median"}
    lines = [f"### {title} ({report['n']} positions)",
             f"Mean PPL(Q)/PPL(base): {report['ppl_ratio']:.6f} (PPL(Q) {report['ppl_q']:.4f}, "
             f"PPL(base) {report['ppl_base']:.4f}); mean ln(PPL(Q)/PPL(base)): {report['ln_ppl_ratio_mean']:.6f} ± "
             f"{report['ln_ppl_ratio_se']:.6f}",
             f"Mean KLD: {report['kld_mean']:.6f} ± {report['kld_se']:.6f}"]
    lines += [f"{names.get(p, f'{p:g}%')} KLD: {k[f'p{p:g}']:.6f}" for p in PERCENTILES]
    lines += [f"Mean Δp: {report['dp_mean_pct']:.3f} ± {report['dp_se_pct']:.3f} %"]
    lines += [f"{names.get(p, f'{p:g}%')} Δp: {d[f'p{p:g}']:.3f} %" for p in PERCENTILES]
    lines += [f"RMS Δp: {report['dp_rms_pct']:.3f} %",
              f"Same top p: {report['same_top_pct']:.3f} ± {report['same_top_se_pct']:.3f} %"]
    return "\n".join(lines)
