"""Step caches for the Wan transformer, per request, through diffusers' cache hooks (diffusers >= 0.42).

A request's ``cache`` (``"mag"`` | ``"first_block"`` | ``"taylorseer"`` | null) picks one of diffusers'
``MagCacheConfig``, ``FirstBlockCacheConfig`` or ``TaylorSeerCacheConfig``, enabled with the model's
``enable_cache`` for ONE clip and removed (``disable_cache``) when the clip ends, its state reset first: no cache
state outlives a clip, so nothing leaks between the clips of a chain or between jobs.

Composition: the hooks wrap the transformer blocks' ``forward`` (MagCache / First Block Cache skip whole blocks
and add a cached residual; TaylorSeer predicts each block's output); block-sparse attention
(:mod:`video.sparse`) replaces the attention processors inside the blocks and counts steps with a
pre-hook on the transformer itself. Neither touches what the other owns, so they stack in either order: a
computed block runs sparse attention, a skipped block runs nothing.

MagCache needs per-checkpoint ratios (``cfg.cache.mag.mag_ratios``), measured by :func:`calibrate_mag_ratios`
with the formula of diffusers' ``MagCacheBlockHook._perform_calibration_step`` (Ma et al. 2025,
arXiv:2506.09045): per step, ``mean over tokens of |r_t| / |r_(t-1)|`` of the residual ``r`` = last block's
output - first block's input of the conditional pass; 1.0 for the first step.
"""

from __future__ import annotations

import contextlib

import torch

from .config import StepCacheConfig


def cache_config(kind: str, options: StepCacheConfig, num_inference_steps: int):
    """The diffusers cache config of ``kind`` (``mag`` | ``first_block`` | ``taylorseer``) for a clip of
    ``num_inference_steps`` steps. Raises ValueError on an unknown kind or ``mag`` without ratios."""
    from diffusers import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    if kind == "mag":
        m = options.mag
        if m.mag_ratios is None:
            raise ValueError("MagCache needs calibrated mag_ratios for this model")
        return MagCacheConfig(threshold=m.threshold, max_skip_steps=m.max_skip_steps,
                              retention_ratio=m.retention_ratio, num_inference_steps=num_inference_steps,
                              mag_ratios=list(m.mag_ratios))
    if kind == "first_block":
        return FirstBlockCacheConfig(threshold=options.first_block.threshold)
    if kind == "taylorseer":
        t = options.taylorseer
        # whole Wan blocks (diffusers' default patterns "^blocks.*attn" full-match no Wan module name)
        return TaylorSeerCacheConfig(cache_interval=t.cache_interval,
                                     disable_cache_before_step=t.disable_cache_before_step, max_order=t.max_order,
                                     taylor_factors_dtype=torch.float32, cache_identifiers=[r"blocks\.\d+"])
    raise ValueError(f"unknown step cache {kind!r}")


@contextlib.contextmanager
def step_cache(transformers: torch.nn.Module | list[torch.nn.Module], kind: str | None, options: StepCacheConfig,
               num_inference_steps: int):
    """Enable the step cache ``kind`` on ``transformers`` (diffusers ``ModelMixin`` with ``enable_cache``) for one
    clip; None: nothing installed. On exit (also on error) the hooks' state is reset and the hooks removed.
    Raises ValueError as :func:`cache_config` does."""
    if kind is None:
        yield
        return
    if isinstance(transformers, torch.nn.Module):
        transformers = [transformers]
    enabled = []
    try:
        for tr in transformers:
            tr.enable_cache(cache_config(kind, options, num_inference_steps))
            enabled.append(tr)
        yield
    finally:
        for tr in enabled:
            tr._reset_stateful_cache()
            tr.disable_cache()


@torch.no_grad()
def calibrate_mag_ratios(pipe, num_inference_steps: int, **call) -> list[float]:
    """MagCache ratios of ``pipe``'s transformer (a diffusers Wan pipeline), measured over one generation of
    ``num_inference_steps`` steps (``call``: the other pipeline arguments, e.g. prompt, sizes, generator).

    Returns ``num_inference_steps`` floats (the first 1.0): per step, the token-mean ratio of the L2 norms of the
    conditional pass's residual (last block out - first block in) to the previous step's, as diffusers'
    MagCache calibration computes it. Classifier-free guidance's unconditional pass is not measured (the
    calibration follows the first transformer call of each step)."""
    tr = pipe.transformer
    seen = {"t": None, "measure": False, "in": None, "prev": None}
    ratios: list[float] = []

    def on_call(module, args, kwargs):  # the first call with a new timestep is the step's conditional pass
        t = kwargs.get("timestep", args[1] if len(args) > 1 else None)
        t = float(torch.as_tensor(t).float().max())
        seen["measure"], seen["t"] = t != seen["t"], t

    def on_head(module, args, kwargs):
        if seen["measure"]:
            seen["in"] = kwargs.get("hidden_states", args[0] if args else None)

    def on_tail(module, args, kwargs, out):
        if not seen["measure"]:
            return
        r = (out[0] if isinstance(out, tuple) else out).float() - seen["in"].float()
        prev = seen["prev"]
        ratios.append(1.0 if prev is None else
                      float((torch.linalg.norm(r, dim=-1) / (torch.linalg.norm(prev, dim=-1) + 1e-8)).mean()))
        seen["prev"] = r

    hooks = [tr.register_forward_pre_hook(on_call, with_kwargs=True),
             tr.blocks[0].register_forward_pre_hook(on_head, with_kwargs=True),
             tr.blocks[-1].register_forward_hook(on_tail, with_kwargs=True)]
    try:
        pipe(num_inference_steps=num_inference_steps, output_type="latent", **call)
    finally:
        for h in hooks:
            h.remove()
    return ratios
