"""The speculator worker: ``python -m core.spec.worker <spec.json>`` in ``.venv-spec`` (vllm-project/speculators
pins torch and transformers that the service's environments do not hold; :mod:`core.spec.runner` starts it).

Steps, for a Llama-architecture verifier LM in ``verifier`` (the weights the service serves) and a prompt file
(:mod:`core.quant.prompts`: ``train`` and ``heldout`` sets, token ids or input embeddings):

1. Self-distillation: the verifier answers every prompt greedily (``answer_tokens`` at most, EOS included), in
   left-padded batches; one forward over prompt + answer then keeps, per position, the verifier's hidden states
   after layers ``layer_ids`` (vLLM's EAGLE-3 auxiliary states: the residual stream after layer k, what
   ``vllm/model_executor/models/llama.py`` hands the drafter) and its pre-norm last hidden state (the target's
   logits are ``lm_head(norm(.))`` of it). An embeddings prompt's positions get token id 0 (the prompt file holds
   no ids for them; vLLM serves the VLM's image prompts as mixed prompts whose image positions hold its own marker
   id, which the draft embeds: :mod:`core.vllm_marker`).
2. The draft vocabulary: the ``draft_vocab`` most frequent tokens of the training answers (speculators'
   ``build_vocab_mappings_from_distribution``; the rest of the verifier's vocabulary is never proposed).
3. Training: speculators' ``Eagle3DraftModel`` (one Llama decoder layer over [token embedding, fc(aux states)],
   Li et al. 2025, "EAGLE-3", arXiv:2503.01840), sdpa attention, with its training-time test: ``ttt_steps``
   drafting steps per position, each fed the previous step's own hidden state, KL divergence to the verifier's
   distribution on the answer positions; AdamW, 5 % warm-up, cosine; sequences packed to ``pack_tokens``.
4. Held-out acceptance per held-out set: every answer position starts a ``ttt_steps``-token draft; the accepted
   length is the number of leading drafts equal to the verifier's greedy tokens (:mod:`core.spec.acceptance`).
5. The checkpoint (speculators' format, what ``vllm serve --speculative-config '{"method": "eagle3", ...}'``
   loads) and ``speculator.json`` (:mod:`core.spec.record`). When the verifier's embedding table has no row for
   vLLM's mixed-prompt marker id (SmolLM2-135M), the head's own ``embed_tokens`` is widened to have one
   (:func:`pad_head_table`), so vLLM serves it for the VLM's image prompts.
"""

from __future__ import annotations

import copy
import json
import random
import sys
import time
from pathlib import Path

import torch

from core.quant.fidelity import weights_sha256
from core.quant.prompts import read_prompts, split_roles
from core.vllm_marker import EMBED_KEY, embeds_marker, padded_rows

from .acceptance import acceptance_summary, accepted_lengths
from .record import write_record


def log(msg: str) -> None:
    """One progress line on stdout (the runner relays it)."""
    print(msg, flush=True)


class Sequence:
    """One distilled sequence: ``ids (T,)`` int64 (prompt ids, 0 at embedding positions, then the answer),
    ``aux (T, k*H)`` float32 (the verifier's states after each of the k layers), ``last (T, H)`` float32 (its
    pre-norm last hidden state), ``prompt_len`` P; the answer is ``ids[P:]``."""

    def __init__(self, ids: torch.Tensor, aux: torch.Tensor, last: torch.Tensor, prompt_len: int):
        self.ids, self.aux, self.last, self.prompt_len = ids, aux, last, prompt_len

    def loss_mask(self) -> torch.Tensor:
        """``(T,)`` bool: positions t whose next token ``ids[t + 1]`` is an answer token (the verifier's
        prediction there is what a draft after the prompt must match)."""
        m = torch.zeros(self.ids.numel(), dtype=torch.bool)
        m[self.prompt_len:self.ids.numel() - 1] = True
        return m


