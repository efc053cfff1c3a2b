"""The quantization worker: ``python -m core.quant.worker <spec.json>`` in ``.venv-quant`` (llm-compressor and
compressed-tensors pin other versions than the service's environments; :mod:`core.quant.runner` starts it).

Steps, for a Llama-architecture LM in ``model_dir`` (float32 reference) and a prompt file
(:mod:`core.quant.prompts`):

1. The reference answers every prompt greedily (``answer_tokens`` at most, EOS included); each answer's positions
   are scored: the reference's next-token logits there are kept.
2. A fake-quantized copy: llm-compressor's ``QuantizationModifier`` (round-to-nearest, the scheme's preset) on
   every unit, weights quantize-dequantized once; each unit is then switched on or off (its weights swapped, its
   input activations quantized or not, with vLLM's numerics: :class:`Toggles`), so "unit quantized or not" is a
   toggle and the KL measured is the KL of what vLLM serves.
3. The selection (:mod:`core.quant.search`) on the ``search`` sets' KL; with ``compare_fractions`` every method's
   set at each fraction is scored too.
4. The held-out report (:mod:`core.quant.kld`) per held-out set for the chosen set (and each compared one).
5. The checkpoint: llm-compressor's ``oneshot`` on a fresh copy with the unchosen units and ``lm_head`` in
   ``ignore``, saved compressed (compressed-tensors ``int-quantized``, what vLLM loads) with the tokenizer, then
   ``fidelity.json`` (:mod:`core.quant.fidelity`).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import torch

from .fidelity import weights_sha256, write_fidelity
from .kld import concat, position_stats, summarize
from .prompts import read_prompts, split_roles
from .schemes import require_host
from .search import greedy_path, random_subset, ranked, select, sensitivity, unit_count
from .units import Unit, llama_units


def log(msg: str) -> None:
    """One progress line on stdout (the runner relays it)."""
    print(msg, flush=True)


def int8_per_token(x: torch.Tensor) -> torch.Tensor:
    """Fake-quantize activations as vLLM's int8 kernels do for W8A8 (dynamic, symmetric, per token): scale =
    max|x| / 127 over the last dimension, ``round`` (half to even), clamp to [-128, 127]. compressed-tensors' own
    fake quantization divides by 127.5 instead; vLLM's CPU kernel was measured to match this one (to 1e-4 nats on
    log-probabilities, tests/test_quant_vllm.py), the other not (up to 0.07). Shapes and dtype kept."""
    s = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127.0
    return torch.clamp(torch.round(x / s), -128, 127) * s


class Toggles:
    """Per-unit quantization switches on a fake-quantized model (compressed-tensors modules after ``oneshot``).

    Quantized weights are computed once (``forward_quantize`` with the module's scales: exactly the int8 values and
    scales the checkpoint stores) and swapped in or out per unit. Input activations: for W8A8 a forward pre-hook
    with vLLM's numerics (:func:`int8_per_token`) on the units that are on, compressed-tensors' QDQ off; for the
    other schemes compressed-tensors' own activation QDQ, enabled per unit (weight QDQ skipped: the weights are
    already quantized). :meth:`set` switches."""

    def __init__(self, model: torch.nn.Module, units: list[Unit], preset: str):
        from compressed_tensors.quantization import QuantizationStatus
        from compressed_tensors.quantization.lifecycle.forward import forward_quantize

        self.units = units
        self.vllm_int8 = preset == "W8A8"
        self.modules = dict(model.named_modules())
        self.weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (full precision, fake-quantized)
        self.active: set[str] = set()
        for u in units:
            for name in u.modules:
                m = self.modules[name]
                w = m.weight.data.clone()
                with torch.no_grad():
                    wq = forward_quantize(m, w, "weight", m.quantization_scheme.weights)
                m.quantization_status = QuantizationStatus.COMPRESSED  # its forward: activations only
                self.weights[name] = (w, wq)
                if self.vllm_int8:
                    m.register_forward_pre_hook(self._hook(name))
        self.set(frozenset())

    def _hook(self, name: str):
        def pre(_module, args):
            return (int8_per_token(args[0]),) + tuple(args[1:]) if name in self.active else None
        return pre

    def set(self, names: frozenset[str]) -> None:
        """Quantize exactly the units ``names`` (unit names, ``"3.qkv"``)."""
        self.active = set()
        for u in self.units:
            q = u.name in names
            for name in u.modules:
                m = self.modules[name]
                m.weight.data = self.weights[name][1 if q else 0]
                m.quantization_enabled = q and not self.vllm_int8
                if q:
                    self.active.add(name)


class Scorer:
    """Scores a model's answers to the prompts against the reference's stored logits."""

    def __init__(self, model: torch.nn.Module, sets: dict, answer_tokens: int, eos_ids: list[int],
                 vocab: tuple[int, int] | None = None):
        self.model = model
        self.vocab = vocab
        self.items: dict[str, list[tuple[torch.Tensor, torch.Tensor, int]]] = {}  # set -> (embeds, targets, start)
        self.reference: dict[str, list[torch.Tensor]] = {}
        embed = model.get_input_embeddings()
        for name, s in sets.items():
            items = []
            for p in s.prompts:
                with torch.no_grad():
                    e = embed(p.unsqueeze(0)) if p.dtype == torch.int64 else p.unsqueeze(0).float()
                    out = model.generate(inputs_embeds=e, attention_mask=torch.ones(e.shape[:2], dtype=torch.long),
                                         max_new_tokens=answer_tokens, do_sample=False, eos_token_id=eos_ids,
                                         pad_token_id=eos_ids[0], logits_processor=_within(vocab))
                    answer = _until_eos(out[0], eos_ids)  # with inputs_embeds, generate returns the new tokens only
                    full = torch.cat([e, embed(answer[:-1].unsqueeze(0))], 1)  # position start + j predicts answer[j]
                items.append((full.detach(), answer, e.shape[1] - 1))
            self.items[name] = items
            self.reference[name] = [self.logits(name, i) for i in range(len(items))]
            log(f"reference: {name}: {len(items)} prompts, {sum(a.numel() for _, a, _ in items)} answer tokens")

    @torch.no_grad()
    def logits(self, name: str, i: int, full: bool = False) -> torch.Tensor:
        """The model's next-token logits at the answer positions of prompt ``i`` of set ``name``: ``(A, V)``, over
        the score vocabulary (the whole vocabulary when there is none, or with ``full``)."""
        e, answer, start = self.items[name][i]
        h = self.model.model(inputs_embeds=e).last_hidden_state[0, start:start + answer.numel()]
        logits = self.model.lm_head(h).float()
        return logits if self.vocab is None or full else logits[:, self.vocab[0]:self.vocab[1]]

    def targets(self, name: str, i: int) -> torch.Tensor:
        """The answer tokens of prompt ``i`` of set ``name`` as indices into :meth:`logits`' last dimension."""
        answer = self.items[name][i][1]
        return answer if self.vocab is None else answer - self.vocab[0]

    def stats(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Per-position statistics (:func:`core.quant.kld.position_stats`) over the sets ``names``."""
        chunks = [position_stats(self.reference[n][i], self.logits(n, i), self.targets(n, i))
                  for n in names for i in range(len(self.items[n]))]
        return concat(chunks)


def _probe(scorer: Scorer, sets: dict, heldout_sets: list[str]) -> dict | None:
    """The first held-out token-id prompt with its reference answer and the (fake-)quantized model's log-probability
    of each answer token over the whole vocabulary: what a server of the checkpoint must reproduce (vLLM's
    ``prompt_logprobs`` on ``prompt_ids + answer_ids``). None when no held-out prompt is token ids."""
    for name in heldout_sets:
        for i, p in enumerate(sets[name].prompts):
            if p.dtype == torch.int64:
                answer = scorer.items[name][i][1]
                logp = scorer.logits(name, i, full=True).double().log_softmax(-1)
                logp = logp.gather(-1, answer.unsqueeze(-1))[:, 0]
                return {"set": name, "prompt_ids": p.tolist(), "answer_ids": answer.tolist(), "logp_q": logp.tolist()}
    return None


def _within(vocab: tuple[int, int] | None):
    """A transformers logits-processor list keeping only the ids ``vocab[0] <= id < vocab[1]`` (empty: no
    restriction)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    if vocab is None:
        return LogitsProcessorList()

    class Within(LogitsProcessor):
        def __call__(self, input_ids, scores):
            out = torch.full_like(scores, float("-inf"))
            out[:, vocab[0]:vocab[1]] = scores[:, vocab[0]:vocab[1]]
            return out
    return LogitsProcessorList([Within()])


def _until_eos(answer: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    for j, t in enumerate(answer.tolist()):
        if t in eos_ids:
            return answer[:j + 1]
    return answer


def _eos_ids(model) -> list[int]:
    e = model.generation_config.eos_token_id if model.generation_config is not None else None
    e = e if e is not None else model.config.eos_token_id
    return [e] if isinstance(e, int) else list(e)


def _recipe(preset: str, ignore: list[str]):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return QuantizationModifier(targets="Linear", scheme=preset, ignore=ignore)


def run(spec: dict) -> dict:
    """Quantize per ``spec`` (see the module docstring; keys: model_dir, prompts, out, scheme, select, fraction,
    seed, shortlist, answer_tokens, compare_fractions, family, device) and return the fidelity record written.
    Raises UnsupportedSchemeError before any work for a scheme the device cannot serve, ValueError for a bad
    selection or prompt file."""
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    sch = require_host(spec["scheme"], spec.get("device", "cpu"))
    model_dir, out = Path(spec["model_dir"]), Path(spec["out"])
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    sets, vocab = read_prompts(spec["prompts"])
    search_sets, heldout_sets = split_roles(spec["prompts"], sets, "search")

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    units = llama_units([n for n, _ in model.named_modules()])
    scorer = Scorer(model, sets, int(spec["answer_tokens"]), _eos_ids(model), vocab)
    oneshot(model=model, recipe=_recipe(sch.preset, ["lm_head"]))
    toggles = Toggles(model, units, sch.preset)
    cache: dict[frozenset[str], float] = {}

    def kl_of(names: frozenset[str]) -> float:
        if names not in cache:
            toggles.set(names)
            cache[names] = float(scorer.stats(search_sets)["kld"].mean())
        return cache[names]

    reports: dict[frozenset[str], dict] = {}

    def heldout(names: list[str]) -> dict:  # each held-out set scored once per unit set
        key = frozenset(names)
        if key not in reports:
            toggles.set(key)
            per_set = {n: scorer.stats([n]) for n in heldout_sets}
            reports[key] = {n: summarize(st) for n, st in per_set.items()}
            reports[key]["all"] = summarize(concat(list(per_set.values())))
        return reports[key]

    method, fraction = spec["select"], float(spec["fraction"])
    compare = [float(f) for f in spec.get("compare_fractions") or []]
    needs_sens = method in ("sensitivity", "greedy") or compare
    sens = sensitivity(kl_of, units) if needs_sens else None
    if sens:
        log(f"sensitivity: {len(units)} units, KL alone {min(sens.values()):.5f} .. {max(sens.values()):.5f} "
            f"({time.perf_counter() - t0:.0f} s)")
    path = None
    if method == "greedy" or compare:
        n_max = max([unit_count(units, f) for f in compare]
                    + [unit_count(units, fraction) if method == "greedy" else 0])
        path = greedy_path(kl_of, units, n_max, sens, spec.get("shortlist"), log)
    if method == "greedy":
        chosen = [name for name, _ in path[:unit_count(units, fraction)]]
    else:
        chosen = select(method, units, fraction, kl_of, int(spec.get("seed", 0)), spec.get("shortlist"), sens)

    rows = []
    if compare:
        sets_by = [("none", 0.0, []), ("all", 1.0, [u.name for u in units])]
        for f in compare:
            n = unit_count(units, f)
            sets_by += [("sensitivity", f, [u.name for u in ranked(units, sens)[:n]]),
                        ("greedy", f, [name for name, _ in path[:n]]),
                        ("random", f, random_subset(units, n, int(spec.get("seed", 0))))]
        for m, f, names in sets_by:
            rows.append({"select": m, "fraction": f, "units": len(names), "search_kl": kl_of(frozenset(names)),
                         "heldout": heldout(names)})
            log(f"compare: {m} @ {f:g}: held-out KLD {rows[-1]['heldout']['all']['kld_mean']:.5f}, same top "
                f"{rows[-1]['heldout']['all']['same_top_pct']:.2f} %")
    report = heldout(chosen)
    search_kl = kl_of(frozenset(chosen))
    toggles.set(frozenset(chosen))  # the probe is scored on the chosen set (the caches above may not have set it)
    probe = _probe(scorer, sets, heldout_sets)

    # the checkpoint: a fresh copy, only the chosen units quantized
    ignore = ["lm_head"] + [m for u in units if u.name not in set(chosen) for m in u.modules]
    del model, toggles, scorer
    fresh = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if chosen:
        oneshot(model=fresh, recipe=_recipe(sch.preset, ignore))
        fresh.save_pretrained(tmp, save_compressed=True)
    else:
        fresh.save_pretrained(tmp)  # --select none: the reference itself (a baseline to serve side by side)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(tmp)
    record = {"family": spec.get("family"), "scheme": sch.name, "preset": sch.preset, "select": method,
              "fraction": fraction, "seed": int(spec.get("seed", 0)), "shortlist": spec.get("shortlist"),
              "units_total": len(units), "quantized_units": chosen, "ignore": ignore,
              "reference": {"path": str(model_dir), "sha256": weights_sha256(model_dir)},
              "answer_tokens": int(spec["answer_tokens"]), "score_vocab": list(vocab) if vocab else None,
              "sets": {n: {"role": s.role, "prompts": len(s.prompts), "description": s.description}
                       for n, s in sets.items()},
              "search_kl": search_kl, "heldout": report, "compare": rows, "probe": probe,
              "seconds": round(time.perf_counter() - t0, 1)}
    write_fidelity(tmp, record)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    log(f"wrote {out} ({len(chosen)}/{len(units)} units quantized, held-out KLD {report['all']['kld_mean']:.5f}, "
        f"{record['seconds']} s)")
    return record


def main(argv: list[str]) -> int:
    """Entry point: ``python -m core.quant.worker <spec.json>``; exit status 2 for a refused spec."""
    from .schemes import UnsupportedSchemeError

    spec = json.loads(Path(argv[0]).read_text())
    try:
        run(spec)
    except (UnsupportedSchemeError, ValueError) as e:
        print(f"chimera quantize: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
