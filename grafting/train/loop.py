"""Projector-only training of the graft (``chimera graft train --config configs/graft/<name>.yaml``).

LLaVA-style feature alignment (arXiv:2304.08485) with Kimi's projector: the vision tower and the LLM are frozen;
only the projector (optionally plus peft LoRA adapters on the LLM, off by default) gets gradients. Stages run in
order in one config (captions first, then question/answer conversations) under one AdamW optimizer with linear
warmup and cosine decay over all steps. Runs on one CPU or under ``accelerate launch`` on several GPUs
(DDP over the projector; each process reads its own slice of every global batch, so data order does not depend
on the number of processes). Checkpoints hold only the projector (safetensors) plus ``graft.json`` naming the
tower and the LLM, and ``trainer_state.pt`` for resuming.
"""

from __future__ import annotations

import contextlib
import csv
import math
import random
import time
from pathlib import Path

import torch
from torch import nn

from ..model import GraftedVLM, ImageTokenIds
from ..projector import GraftProjector, GraftProjectorConfig
from .checkpoint import latest_checkpoint, load_graft, save_checkpoint
from .config import TrainConfig
from .data import IGNORE, ConversationDataset, collate, read_jsonl


# -- loss -----------------------------------------------------------------------------------------
def token_loss(vlm: GraftedVLM, batch: dict) -> torch.Tensor:
    """Mean next-token cross-entropy over labelled (assistant) positions, float32 scalar.

    Only labelled positions go through the LM head (a 49k-152k-row matmul), which is most of the saving over
    ``labels=`` on the full logits. batch: ``input_ids``/``labels``/``attention_mask`` ``(B, T)``,
    ``pixel_values``/``image_grid_thw`` as made by :func:`grafting.train.data.collate`.
    """
    embeds = vlm.embed(batch["input_ids"], batch.get("pixel_values"), batch.get("image_grid_thw"))
    h = vlm.llm.get_decoder()(inputs_embeds=embeds, attention_mask=batch["attention_mask"].to(embeds.device)).last_hidden_state
    target = batch["labels"][:, 1:].to(h.device)
    keep = target != IGNORE
    logits = vlm.llm.get_output_embeddings()(h[:, :-1][keep]).float()
    return nn.functional.cross_entropy(logits, target[keep])


class GraftForTraining(nn.Module):
    """What accelerate prepares (and DDP wraps): ``forward(batch) -> loss``. ``train()`` keeps the frozen
    tower and LLM in eval mode (no dropout, exact base LLM)."""

    def __init__(self, vlm: GraftedVLM, llm_train_mode: bool = False):
        super().__init__()
        self.vlm = vlm
        self.llm_train_mode = llm_train_mode

    def train(self, mode: bool = True):
        """Set train mode on the wrapper and projector; tower stays eval, the LLM too unless checkpointing."""
        super().train(mode)
        self.vlm.tower.eval()
        self.vlm.llm.train(mode and self.llm_train_mode)  # gradient checkpointing only acts in train mode
        return self

    def forward(self, batch: dict) -> torch.Tensor:
        """:func:`token_loss` of the batch (float32 scalar)."""
        return token_loss(self.vlm, batch)


def trainable_parameters(vlm: GraftedVLM) -> list[nn.Parameter]:
    """Parameters that train: the projector's, plus LoRA adapters when enabled."""
    return [p for p in vlm.parameters() if p.requires_grad]


# -- data order -----------------------------------------------------------------------------------
def sample_order(n_rows: int, n_samples: int, seed: int) -> list[int]:
    """Row indices for ``n_samples`` draws: concatenated seeded permutations (epochs) of ``range(n_rows)``."""
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < n_samples:
        perm = list(range(n_rows))
        rng.shuffle(perm)
        out += perm
    return out[:n_samples]

