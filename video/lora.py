"""Step-distilled profile (``quality: "fast"``): a LoRA fused into a copy of the Wan transformer, once, at load.

diffusers' ``WanLoraLoaderMixin.load_lora_weights`` reads the LoRA (diffusers/peft keys
``transformer.<module>.lora_A.weight`` / ``lora_B.weight``, or the original Wan / ComfyUI layouts diffusers
converts, e.g. lightx2v's and Kijai's ``diffusion_model.*`` files), ``fuse_lora`` merges ``W + scale * B A``
(peft's ``alpha / rank`` scaling included) into the copy's weights, and ``unload_lora_weights`` drops the peft
layers, leaving a plain fused ``WanTransformer3DModel``. The full-quality transformer is never touched, so no
request ever fuses or unfuses: the engine keeps both copies (the GPU profile's 5B in bf16: +10 GB).
"""

from __future__ import annotations

import copy

from .config import FastProfile


def fast_scheduler(base_scheduler, fast: FastProfile):
    """The fast profile's scheduler, built from ``base_scheduler``'s config: ``euler`` ->
    ``FlowMatchEulerDiscreteScheduler(shift=fast.flow_shift)``, ``unipc`` -> ``UniPCMultistepScheduler`` with
    ``flow_shift`` (flow-matching sigmas, as the full path)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    if fast.scheduler == "euler":
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=base_scheduler.config.num_train_timesteps,
                                               shift=fast.flow_shift)
    return UniPCMultistepScheduler.from_config(base_scheduler.config, flow_shift=fast.flow_shift)


def fused_fast_pipeline(t2v, fast: FastProfile, lora_path: str):
    """A ``WanPipeline`` sharing ``t2v``'s VAE, text encoder and tokenizer, with a deep copy of its transformer
    into which the LoRA at ``lora_path`` (file, directory or hub id; ``fast.weight_name`` inside it) is fused at
    ``fast.lora_scale``, and the fast scheduler. ``t2v`` is unchanged.

    Raises ValueError (no LoRA weights matched the transformer) and OSError (missing file) from diffusers."""
    from diffusers import WanPipeline

    transformer = copy.deepcopy(t2v.transformer)
    pipe = WanPipeline.from_pipe(t2v, transformer=transformer, scheduler=fast_scheduler(t2v.scheduler, fast))
    kw = {"weight_name": fast.weight_name} if fast.weight_name else {}
    pipe.load_lora_weights(lora_path, adapter_name="fast", **kw)
    pipe.fuse_lora(components=["transformer"], lora_scale=fast.lora_scale, adapter_names=["fast"])
    pipe.unload_lora_weights()
    pipe.set_progress_bar_config(disable=True)
    return pipe
