"""Post-training quantization of a family's language model with measured fidelity (``chimera quantize``).

The KL divergence of the quantized model's next-token distribution from the full-precision one decides which
units (a Llama layer's fused ``qkv``, ``o``, ``gate_up`` and ``down`` projections) are quantized; the checkpoint is
compressed-tensors (llm-compressor, vllm-project/llm-compressor), which vLLM serves.

- :mod:`core.quant.schemes`: the schemes and which host can serve each (refused with the reason).
- :mod:`core.quant.units`: a Llama model's choosable units.
- :mod:`core.quant.kld`: llama.cpp's ``--kl-divergence`` statistics (``llama-perplexity``).
- :mod:`core.quant.search`: layer selection (none, all, per-unit sensitivity, greedy joint search, random).
- :mod:`core.quant.fidelity`: ``fidelity.json`` (the report and the reference's hash) and its checks.
- :mod:`core.quant.report`: the fidelity table.
- :mod:`core.quant.prompts`: the prompt file (``prompts.safetensors``) the family writes for the worker.
- :mod:`core.quant.runner`: runs the worker in its own environment (``.venv-quant``, built by ``make install``).
- :mod:`core.quant.worker`: the worker (llm-compressor; imported only in ``.venv-quant``).

Everything but the worker imports only torch and the standard library, so it runs in every environment.
"""
