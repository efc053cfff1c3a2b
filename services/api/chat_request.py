"""The ``POST /v1/chat/completions`` request body: which of OpenAI's chat fields are honoured, which are accepted only
at their no-op value, and the strict types (``openai.types.chat.completion_create_params``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from .errors import APIError


class StreamOptions(BaseModel):
    """OpenAI ``stream_options``: ``include_usage`` (a last chunk with ``usage``) and ``include_obfuscation`` (only
    false or null: the service does not pad chunks). Other keys are a 400."""

    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool | None = None
    include_obfuscation: StrictBool | None = None


def _is_number(v: Any, value: float) -> bool:
    """True when ``v`` is a JSON number (not a bool) equal to ``value``."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == value


# OpenAI chat fields the service does not implement, each with the values that mean exactly what leaving the
# field out means (null always does). Any other value is a 400 ``unsupported_parameter`` naming the field.
NO_OP_VALUES: dict[str, Callable[[Any], bool]] = {
    "audio": lambda v: False,
    "frequency_penalty": lambda v: _is_number(v, 0),
    "function_call": lambda v: v == "none",
    "functions": lambda v: False,
    "logit_bias": lambda v: v == {},
    "metadata": lambda v: v == {},
    "modalities": lambda v: v == ["text"],
    "moderation": lambda v: False,
    "parallel_tool_calls": lambda v: False,
    "prediction": lambda v: False,
    "presence_penalty": lambda v: _is_number(v, 0),
    "prompt_cache_key": lambda v: False,
    "prompt_cache_options": lambda v: False,
    "prompt_cache_retention": lambda v: False,
    "reasoning_effort": lambda v: v == "none",
    "safety_identifier": lambda v: False,
    "service_tier": lambda v: v in ("auto", "default"),
    "store": lambda v: v is False,
    "tool_choice": lambda v: v == "none",
    "tools": lambda v: False,
    "user": lambda v: False,
    "verbosity": lambda v: v == "medium",
    "web_search_options": lambda v: False,
}


class ChatRequest(BaseModel):
    """A ``POST /v1/chat/completions`` body. No field is accepted and silently ignored; the rule, per field of
    OpenAI's chat completions request (``openai.types.chat.completion_create_params``):

    - Honoured (declared below): ``model``, ``messages``, ``max_tokens`` / ``max_completion_tokens`` (both given
      and different: 400), ``temperature``, ``top_p``, ``seed``, ``stop``, ``stream``, ``stream_options``
      (``include_usage``; ``include_obfuscation`` only false; only with ``stream: true``), ``n`` (1 only),
      ``logprobs`` / ``top_logprobs``, ``response_format`` (``text``; ``json_object`` and ``json_schema`` on the
      ``vllm`` backend, through vLLM's structured outputs; the ``transformers`` backend answers 400
      ``unsupported_parameter`` for them).
    - Not implemented (:data:`NO_OP_VALUES`): accepted only at null or at the value that means the same as leaving
      it out: ``frequency_penalty`` / ``presence_penalty`` 0, ``logit_bias`` / ``metadata`` ``{}``, ``tool_choice`` / ``function_call`` ``"none"``, ``store`` false,
      ``modalities`` ``["text"]``, ``service_tier`` ``"auto"`` / ``"default"`` (there is one tier),
      ``reasoning_effort`` ``"none"``, ``verbosity`` ``"medium"`` (OpenAI's default). ``audio``, ``functions``,
      ``tools``, ``parallel_tool_calls``, ``prediction``, ``moderation``, ``web_search_options``, ``user``,
      ``safety_identifier``, ``prompt_cache_key``, ``prompt_cache_options`` and ``prompt_cache_retention``: null
      only. Any other value: 400 ``unsupported_parameter``, ``param`` the field.
    - Any field OpenAI does not define (``top_k``, ``repetition_penalty``, a typo): 400 ``unsupported_parameter``,
      whatever its value.
    - Message fields other than ``role`` and ``content`` (``name``, ``tool_calls``, ...) are refused by the
      processor (``grafting/processor.py``) the same way.

    Types are strict: ``"stream": "yes"`` or ``"max_tokens": true`` are 400 ``invalid_value``, not coerced; an
    empty stop sequence (``""`` or ``[""]``) is 400 ``invalid_value``, ``param`` ``stop``.
    Build with :meth:`parse`, which applies the rule above; raises APIError."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None
    messages: list[Any]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: StrictFloat | StrictInt | None = None
    top_p: StrictFloat | StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool | None = False
    n: StrictInt | None = None
    stream_options: StreamOptions | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    response_format: dict | None = None

    @classmethod
    def parse(cls, data: dict[str, Any]) -> "ChatRequest":
        """Validate a JSON body: unsupported fields or values -> APIError 400 ``unsupported_parameter`` (first in
        body order); wrong types -> APIError 400 ``invalid_value``."""
        for key, value in data.items():
            if key in cls.model_fields or value is None and key in NO_OP_VALUES:
                continue
            if key in NO_OP_VALUES:
                if NO_OP_VALUES[key](value):
                    continue
                msg = f"{key} is not supported by this service (only null or its no-op default is accepted)"
            else:
                msg = f"{key} is not a supported chat completions parameter"
            raise APIError(400, msg, param=key, code="unsupported_parameter")
        req = validate_model(cls, {k: v for k, v in data.items() if k in cls.model_fields})
        opts = req.stream_options
        if opts is not None and not req.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options",
                           code="unsupported_parameter")
        if opts is not None and opts.include_obfuscation:
            raise APIError(400, "stream_options.include_obfuscation is not supported (only false)",
                           param="stream_options.include_obfuscation", code="unsupported_parameter")
        if "" in ([req.stop] if isinstance(req.stop, str) else req.stop or []):
            raise APIError(400, "stop: a stop sequence must not be empty", param="stop", code="invalid_value")
        if None not in (req.max_tokens, req.max_completion_tokens) and req.max_tokens != req.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens disagree (send one of them)",
                           param="max_tokens", code="invalid_value")
        return req


def validate_model(model: type[BaseModel], data: dict[str, Any]) -> BaseModel:
    """``model.model_validate(data)``; a pydantic error -> APIError 400 whose ``param`` is the request field
    (``stream_options.<key>`` inside stream options; pydantic's union-member tags dropped): an unknown key there
    is ``unsupported_parameter``, a wrong type ``invalid_value``."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        e = err.errors()[0]
        loc = [str(x) for x in e["loc"]]
        param = loc[0] if loc else None
        if loc[:1] == ["stream_options"] and len(loc) > 1:
            param = f"stream_options.{loc[1]}"
        code = "unsupported_parameter" if e["type"] == "extra_forbidden" else "invalid_value"
        raise APIError(400, f"{param}: {e['msg']}", param=param, code=code) from None
