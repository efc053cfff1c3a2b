"""Chimera's ground layer: what every model family and the service share, importing no family.

- :mod:`core.validate`: the one ``InputError`` base (``status_code``, ``param``, ``code``), the Unicode checks,
  the seed range.
- :mod:`core.media`: the one image decoder (PNG, JPEG, WebP, GIF; one error-code set) and data-URL parser.
- :mod:`core.memory`: memory accounting (``Need``, dtype bytes, KV-cache and activation math, meta-device
  parameter counts).
- :mod:`core.llm_client`: the language-model client protocol and its errors; :mod:`core.vllm_client`: the
  pooled HTTP client of a vLLM OpenAI server; :mod:`core.vllm_marker`: vLLM's mixed-prompt marker id and the
  embedding rows an EAGLE-3 head needs for it.
- :mod:`core.config`: the strict config base, ``ConfigFieldError``, ``VLLMOptions``, the path resolver.
- :mod:`core.smollm2`: the SmolLM2 checkpoint and tokenizer the cpu profile's models share.
- :mod:`core.constants`: names and numbers more than one package needs.

Layers: ``core`` <- families (``grafting``, ``video``, ``audio``; none imports another) <- ``services``.
"""