# -- the loop -------------------------------------------------------------------------------------
def train(cfg: TrainConfig, log=print) -> dict:
    """Run all stages; returns ``{"final": path, "steps": n, "last_loss": x, "seconds_per_step": s}``.

    Writes ``log.csv`` (step, stage, loss averaged over processes, the lr the step used, labelled tokens of the
    main process's micro-batches, seconds) and ``checkpoint-<step>/`` every
    ``save_every`` steps plus ``final/`` in ``output_dir``. Resumes from the latest checkpoint when
    ``resume: auto``. Raises ValueError for an empty stage file or a conversation over ``max_prompt_tokens``.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm
    from transformers import get_cosine_schedule_with_warmup

    acc = Accelerator(mixed_precision=cfg.mixed_precision)
    set_seed(cfg.seed)
    out = Path(cfg.output_dir)
    vlm, processor = load_graft(cfg.model, acc.device, cfg.seed)
    if cfg.lora.enabled:
        from peft import LoraConfig, get_peft_model

        vlm.llm = get_peft_model(vlm.llm, LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=0.0,
                                                     target_modules=cfg.lora.target_modules))
    if cfg.gradient_checkpointing:
        vlm.llm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        vlm.llm.enable_input_require_grads()
    params = trainable_parameters(vlm)
    opt = torch.optim.AdamW(params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay, betas=cfg.optim.betas)
    sched = get_cosine_schedule_with_warmup(opt, math.ceil(cfg.optim.warmup_ratio * cfg.total_steps), cfg.total_steps)
    start = 0
    ckpt = latest_checkpoint(out) if cfg.resume == "auto" else (Path(cfg.resume) if cfg.resume else None)
    if ckpt is not None:
        state = torch.load(ckpt / "trainer_state.pt", map_location="cpu", weights_only=False)
        loaded = GraftProjector.from_pretrained(ckpt / "projector", dtype=torch.float32)
        vlm.projector.load_state_dict(loaded.state_dict())
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        start = state["step"]
        log(f"resumed from {ckpt} at step {start}")
    module = GraftForTraining(vlm, llm_train_mode=cfg.gradient_checkpointing)
    module, opt = acc.prepare(module, opt)
    module.train()

    B, A, W, r = cfg.optim.batch_size, cfg.optim.grad_accum, acc.num_processes, acc.process_index
    pad = processor.tokenizer.pad_token_id if processor.tokenizer.pad_token_id is not None else processor.tokenizer.eos_token_id
    plan = []  # (stage, dataset, order, first global step)
    first = 0
    for i, st in enumerate(cfg.stages):
        rows = read_jsonl(st.data)
        if not rows:
            raise ValueError(f"stage {st.name}: {st.data} has no rows")
        plan.append((st, ConversationDataset(rows, processor), sample_order(len(rows), st.steps * A * W * B, cfg.seed + i), first))
        first += st.steps
    log_path = out / "log.csv"
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        if start == 0 or not log_path.exists():
            log_path.write_text("step,stage,loss,lr,tokens,seconds\n")
        else:  # resumed: drop the rows of steps after the checkpoint (they are run again), so each step is logged once
            header, *rows = log_path.read_text().splitlines(keepends=True)
            log_path.write_text(header + "".join(r for r in rows if int(r.split(",", 1)[0]) <= start))
    bar = tqdm(total=cfg.total_steps, initial=start, disable=not acc.is_main_process, desc="graft train")
    t0, last_loss, window = time.perf_counter(), float("nan"), []
    step = start
    for st, ds, order, first in plan:
        for local in range(max(0, step - first), st.steps):
            t_step = time.perf_counter()
            loss_sum, tokens = 0.0, 0
            for m in range(A):
                k = ((local * A + m) * W + r) * B
                batch = collate([ds[j] for j in order[k:k + B]], pad, cfg.model.max_prompt_tokens)
                batch = {n: (v.to(acc.device) if v is not None else None) for n, v in batch.items()}
                ctx = acc.no_sync(module) if m < A - 1 else contextlib.nullcontext()
                with ctx:
                    loss = module(batch) / A
                    acc.backward(loss)
                loss_sum += loss.item()
                tokens += int((batch["labels"] != IGNORE).sum())
            if cfg.optim.max_grad_norm:
                acc.clip_grad_norm_(params, cfg.optim.max_grad_norm)
            lr = opt.param_groups[0]["lr"]  # the rate this step used
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            last_loss = float(acc.reduce(torch.tensor(loss_sum, device=acc.device), reduction="mean"))
            window.append(last_loss)
            if acc.is_main_process:
                with open(log_path, "a", newline="") as f:
                    csv.writer(f).writerow([step, st.name, f"{last_loss:.5f}", f"{lr:.3e}", tokens,
                                            f"{time.perf_counter() - t_step:.3f}"])
                bar.update(1)
                if step % cfg.log_every == 0:
                    bar.set_postfix(stage=st.name, loss=f"{sum(window) / len(window):.4f}", lr=f"{lr:.2e}")
                    window = []
            if step % cfg.save_every == 0 and step < cfg.total_steps:
                acc.wait_for_everyone()
                if acc.is_main_process:
                    save_checkpoint(out / f"checkpoint-{step}", acc.unwrap_model(module).vlm, cfg, step, st.name, opt, sched)
    bar.close()
    acc.wait_for_everyone()
    final = out / "final"
    if acc.is_main_process:
        save_checkpoint(final, acc.unwrap_model(module).vlm, cfg, step, cfg.stages[-1].name)
    done = step - start
    return {"final": str(final), "steps": step, "last_loss": last_loss,
            "seconds_per_step": (time.perf_counter() - t0) / max(1, done)}


# -- dry run on the meta device -------------------------------------------------------------------
def dry_run(cfg: TrainConfig) -> dict:
    """Build the configured graft on the meta device (``accelerate.init_empty_weights``; no weights read, no
    download) from ``meta_llm_config``/``meta_tower_config`` and report parameter counts, the trainable set and
    the global batch. Raises ValueError when the config lacks the meta configs."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, Kimi_K25VisionConfig, Kimi_K25VisionModel

    mc = cfg.model
    if mc.meta_llm_config is None or mc.meta_tower_config is None:
        raise ValueError("dry run needs model.meta_llm_config and model.meta_tower_config")
    llm_kw = dict(mc.meta_llm_config)
    llm_cfg = AutoConfig.for_model(llm_kw.pop("model_type"), **llm_kw)
    tower_cfg = Kimi_K25VisionConfig(**mc.meta_tower_config)
    with init_empty_weights():
        llm = AutoModelForCausalLM.from_config(llm_cfg)
        tower = Kimi_K25VisionModel(tower_cfg)
        projector = GraftProjector(GraftProjectorConfig(vision_hidden_size=tower_cfg.hidden_size, merge_size=4,
                                                        mid_size=mc.projector_mid_size,
                                                        llm_hidden_size=llm_cfg.hidden_size,
                                                        image_context=mc.projector_image_context))
    vlm = GraftedVLM(tower, projector, llm, ImageTokenIds(-1, -2, -3, ("", "", "")))  # unused: no forward on meta
    vlm.freeze_backbones()
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    trainable = sum(p.numel() for p in trainable_parameters(vlm))
    return {"llm_class": type(llm).__name__, "llm_params": count(llm), "tower_params": count(tower),
            "projector_params": count(projector), "trainable_params": trainable,
            "devices": {p.device.type for p in vlm.parameters()},
            "global_batch_per_process": cfg.optim.batch_size * cfg.optim.grad_accum, "total_steps": cfg.total_steps}
