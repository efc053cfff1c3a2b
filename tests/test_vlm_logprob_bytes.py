"""Logprob ``bytes`` are each token's raw bytes: joined, they are the UTF-8 of the answer, also where a token holds
only part of a multi-byte character (SmolLM2 spells an emoji or a CJK character over 2-3 byte-level tokens;
decoding such a token alone gives U+FFFD, whose UTF-8 ``EF BF BD`` is not its bytes).

The cpu profile's VLM (real SmolLM2-135M-Instruct weights and tokenizer) on the ``transformers`` backend, in this
process behind the real ingress app (``httpx.ASGITransport``), driven by ``openai.AsyncOpenAI``; greedy answers to
prompts chosen because they come out with accented letters, an emoji and CJK characters (asserted, so a changed
model cannot make the test vacuous).
"""

from __future__ import annotations

import asyncio
import copy

import httpx
import openai
import pytest

from grafting.token_bytes import TokenBytes
from services.api.app import build_app
from services.deployments.backends import LocalBackend
from services.deployments.vlm import Deployment
from services.config.profiles import parse_profile

REPLACEMENT = "\ufffd".encode()  # EF BF BD
# (prompt, max_tokens, characters the greedy answer holds; ends on a whole character)
CASES = [("Write the word café with an emoji.", 16, ("é", "\U0001f31f")),
         ('Translate "thank you" into Chinese characters.', 8, ("愉", "悦", "！"))]


@pytest.fixture(scope="module")
def app(profile, model_dir):
    data = profile.model_dump(mode="json")
    data["video"] = data["tts"] = None
    prof = parse_profile(data)
    section = copy.deepcopy(prof.vlm.model_dump(mode="json"))
    section["engine"]["backend"] = "transformers"
    dep = Deployment(section, str(model_dir))
    yield build_app(prof, {"vlm": LocalBackend(dep)}), dep
    dep.engine.close()


def test_token_bytes_join_to_the_utf8_of_any_text(model_dir):
    """On the real tokenizer, straight from its ids: accented letters, emoji, CJK, a special token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir / "vlm" / "llm")
    tb = TokenBytes(tok)
    assert tb.byte_level
    partial = 0
    for text in ("café naïve résumé", "sea 🌊🐳 waves 😀", "中文 你好，世界！", "mixed: Ωμέγα — ñ ü 한국어"):
        ids = tok.encode(text, add_special_tokens=False)
        partial += sum(REPLACEMENT in tok.decode([i]).encode() for i in ids)
        assert b"".join(tb(i) for i in ids) == text.encode("utf-8"), text
    assert partial > 0  # some tokens are parts of characters
    assert tb(tok.convert_tokens_to_ids("<|im_end|>")) == b"<|im_end|>"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_logprob_bytes_join_to_the_answer_utf8(app, stream):
    asgi, dep = app
    tb = TokenBytes(dep.engine.tokenizer)

    async def main():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://test", timeout=600)
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0)
        out = []
        try:
            for prompt, n, _ in CASES:
                kw = dict(model="chimera-vlm", messages=[{"role": "user", "content": prompt}], max_tokens=n,
                          temperature=0, logprobs=True, top_logprobs=5)
                if stream:
                    text, entries = "", []
                    async for ch in await client.chat.completions.create(stream=True, **kw):
                        if ch.choices:
                            text += ch.choices[0].delta.content or ""
                            entries += ch.choices[0].logprobs.content if ch.choices[0].logprobs else []
                else:
                    r = await client.chat.completions.create(**kw)
                    text, entries = r.choices[0].message.content, r.choices[0].logprobs.content
                out.append((text, entries))
        finally:
            await client.close()
        return out

    vocab = {tb(i): i for i in range(len(dep.engine.tokenizer))}  # bytes -> an id (for the alternatives)
    for (prompt, n, chars), (text, entries) in zip(CASES, asyncio.run(main())):
        assert all(c in text for c in chars), (prompt, text)
        assert len(entries) == n
        assert b"".join(bytes(e.bytes) for e in entries) == text.encode("utf-8"), (prompt, text)
        partial = 0
        for e in entries:
            assert len(e.top_logprobs) == 5 and bytes(e.top_logprobs[0].bytes) == bytes(e.bytes)  # greedy: top-1
            for t in [e, *e.top_logprobs]:
                b = bytes(t.bytes)
                assert REPLACEMENT not in b and b in vocab, (prompt, t)  # a token's own bytes, never U+FFFD's
                partial += t.token == "\ufffd"
        assert partial > 0  # the answer and its alternatives hold tokens that are parts of characters
