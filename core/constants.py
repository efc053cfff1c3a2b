"""Names and numbers that more than one package needs (each written once, here).

- ``SERVED_NAME``: the model name every vLLM server is started under (``--served-model-name``) and that the
  VLM's and the speech LM's request bodies name (``"model"``).
- ``SAMPLE_RATE``: the speech output rate in Hz (SNAC 24 kHz; every format, the websocket's ``sample_rate``).
- ``DTYPE_PATTERN``: the regular expression a config's dtype name must match (``float32`` | ``bfloat16`` |
  ``float16``); :data:`core.memory.DTYPES` maps those names to torch dtypes, :data:`core.memory.DTYPE_BYTES` to
  bytes per element.
"""

SERVED_NAME = "chimera-llm"
SAMPLE_RATE = 24000
DTYPE_PATTERN = "^(float32|bfloat16|float16)$"