def _until_eos(tokens: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """The answer up to and including its first EOS (all of it without one)."""
    for j, t in enumerate(tokens.tolist()):
        if t in eos_ids:
            return tokens[:j + 1]
    return tokens


@torch.no_grad()
def distill(model, prompts: list[torch.Tensor], layer_ids: list[int], answer_tokens: int, eos_ids: list[int],
            batch: int) -> list[Sequence]:
    """Greedy answers of ``model`` to ``prompts`` (``(T,)`` int64 ids or ``(T, H)`` float32 embeddings, on the CPU)
    and the states of :class:`Sequence` over prompt + answer (float32, on the CPU, whatever the model's device and
    dtype). Batches of ``batch`` prompts, left-padded."""
    embed = model.get_input_embeddings()
    dev, dtype = embed.weight.device, embed.weight.dtype
    prompts = [p.to(dev) if p.dtype == torch.int64 else p.to(dev, dtype) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: prompts[i].shape[0])
    answers: dict[int, torch.Tensor] = {}
    for b in range(0, len(order), batch):
        idx = order[b:b + batch]
        es = [embed(prompts[i]) if prompts[i].dtype == torch.int64 else prompts[i] for i in idx]
        width = max(e.shape[0] for e in es)
        e = torch.zeros(len(es), width, es[0].shape[1], device=dev, dtype=dtype)
        mask = torch.zeros(len(es), width, dtype=torch.long, device=dev)
        for r, x in enumerate(es):
            e[r, width - x.shape[0]:] = x
            mask[r, width - x.shape[0]:] = 1
        out = model.generate(inputs_embeds=e, attention_mask=mask, max_new_tokens=answer_tokens, do_sample=False,
                             eos_token_id=eos_ids, pad_token_id=eos_ids[0])  # new tokens only (inputs_embeds)
        for r, i in enumerate(idx):
            answers[i] = _until_eos(out[r], eos_ids)
    captured: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    try:
        seqs = []
        for i, p in enumerate(prompts):
            a = answers[i]
            e = embed(p) if p.dtype == torch.int64 else p
            full = torch.cat([e, embed(a)]).unsqueeze(0)
            captured.clear()
            hs = model.model(inputs_embeds=full, output_hidden_states=True).hidden_states
            ids = torch.cat([p if p.dtype == torch.int64 else torch.zeros(p.shape[0], dtype=torch.long, device=dev),
                             a])
            aux = torch.cat([hs[k][0] for k in layer_ids], dim=-1)
            seqs.append(Sequence(ids.cpu(), aux.float().cpu(), captured[0][0].float().cpu(), p.shape[0]))
    finally:
        hook.remove()
    return seqs


HEAD_LAYER_TYPES = ("llama", "qwen3")  # decoder layers speculators 0.9's Eagle3DraftModel builds (model_classes)


def head_layer_config(verifier_config):
    """The draft head's one decoder layer config for a verifier's HF config: the verifier's own with
    ``num_hidden_layers`` 1 when speculators builds that layer type (:data:`HEAD_LAYER_TYPES`), else (GLM-4's
    ``glm4``, ...) a ``LlamaConfig`` of the verifier's widths (vocabulary, hidden, intermediate, heads, KV heads,
    head_dim, RMSNorm epsilon, positions, RoPE theta with full rotary): the EAGLE-3 layer is the head's own and
    reads only the verifier's hidden states and token embeddings (vLLM drafts with its Llama EAGLE-3 model,
    ``vllm/model_executor/models/llama_eagle3.py``). Returns a new config; the argument is not changed."""
    if verifier_config.model_type in HEAD_LAYER_TYPES:
        cfg = copy.deepcopy(verifier_config)
        cfg.num_hidden_layers = 1
        return cfg
    from transformers import LlamaConfig

    c = verifier_config
    rope = dict(getattr(c, "rope_parameters", None) or {})
    return LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                       num_hidden_layers=1, num_attention_heads=c.num_attention_heads,
                       num_key_value_heads=c.num_key_value_heads,
                       head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                       hidden_act="silu", max_position_embeddings=c.max_position_embeddings,
                       rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": float(rope.get("rope_theta", 10000.0))})


def _packs(seqs: list[Sequence], pack_tokens: int, rng: random.Random) -> list[list[Sequence]]:
    """Shuffled sequences grouped so each group's total length is at most ``pack_tokens`` (a longer sequence is
    a group alone)."""
    order = seqs[:]
    rng.shuffle(order)
    packs, cur, n = [], [], 0
    for s in order:
        if cur and n + s.ids.numel() > pack_tokens:
            packs.append(cur)
            cur, n = [], 0
        cur.append(s)
        n += s.ids.numel()
    return packs + ([cur] if cur else [])


def batch_of(pack: list[Sequence]) -> dict[str, torch.Tensor]:
    """One packed training batch in speculators' EAGLE-3 alignment (``shift_batch``): per sequence, position j
    pairs token ``ids[j + 1]`` with the states of position j and the verifier's pre-norm state at j + 1 (which
    predicts token j + 2). Shapes ``[1, N]`` (ids, document ids, loss mask, positions from 1) and ``[1, N, .]``."""
    parts = {k: [] for k in ("input_ids", "hidden_states", "verifier_last_hidden_states", "loss_mask",
                             "document_ids", "position_ids")}
    for d, s in enumerate(pack):
        t = s.ids.numel()
        parts["input_ids"].append(s.ids[1:])
        parts["hidden_states"].append(s.aux[:-1])
        parts["verifier_last_hidden_states"].append(s.last[1:])
        parts["loss_mask"].append(s.loss_mask()[1:])
        parts["document_ids"].append(torch.full((t - 1,), d, dtype=torch.long))
        parts["position_ids"].append(torch.arange(1, t, dtype=torch.long))
    return {k: torch.cat(v).unsqueeze(0) for k, v in parts.items()}


@torch.no_grad()
def draft_acceptance(model, seqs: list[Sequence], ttt_steps: int, device: str = "cpu") -> torch.Tensor:
    """Accepted draft lengths ``(S,)`` int64 (CPU) over every answer position of ``seqs`` that has ``ttt_steps``
    verifier tokens after it (:func:`core.spec.acceptance.accepted_lengths`); the head runs on ``device``."""
    out = []
    for s in seqs:
        b = {k: v.to(device) for k, v in batch_of([s]).items()}
        drafts = model(hidden_states=b["hidden_states"], input_ids=b["input_ids"], document_ids=b["document_ids"],
                       position_ids=b["position_ids"], ttt_steps=ttt_steps)
        steps = torch.stack([d[0] for d in drafts])  # (ttt_steps, T - 1) draft-vocab ids
        if model.d2t is not None:
            steps = steps + model.d2t[steps]
        steps = steps.cpu()
        truth = s.ids[2:]  # the draft at aligned position j, step k, proposes token j + 2 + k
        lo, hi = s.prompt_len - 1, s.ids.numel() - 1 - ttt_steps  # starts after the prompt with k targets left
        if hi > lo:
            out.append(accepted_lengths(steps[:, lo:hi], truth, lo))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


IMAGE_POSITION_ID = 0  # the id distill gives an embeddings prompt's positions (its prompt file holds none there)


def pad_head_table(out: str | Path, marker: int, rows: int) -> int:
    """Widen the saved head in ``out`` so vLLM's marker id ``marker`` is a row of the table its draft embeds with,
    for a verifier of ``rows`` embedding rows (``marker >= rows``; :mod:`core.vllm_marker`). Returns the new row
    count, :func:`core.vllm_marker.padded_rows` (49216 for SmolLM2-135M).

    The head's ``embed_tokens.weight`` (``(rows, H)``, the verifier's table, saved by speculators, in the dtype it
    was saved in) becomes ``(new rows, H)``: the verifier's rows, then zero rows, except that the marker's row is
    the row of :data:`IMAGE_POSITION_ID` (what the head saw at image positions in training, :func:`distill`).
    ``transformer_layer_config.vocab_size`` in ``config.json`` becomes the new count (vLLM builds the draft's table
    from it, ``vllm/model_executor/models/llama_eagle3.py:192``). A table of another shape than the target's is
    never shared by vLLM (``vllm/v1/spec_decode/llm_base_proposer.py:1450``), so the draft embeds with this one.
    Only the input table is widened: the draft proposes through ``d2t`` into the verifier's ids (a draft vocabulary
    smaller than ``rows``, :func:`run`), and vLLM fills the columns of the draft's logits no draft id maps to,
    padding included, with -inf (``llama_eagle3.py:385-395`` ``compute_logits``), so no proposal is past the
    target's vocabulary. Raises ValueError when the checkpoint has no ``embed_tokens.weight``."""
    from safetensors.torch import load_file, save_file

    out = Path(out)
    new_rows = padded_rows(rows, marker)
    for f in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(f))
        if EMBED_KEY not in tensors:
            continue
        old = tensors[EMBED_KEY]
        table = torch.zeros(new_rows, old.shape[1], dtype=old.dtype)
        table[:old.shape[0]] = old
        table[marker] = old[IMAGE_POSITION_ID]
        tensors[EMBED_KEY] = table.contiguous()
        save_file(tensors, str(f), metadata={"format": "pt"})
        cfg_path = out / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["transformer_layer_config"]["vocab_size"] = new_rows
        cfg_path.write_text(json.dumps(cfg, indent=2))
        return new_rows
    raise ValueError(f"{out}: the head's checkpoint has no {EMBED_KEY} to widen for vLLM's marker id {marker}")


