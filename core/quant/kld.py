"""The KL-divergence statistics of llama.cpp's ``llama-perplexity --kl-divergence`` (ggml-org/llama.cpp,
``tools/perplexity/perplexity.cpp``), which quantization users know, for a quantized model Q against its
full-precision base.

Per scored position ``i`` with base distribution ``P_i`` and quantized ``Q_i`` (full vocabulary, float64) and the
text's next token ``t_i``:

- ``KLD_i = sum_v P_i(v) (ln P_i(v) - ln Q_i(v))`` (nats);
- same top p: ``argmax P_i == argmax Q_i``;
- ``Δp_i = Q_i(t_i) - P_i(t_i)`` (the change of the text token's probability);
- ``ln P_i(t_i)`` and ``ln Q_i(t_i)`` for the perplexities ``PPL = exp(-mean ln p(t_i))``.

:func:`position_stats` computes them for a chunk of positions; :func:`summarize` turns the concatenated chunks into
the report: mean KLD ± its standard error, the KLD percentiles (max, 99.9, 99, 95, 90, median, 10, 5, 1, 0.1,
min), same-top-p % ± its binomial standard error, Δp (mean ± SE, the same percentiles, RMS; in percentage points)
and PPL(Q), PPL(base) with their ratio and ``mean ln(PPL(Q)/PPL(base))`` ± SE. Percentiles interpolate linearly
between order statistics (numpy's default), standard errors are ``sample std / sqrt(n)``.
"""

from __future__ import annotations

import math

import torch

PERCENTILES = (100.0, 99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0, 0.1, 0.0)
FIELDS = ("kld", "same_top", "dp", "logp_base", "logp_q")


def position_stats(base_logits: torch.Tensor, q_logits: torch.Tensor, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-position statistics of one chunk.

    Args: base_logits, q_logits ``(N, V)`` float (any float dtype; computed in float64); tokens ``(N,)`` long, the
        text's next token at each position.
    Returns: ``{"kld", "same_top", "dp", "logp_base", "logp_q"}``, each ``(N,)`` float64 (``same_top`` 0.0 or 1.0).
    Raises: ValueError on mismatched shapes.
    """
    if base_logits.shape != q_logits.shape or base_logits.ndim != 2 or tokens.shape != base_logits.shape[:1]:
        raise ValueError(f"logits {tuple(base_logits.shape)} and {tuple(q_logits.shape)} with tokens "
                         f"{tuple(tokens.shape)}: want (N, V), (N, V), (N,)")
    lp = base_logits.double().log_softmax(-1)
    lq = q_logits.double().log_softmax(-1)
    kld = (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0)  # >= 0 in exact arithmetic; rounding can dip below
    t = tokens.long().unsqueeze(-1)
    logp_base, logp_q = lp.gather(-1, t)[:, 0], lq.gather(-1, t)[:, 0]
    return {"kld": kld, "same_top": (lp.argmax(-1) == lq.argmax(-1)).double(),
            "dp": logp_q.exp() - logp_base.exp(), "logp_base": logp_base, "logp_q": logp_q}


def concat(chunks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The chunks of :func:`position_stats` joined into one set of ``(N,)`` tensors. Raises ValueError if empty."""
    if not chunks:
        raise ValueError("no scored positions")
    return {k: torch.cat([c[k] for c in chunks]) for k in FIELDS}


def _se(x: torch.Tensor) -> float:
    return float(x.std(unbiased=True) / math.sqrt(x.numel())) if x.numel() > 1 else float("nan")


def _percentiles(x: torch.Tensor, scale: float = 1.0) -> dict[str, float]:
    q = torch.quantile(x, torch.tensor([p / 100 for p in PERCENTILES], dtype=torch.float64))
    return {f"p{p:g}": float(v) * scale for p, v in zip(PERCENTILES, q)}


def summarize(stats: dict[str, torch.Tensor]) -> dict:
    """The report of :func:`position_stats` values (one or more chunks joined by :func:`concat`).

    Returns a JSON-ready dict: ``n`` (positions), ``kld_mean``, ``kld_se``, ``kld_percentiles`` (``{"p100":
    max, "p99.9", ..., "p0": min}``, nats), ``same_top_pct``, ``same_top_se_pct``, ``dp_mean_pct``,
    ``dp_se_pct``, ``dp_rms_pct``, ``dp_percentiles_pct``, ``ppl_base``, ``ppl_q``, ``ppl_ratio``,
    ``ln_ppl_ratio_mean``, ``ln_ppl_ratio_se``. Raises ValueError with no positions.
    """
    n = stats["kld"].numel()
    if n == 0:
        raise ValueError("no scored positions")
    kld, same, dp = stats["kld"], stats["same_top"], stats["dp"]
    ln_ratio = stats["logp_base"] - stats["logp_q"]  # ln PPL(Q) - ln PPL(base), per position
    p_same = float(same.mean())
    return {
        "n": n,
        "kld_mean": float(kld.mean()), "kld_se": _se(kld), "kld_percentiles": _percentiles(kld),
        "same_top_pct": 100 * p_same,
        "same_top_se_pct": 100 * math.sqrt(p_same * (1 - p_same) / (n - 1)) if n > 1 else float("nan"),
        "dp_mean_pct": 100 * float(dp.mean()), "dp_se_pct": 100 * _se(dp),
        "dp_rms_pct": 100 * float(dp.pow(2).mean().sqrt()), "dp_percentiles_pct": _percentiles(dp, 100.0),
        "ppl_base": math.exp(-float(stats["logp_base"].mean())), "ppl_q": math.exp(-float(stats["logp_q"].mean())),
        "ppl_ratio": math.exp(float(ln_ratio.mean())),
        "ln_ppl_ratio_mean": float(ln_ratio.mean()), "ln_ppl_ratio_se": _se(ln_ratio),
    }
