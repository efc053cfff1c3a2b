"""Serving-engine processes shared by the model families (the VLM's LLM now, the speech LM next).

A neutral package, importable by model code (``grafting/``, ``audio/``) and by ``services/`` alike: it holds no
model math and imports neither. ``llmproc.process`` starts and supervises an OpenAI-compatible engine server
(vLLM's) in its own process group; ``llmproc.client`` talks to it over HTTP.
"""
