"""Acceptance statistics of speculative decoding, as vLLM reports them (``vllm/v1/spec_decode/metrics.py``).

A draft of k tokens is checked against the verifier's greedy tokens; its accepted length is the number of leading
draft tokens the verifier would have produced (0..k). vLLM's *mean acceptance length* counts the verifier's own
bonus token too: ``1 + accepted / drafts``, the tokens one verifier step yields. Its per-position acceptance rate
is the fraction of drafts whose token at position i was accepted (so it never rises with i).
"""

from __future__ import annotations

import torch


def accepted_lengths(drafts: torch.Tensor, truth: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """Accepted lengths of S drafts: ``drafts (k, S)`` int64, draft c's token i proposing ``truth[offset + c + i]``
    (``truth (N,)`` int64, the verifier's greedy tokens). Returns ``(S,)`` int64 in 0..k: how many leading tokens
    of each draft match. Raises ValueError when ``truth`` is too short for the last draft."""
    k, s = drafts.shape
    if offset + s - 1 + k > truth.numel():
        raise ValueError(f"truth has {truth.numel()} tokens; {s} drafts of {k} from offset {offset} need "
                         f"{offset + s - 1 + k}")
    idx = offset + torch.arange(s).unsqueeze(0) + torch.arange(k).unsqueeze(1)  # (k, S)
    correct = (drafts == truth[idx]).long()
    return correct.cumprod(0).sum(0)


def acceptance_summary(lengths: torch.Tensor, k: int) -> dict:
    """``{"drafts", "num_speculative_tokens", "mean_acceptance_length", "acceptance_rate",
    "acceptance_rate_per_position"}`` of accepted lengths ``(S,)`` in 0..k: mean acceptance length
    ``1 + mean(lengths)`` (vLLM's), acceptance rate ``mean(lengths) / k``, per position i the fraction of drafts
    with ``length > i``. All NaN when S is 0."""
    n = int(lengths.numel())
    if n == 0:
        nan = float("nan")
        return {"drafts": 0, "num_speculative_tokens": k, "mean_acceptance_length": nan, "acceptance_rate": nan,
                "acceptance_rate_per_position": [nan] * k}
    mean = float(lengths.float().mean())
    return {"drafts": n, "num_speculative_tokens": k, "mean_acceptance_length": 1.0 + mean,
            "acceptance_rate": mean / k,
            "acceptance_rate_per_position": [float((lengths > i).float().mean()) for i in range(k)]}


def from_vllm_counters(drafts: float, accepted: float, accepted_per_pos: list[float]) -> dict:
    """The same summary from vLLM's Prometheus counters (``vllm:spec_decode_num_drafts``,
    ``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos`` by position): mean acceptance length
    ``1 + accepted / drafts``, per-position rate ``accepted_per_pos[i] / drafts``. NaN without drafts."""
    k = len(accepted_per_pos)
    if drafts <= 0:
        nan = float("nan")
        return {"drafts": 0, "num_speculative_tokens": k, "mean_acceptance_length": nan, "acceptance_rate": nan,
                "acceptance_rate_per_position": [nan] * k}
    return {"drafts": int(drafts), "num_speculative_tokens": k, "mean_acceptance_length": 1.0 + accepted / drafts,
            "acceptance_rate": accepted / drafts / max(k, 1),
            "acceptance_rate_per_position": [a / drafts for a in accepted_per_pos]}


SPEC_COUNTERS = {"drafts": "vllm:spec_decode_num_drafts_total",
                 "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
                 "accepted": "vllm:spec_decode_num_accepted_tokens_total",
                 "accepted_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos_total"}


def spec_counters(text: str) -> dict | None:
    """vLLM's speculative-decoding counters in the Prometheus text of its ``/metrics`` (``vllm/v1/metrics/
    loggers.py``, counters since the server started), summed over engines: ``{"drafts", "draft_tokens",
    "accepted"}`` (floats) and ``"accepted_per_pos"`` (floats, positions in order). None when the text has no
    drafts counter (the server does not speculate)."""
    out: dict = {"drafts": None, "draft_tokens": 0.0, "accepted": 0.0}
    per_pos: dict[int, float] = {}
    names = {v: k for k, v in SPEC_COUNTERS.items()}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        key = names.get(name.split("{", 1)[0])
        if key == "accepted_per_pos":
            pos = int(name.split('position="', 1)[1].split('"', 1)[0])
            per_pos[pos] = per_pos.get(pos, 0.0) + float(value)
        elif key is not None:
            out[key] = (out[key] or 0.0) + float(value)
    if out["drafts"] is None:
        return None
    out["accepted_per_pos"] = [per_pos[i] for i in sorted(per_pos)]
    return out


def counters_from_metrics(text: str) -> tuple[float, float, list[float]]:
    """``(drafts, accepted, accepted_per_pos)`` from the Prometheus text of a vLLM server's ``/metrics``
    (:func:`spec_counters`): the counters :func:`from_vllm_counters` takes. Zeros and ``[]`` when the server has no
    speculative decoding."""
    c = spec_counters(text)
    return (0.0, 0.0, []) if c is None else (c["drafts"], c["accepted"], c["accepted_per_pos"])
