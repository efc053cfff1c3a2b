"""Request checks for speech, shared by the HTTP/websocket front end and the engine (no torch import).

Every failure raises :class:`SpeechInputError` (a ValueError -> HTTP 400) naming the offending parameter.
"""

from __future__ import annotations

from core.validate import InputError, check_seed, find_invalid_unicode

from .config import TTSConfig
from .text import clean_sentence, has_speech

RESPONSE_FORMATS = ("wav", "pcm", "flac", "mp3", "opus")
STREAM_FORMATS = ("audio", "sse")
# Every field of POST /v1/audio/speech that has an effect (OpenAI's, then ours); any other is refused.
SPEECH_FIELDS = ("model", "input", "voice", "response_format", "speed", "stream_format", "seed", "stream")
# Fields of the websocket's session.update "session" object.
SESSION_FIELDS = ("model", "voice", "speed", "seed")
_UNSUPPORTED_HINTS = {
    "instructions": "Orpheus takes no voice instructions: pick a 'voice' and put emotion tags such as <laugh> or "
                    "<sigh> in the text",
}


class SpeechInputError(InputError):
    """Bad speech input (HTTP 400); ``param`` names the request field (``input``, ``voice``, ``speed`` ...), ``code``
    its stable reason. Takes ``(message, param, code)``."""


def check_fields(obj: dict, allowed: tuple[str, ...], where: str = "") -> None:
    """Every key of ``obj`` must be in ``allowed``: a field we do not implement is never accepted and ignored.
    Raises SpeechInputError ``unsupported_parameter`` naming the first other key (``where`` prefixes it:
    ``session.instructions``)."""
    for name in obj:
        if name not in allowed:
            param = f"{where}.{name}" if where else str(name)
            hint = _UNSUPPORTED_HINTS.get(name, "supported: " + ", ".join(allowed))
            raise SpeechInputError(f"'{param}' is not supported ({hint})", param, "unsupported_parameter")


def check_unicode(value, param: str) -> None:
    """Raise SpeechInputError ``invalid_unicode`` when :func:`find_invalid_unicode` finds a bad string in
    ``value`` (the tokenizer cannot read it)."""
    where = find_invalid_unicode(value, param)
    if where is not None:
        where = where.encode("utf-8", "backslashreplace").decode()
        raise SpeechInputError(f"'{where}' holds a lone UTF-16 surrogate, which is not valid Unicode text "
                               "(send UTF-8 text)", where, "invalid_unicode")


def check_text(cfg: TTSConfig, text) -> str:
    """``text`` must be a non-blank string of valid Unicode (:func:`check_unicode`) of at most
    ``cfg.max_input_chars`` characters. Raises SpeechInputError (``param`` ``input``):
    ``missing_required_parameter`` for None (absent), ``invalid_type``, ``invalid_unicode``, ``empty_input`` or
    ``input_too_long``."""
    if text is None:
        raise SpeechInputError("'input' is required: the text to speak", "input", "missing_required_parameter")
    if not isinstance(text, str):
        raise SpeechInputError("'input' must be a string", "input", "invalid_type")
    check_unicode(text, "input")
    if not text.strip():
        raise SpeechInputError("'input' is empty", "input", "empty_input")
    if len(text) > cfg.max_input_chars:
        raise SpeechInputError(f"'input' has {len(text)} characters; the limit is {cfg.max_input_chars}",
                               "input", "input_too_long")
    return text


def speakable(cfg: TTSConfig, sentence: str) -> bool:
    """True when ``sentence`` keeps something to say once unsupported tags are stripped
    (:func:`audio.text.clean_sentence`, :func:`audio.text.has_speech`). ``"<foo>"`` or ``"<b></b>."`` have
    nothing; ``"<laugh>"`` (a supported tag) does."""
    return has_speech(clean_sentence(sentence, cfg.tags)[0])


def check_speakable(cfg: TTSConfig, sentences: list[str]) -> list[str]:
    """At least one of ``sentences`` must be :func:`speakable`, else ``empty_input``. Returns ``sentences``."""
    if not any(speakable(cfg, s) for s in sentences):
        raise SpeechInputError("'input' has nothing to speak: no word is left once punctuation and unsupported "
                               "tags are removed", "input", "empty_input")
    return sentences


def check_voice(cfg: TTSConfig, voice) -> str:
    """None -> the default voice; else one of ``cfg.voices`` (case-insensitive)."""
    if voice is None:
        return cfg.default_voice
    if not isinstance(voice, str) or voice.lower() not in cfg.voices:
        raise SpeechInputError(f"unknown voice {voice!r}; available: {', '.join(cfg.voices)}", "voice",
                               "unknown_voice")
    return voice.lower()


def check_speed(cfg: TTSConfig, speed) -> float:
    """None -> 1.0; else a number in ``[cfg.min_speed, cfg.max_speed]``."""
    if speed is None:
        return 1.0
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not (cfg.min_speed <= speed <= cfg.max_speed):
        raise SpeechInputError(f"'speed' must be a number between {cfg.min_speed} and {cfg.max_speed}, got {speed!r}",
                               "speed", "invalid_speed")
    return float(speed)


def check_speech(cfg: TTSConfig, voice, speed, seed) -> tuple[str, float, int | None]:
    """The one check of a synthesis' ``voice`` (:func:`check_voice`), ``speed`` (:func:`check_speed`) and ``seed``
    (``core.validate.check_seed``: an integer with ``|seed| < 2**63``, or None); returns them normalised (voice
    lower-cased, None -> the default voice, speed None -> 1.0). Used by the speech router, the websocket session
    and :meth:`audio.engine.TTSEngine.speak`, so each answers alike."""
    return check_voice(cfg, voice), check_speed(cfg, speed), check_seed(seed, SpeechInputError)


def check_format(response_format, stream_format=None) -> tuple[str, str]:
    """``response_format`` in :data:`RESPONSE_FORMATS` (None -> ``mp3``, OpenAI's default),
    ``stream_format`` in :data:`STREAM_FORMATS` (None -> ``audio``). Returns both."""
    rf = "mp3" if response_format is None else response_format
    if rf not in RESPONSE_FORMATS:
        raise SpeechInputError(f"unsupported response_format {response_format!r}; use one of "
                               f"{', '.join(RESPONSE_FORMATS)}", "response_format", "unsupported_format")
    sf = "audio" if stream_format is None else stream_format
    if sf not in STREAM_FORMATS:
        raise SpeechInputError(f"unsupported stream_format {stream_format!r}; use audio or sse", "stream_format",
                               "unsupported_format")
    return rf, sf
