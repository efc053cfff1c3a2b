"""GPU memory the speech engine needs at its limits: the Orpheus LM (a causal LM: ``core.memory``), SNAC, and
the KV cache of every concurrent request at its longest sentence.

A request's context is at most ``max_sentence_chars`` text tokens (a tokenizer gives at most one token per
character of ASCII text; longer sentences are cut) + ``PROMPT_EXTRA`` layout/voice tokens + ``max_frames`` x
``positions`` audio tokens. Requests run concurrently, each with its own cache (no shared batch), so the cache is
counted ``concurrent`` times.
"""

from __future__ import annotations

from functools import lru_cache

from core.memory import DTYPE_BYTES, Need, causal_lm_params, kv_bytes_per_token, meta_params, \
    prefill_activation_bytes

from .config import TTSConfig

PROMPT_EXTRA = 16  # start/end-of-human/ai markers, the voice name and its colon


@lru_cache(maxsize=4)
def _snac_params(cfg_items: tuple) -> int:
    import warnings

    with warnings.catch_warnings():  # snac's import calls torch.jit.script, deprecated in this torch
        warnings.simplefilter("ignore", FutureWarning)
        from snac import SNAC

    cfg = {k: list(v) if isinstance(v, tuple) else v for k, v in cfg_items}
    return meta_params(lambda: SNAC(**cfg))


def tts_needs(cfg: TTSConfig, lm_config: dict, snac_config: dict, concurrent: int) -> list[Need]:
    """Memory of the speech replica: LM weights (``cfg.dtype``), SNAC (fp32), KV of ``concurrent`` requests, and
    one prompt's prefill activations."""
    b = DTYPE_BYTES[cfg.dtype]
    n_lm = causal_lm_params(lm_config)
    n_snac = _snac_params(tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in snac_config.items())))
    prompt = cfg.max_sentence_chars + PROMPT_EXTRA
    context = prompt + cfg.max_frames * cfg.layout.positions
    kv = kv_bytes_per_token(lm_config, b) * context * concurrent
    return [Need("lm weights", n_lm * b, f"{n_lm / 1e9:.2f}B params x {b} B"),
            Need("snac weights", n_snac * 4, f"{n_snac / 1e6:.1f}M params x 4 B"),
            Need("kv cache", kv, f"{concurrent} requests x {context} tokens ({prompt} prompt + {cfg.max_frames} "
                                 f"frames x {cfg.layout.positions}) x {kv_bytes_per_token(lm_config, b)} B"),
            Need("lm activations", prefill_activation_bytes(lm_config, prompt, b, 1, concurrent),
                 f"one layer over a {prompt}-token prompt + fp32 logits of {concurrent} rows (estimate)")]
