"""Modules loaded inside vLLM's own process (``.venv-vllm``): they import only torch (and vLLM there), never this
repository's other packages. The speech LM's vLLM server gets this directory on its ``PYTHONPATH``
(``services/engines/vllm_server.py``), so the module names here are unique top-level names."""