def run(spec: dict) -> dict:
    """Do the five steps for ``spec`` (keys: ``verifier``, ``prompts``, ``out``, ``layer_ids`` (None: vLLM's
    default 2, L/2, L-3), ``answer_tokens``, ``draft_vocab``, ``steps``, ``lr``, ``ttt_steps``, ``pack_tokens``,
    ``batch``, ``seed``, ``threads``; optional ``device``, default ``cpu``, and ``verifier_dtype``, default
    ``float32``: where the verifier and the head run and the verifier's dtype, e.g. ``cuda`` and ``bfloat16`` for
    GLM-4-9B; the head trains in float32). For a verifier without an embedding row for vLLM's marker id the draft
    vocabulary is at most its vocabulary less one (vLLM maps draft ids through ``d2t`` only when the sizes differ,
    ``llama_eagle3.py:338``) and the head's table is widened (:func:`pad_head_table`; the record's ``embed_rows``).
    Returns the record written. Raises ValueError for a prompt file without a ``train`` set and a ``heldout`` set."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, get_cosine_schedule_with_warmup

    t0 = time.time()
    torch.manual_seed(int(spec["seed"]))
    torch.set_num_threads(int(spec["threads"]))
    sets, _ = read_prompts(spec["prompts"])
    train_sets, heldout_sets = split_roles(spec["prompts"], sets, "train")
    verifier = spec["verifier"]
    config = AutoConfig.from_pretrained(verifier)
    n_layers = config.num_hidden_layers
    layer_ids = spec.get("layer_ids") or [2, n_layers // 2, n_layers - 3]
    if not layer_ids or not all(0 < k < n_layers for k in layer_ids):
        raise ValueError(f"layer_ids {layer_ids}: layers k with 0 < k < {n_layers} (the residual stream after "
                         f"layer k; HF's state after the last layer is post-norm, vLLM's is not)")
    device = spec.get("device", "cpu")
    model = AutoModelForCausalLM.from_pretrained(
        verifier, dtype=getattr(torch, spec.get("verifier_dtype", "float32"))).to(device).eval()
    eos = GenerationConfig.from_pretrained(verifier).eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos)
    data = {}
    for name, s in sets.items():
        data[name] = distill(model, s.prompts, layer_ids, int(spec["answer_tokens"]), eos_ids, int(spec["batch"]))
        log(f"distilled: {name} ({s.role}): {len(s.prompts)} prompts, "
            f"{sum(x.ids.numel() - x.prompt_len for x in data[name])} answer tokens")
    del model
    train = [x for n in train_sets for x in data[n]]
    freq: dict[int, int] = {}
    for x in train:
        for t in x.ids[x.prompt_len:].tolist():
            freq[t] = freq.get(t, 0) + 1
    marker, rows = embeds_marker(verifier)
    pad = marker >= rows  # the head needs a table of its own with a row for vLLM's marker id
    draft_vocab = min(int(spec["draft_vocab"]), config.vocab_size - 1 if pad else config.vocab_size)
    d2t, t2d = build_vocab_mappings_from_distribution(freq, draft_vocab, config.vocab_size)
    head_cfg = head_layer_config(config)
    ttt = int(spec["ttt_steps"])
    head = Eagle3DraftModel.from_training_args(
        head_cfg, t2d=t2d, d2t=d2t, draft_vocab_size=draft_vocab, norm_before_residual=True, ttt_steps=ttt,
        verifier_name_or_path=verifier, target_layer_ids=layer_ids, draft_attn_impl="sdpa").to(device)
    from speculators.losses import resolve_loss_config

    loss_config = resolve_loss_config("kl_div", "eager")
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=float(spec["lr"]), weight_decay=0.0)
    steps = int(spec["steps"])
    sched = get_cosine_schedule_with_warmup(opt, max(1, steps // 20), steps)
    rng = random.Random(int(spec["seed"]))
    packs: list = []
    head.train()
    for step in range(1, steps + 1):
        if not packs:
            packs = _packs(train, int(spec["pack_tokens"]), rng)
        b = {k: v.to(device) for k, v in batch_of(packs.pop()).items()}
        _, loss, metrics = head(**b, ttt_steps=ttt, loss_config=loss_config)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % max(1, steps // 10) == 0 or step == steps:
            acc = " ".join(f"{float(metrics[f'full_acc_{k}_sum'] / metrics[f'full_acc_{k}_total'].clamp_min(1)):.3f}"
                           for k in range(ttt))
            log(f"train: step {step}/{steps}: loss {loss.item():.4f}, draft accuracy by step {acc} "
                f"({time.time() - t0:.0f} s)")
    head.eval()
    heldout = {}
    for name in heldout_sets + train_sets:
        heldout[name] = acceptance_summary(draft_acceptance(head, data[name], ttt, device), ttt)
        log(f"acceptance: {name}: mean acceptance length {heldout[name]['mean_acceptance_length']:.3f} "
            f"over {heldout[name]['drafts']} drafts")
    out = Path(spec["out"])
    head.save_pretrained(str(out))
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["speculators_config"]["verifier"]["name_or_path"] = str(Path(verifier).resolve())
    cfg_path.write_text(json.dumps(cfg, indent=2))
    (out / "config.py").unlink(missing_ok=True)  # speculators' auto_map helper; vLLM reads config.json itself
    embed_rows = pad_head_table(out, marker, rows) if pad else None
    if pad:
        log(f"embedding table: {embed_rows} rows (the verifier's {rows} and a row for vLLM's marker id "
            f"{marker})")
    record = {
        "verifier_sha256": weights_sha256(verifier), "verifier": str(Path(verifier).resolve()),
        "method": "eagle3", "num_speculative_tokens": ttt, "layer_ids": layer_ids, "draft_vocab": draft_vocab,
        "embed_rows": embed_rows, "steps": steps, "lr": float(spec["lr"]), "answer_tokens": int(spec["answer_tokens"]),
        "seed": int(spec["seed"]), "parameters": sum(p.numel() for n, p in head.named_parameters()
                                                       if not n.startswith("verifier_")),
        "sets": {n: {"role": s.role, "prompts": len(s.prompts), "description": s.description}
                 for n, s in sets.items()},
        "acceptance": heldout, "seconds": round(time.time() - t0, 1),
    }
    write_record(out, record)
    log(f"wrote {out} ({record['seconds']} s)")
    return record


def main(argv: list[str]) -> int:
    """Entry point: ``python -m core.spec.worker <spec.json>``; exit status 2 for a refused spec."""
    spec = json.loads(Path(argv[0]).read_text())
    try:
        run(spec)
    except ValueError as e:
        print(f"chimera speculator: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
