"""The acceptance table of ``chimera speculator train`` and ``chimera speculator report`` (Markdown), from a
``speculator.json`` record (:mod:`core.spec.record`)."""

from __future__ import annotations


def acceptance_table(record: dict) -> str:
    """Markdown: one row per prompt set (held-out sets first, then the training sets, marked), with the drafts
    scored, the mean acceptance length (vLLM's: 1 + accepted / drafts, tokens per verifier step with
    ``num_speculative_tokens`` proposed), the acceptance rate and the per-position acceptance rates."""
    k = record["num_speculative_tokens"]
    head = ("| set | role | drafts | mean acceptance length | acceptance rate | "
            + " | ".join(f"pos {i}" for i in range(k)) + " |")
    rule = "|" + "---|" * (5 + k)
    roles = {n: s["role"] for n, s in record["sets"].items()}
    names = sorted(record["acceptance"], key=lambda n: (roles.get(n) != "heldout", n))
    rows = []
    for n in names:
        a = record["acceptance"][n]
        rows.append(f"| {n} | {roles.get(n, '?')} | {a['drafts']} | {a['mean_acceptance_length']:.3f} | "
                    f"{a['acceptance_rate']:.3f} | "
                    + " | ".join(f"{r:.3f}" for r in a["acceptance_rate_per_position"]) + " |")
    return "\n".join([head, rule] + rows)
