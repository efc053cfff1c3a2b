"""The raw bytes of one token, for OpenAI's logprob ``bytes`` (the tokens' bytes, joined, are the UTF-8 answer).

``tokenizer.decode([id]).encode()`` is wrong for a token that holds part of a multi-byte character: decoding it
alone gives U+FFFD, so ``EF BF BD`` instead of its own bytes (SmolLM2 splits an emoji over two tokens). A
byte-level BPE (GPT-2's scheme: SmolLM2, GLM-4, Llama 3) spells each token as printable characters, one per raw
byte (``bytes_to_unicode``); this inverts that map. Added tokens (``<|im_end|>``, image tokens) are plain text:
their UTF-8. A tokenizer that is not byte-level falls back to the UTF-8 of the decoded token.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode`` inverted: the printable character standing for each byte -> the byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    from tokenizers import decoders

    return isinstance(backend.decoder, decoders.ByteLevel)


class TokenBytes:
    """``TokenBytes(tokenizer)(token_id)`` -> the token's raw bytes (see the module docstring); cached per id.
    ``tokenizer``: a Hugging Face tokenizer. Never raises for an id of the vocabulary."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.byte_level = _is_byte_level(tokenizer)
        self.added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        """The bytes of ``token_id``."""
        out = self._cache.get(token_id)
        if out is None:
            out = self._cache[token_id] = self._bytes(token_id)
        return out

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode("utf-8")
        if self.byte_level:
            table = _unicode_to_byte()
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        return self.tokenizer.decode([token_id]).encode("utf-8")
