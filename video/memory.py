"""GPU memory one Wan video job needs at the profile's largest clip, from the pipeline's architecture configs.

Weights: the transformer and the UMT5 text encoder in ``dtype``, the VAE in ``vae_dtype``, each counted on the
meta device (``core.memory.meta_params``). Activations at the largest clip the limits allow (the frame size
of most pixels within ``max_width``/``max_height``/``max_pixels`` on the size multiple, ``max_frames_per_clip``):
the fp32 latent, and one transformer block's live tensors over every latent token (attention by SDPA / flex
attention, which never stores the token x token matrix; classifier-free guidance runs its two passes one after the
other), and the VAE decoder's top level (estimates; formulas in each :class:`~core.memory.Need`).
"""

from __future__ import annotations

from functools import lru_cache

from core.memory import DTYPE_BYTES, Need, meta_params

from .config import VideoConfig


def largest_frame(cfg: VideoConfig) -> tuple[int, int]:
    """``(width, height)`` of most pixels the limits accept (multiples of ``cfg.size_multiple``)."""
    m, lim = cfg.size_multiple, cfg.limits
    best = (0, 0, 0)
    for w in range(m, lim.max_width + 1, m):
        h = min(lim.max_height, lim.max_pixels // w) // m * m
        if h >= m and w * h > best[0]:
            best = (w * h, w, h)
    return best[1], best[2]


def latent_grid(frames: int, width: int, height: int, vae_config: dict, transformer_config: dict) -> tuple[int, ...]:
    """``(latent frames, latent height, latent width, patch tokens)`` of a clip: frames ``(F - 1) / t + 1``,
    sides ``/ scale_factor_spatial``, tokens after the transformer's ``patch_size`` (t, h, w)."""
    st, ss = vae_config.get("scale_factor_temporal", 4), vae_config.get("scale_factor_spatial", 8)
    lf, lh, lw = (frames - 1) // st + 1, height // ss, width // ss
    pt, ph, pw = transformer_config["patch_size"]
    return lf, lh, lw, (lf // pt) * (lh // ph) * (lw // pw)


@lru_cache(maxsize=8)
def _params(kind: str, cfg_items: tuple) -> int:
    cfg = {k: list(v) if isinstance(v, tuple) else v for k, v in cfg_items}
    if kind == "transformer":
        from diffusers import WanTransformer3DModel

        return meta_params(lambda: WanTransformer3DModel.from_config(cfg))
    if kind == "vae":
        from diffusers import AutoencoderKLWan

        return meta_params(lambda: AutoencoderKLWan.from_config(cfg))
    from transformers import UMT5Config, UMT5EncoderModel

    return meta_params(lambda: UMT5EncoderModel(UMT5Config(**{k: v for k, v in cfg.items()
                                                               if k not in ("architectures", "model_type")})))


def _key(cfg: dict) -> tuple:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in cfg.items()))


def video_needs(cfg: VideoConfig, transformer_config: dict, vae_config: dict, text_encoder_config: dict) -> list[Need]:
    """Memory of one video job at the largest clip ``cfg.limits`` allow, on the job's GPU."""
    b, vb = DTYPE_BYTES[cfg.dtype], DTYPE_BYTES[cfg.vae_dtype]
    n_tr = _params("transformer", _key(transformer_config))
    n_te = _params("text_encoder", _key(text_encoder_config))
    n_vae = _params("vae", _key(vae_config))
    w, h = largest_frame(cfg)
    frames = cfg.limits.max_frames_per_clip
    lf, lh, lw, tokens = latent_grid(frames, w, h, vae_config, transformer_config)
    dim = transformer_config["num_attention_heads"] * transformer_config["attention_head_dim"]
    z = vae_config["z_dim"]
    p = vae_config.get("patch_size") or 1
    dec = vae_config.get("decoder_base_dim") or vae_config["base_dim"]
    return [
        Need("transformer weights", n_tr * b, f"{n_tr / 1e9:.2f}B params x {b} B"),
        Need("text encoder weights", n_te * b, f"{n_te / 1e9:.2f}B params x {b} B"),
        Need("vae weights", n_vae * vb, f"{n_vae / 1e6:.0f}M params x {vb} B"),
        Need("latents", 4 * z * lf * lh * lw * 3,
             f"{w}x{h}x{frames}: fp32 {z}x{lf}x{lh}x{lw}, x3 (latent, noise prediction, scheduler state)"),
        Need("transformer activations", tokens * (transformer_config["ffn_dim"] + 6 * dim) * b,
             f"{tokens} tokens x (ffn {transformer_config['ffn_dim']} + 6 x {dim}) x {b} B (one block; estimate)"),
        Need("vae decode activations", 4 * dec * 4 * (h // p) * (w // p) * vb,
             f"4 live maps of {dec} ch x 4 frames x {w // p}x{h // p} x {vb} B (top decoder level; estimate)"),
    ]
