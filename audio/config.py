"""Configuration of the Orpheus-style speech family (the ``tts.engine`` block of a profile).

The token layout is configuration, so the real profile uses Orpheus' Llama-3 ids and the cpu profile a small
random-weight ``LlamaForCausalLM`` whose special and audio ids sit above SmolLM2's 49,152-token vocabulary.
Paths are hub ids or directories; relative directories are resolved against the profile's model directory.
Method: Orpheus TTS (canopyai/Orpheus-TTS) with the SNAC 24 kHz codec (hubertsiuzdak/snac).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from core.config import ConfigFieldError, Strict, VLLMOptions, check_quantized_backend
from core.constants import DTYPE_PATTERN
from core.validate import SEED_LIMIT

ORPHEUS_VOICES = ["tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe"]
ORPHEUS_TAGS = ["laugh", "chuckle", "sigh", "cough", "sniffle", "groan", "yawn", "gasp"]
DEFAULT_SPEED = 1.0  # the speed of a request (or websocket session) that sends none


class TokenLayoutConfig(Strict):
    """Special ids and audio-token placement of an Orpheus-layout LM (defaults: the real Llama-3 ids).

    Audio token at frame position ``p`` (0..positions-1) with code ``c`` (0..codebook_size-1) has id
    ``audio_start + p * codebook_size + c``. ``end_of_text`` closes the text turn (Llama-3 ``<|eot_id|>``).
    """

    start_of_speech: int = 128257
    end_of_speech: int = 128258
    start_of_human: int = 128259
    end_of_human: int = 128260
    start_of_ai: int = 128261
    end_of_ai: int = 128262
    pad: int = 128263
    end_of_text: int = 128009
    audio_start: int = 128266
    codebook_size: int = Field(4096, gt=0)
    positions: int = Field(7, gt=0)


class SamplingConfig(Strict):
    """Default sampling (most Orpheus servers: temperature 0.4-0.6, top_p 0.9-0.95, repetition penalty 1.1)."""

    temperature: float = Field(0.6, ge=0)
    top_p: float = Field(0.95, gt=0, le=1)
    repetition_penalty: float = Field(1.1, ge=1)


class LoopGuardConfig(Strict):
    """Loop guard: fires when the last ``window_frames`` frames repeat with a period of at most
    ``max_period_frames`` frames (a repeated frame is period 1). On firing, the sentence is rolled back to
    where the loop began and retried with ``repetition_penalty + penalty_step``, at most ``max_retries``
    times; then it is cut short there. Frames are held back only ``window_frames`` frames (what a retry
    may discard)."""

    enabled: bool = True
    window_frames: int = Field(8, ge=2)
    max_period_frames: int = Field(4, ge=1)
    max_retries: int = Field(1, ge=0)
    penalty_step: float = Field(0.3, gt=0)

    @model_validator(mode="after")
    def _period_fits(self):
        if 2 * self.max_period_frames > self.window_frames:
            raise ValueError("loop_guard.window_frames must hold at least two periods (2 * max_period_frames)")
        return self


class TTSBuild(Strict):
    """Sizes of the small random-weight Orpheus-layout ``LlamaForCausalLM`` the cpu profile builds (seeded).
    The SNAC decoder is the full 24 kHz architecture with random weights. Head size ``hidden_size /
    num_attention_heads`` = 32: the smallest vLLM's CPU attention supports (32..512), so vLLM can serve it."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    max_position_embeddings: int = 4096
    seed: int = 0


class TTSConfig(Strict):
    """Engine config of the Orpheus-style speech family.

    ``lm``: Orpheus-layout causal LM (hub id or dir); ``tokenizer``: its tokenizer (defaults to ``lm``);
    ``snac``: SNAC 24 kHz dir holding ``config.json`` + ``pytorch_model.bin`` (``SNAC.from_pretrained``).
    ``snac_noise``: SNAC's decoder noise blocks (random unless seeded; off gives deterministic audio).
    ``frames_per_char`` / ``min_frames`` / ``max_frames``: maximum audio length of a sentence, in 2048-sample
    frames (85.3 ms at 24 kHz), from its character count. ``chunk_frames``: frames per SNAC decode after the
    first (the first frame is emitted as soon as its 2 right neighbours exist). ``snac_batch_frames``: the SNAC
    windows of concurrent streams waiting at the same time are decoded in one batched call of at most this many
    frames by one shared decoder worker (:class:`audio.snac_stream.BatchedSnacDecoder`; a GPU decodes a batch in
    about the time of one window; on a CPU a call beyond a few dozen frames costs more per window, its
    activations no longer fit the caches); 0: each stream decodes its own windows in its own thread.
    ``max_sentence_chars``:
    longer sentences are cut at a comma or space. ``seed``: default sampling seed (None: random).

    ``backend``: who runs the LM's decode: ``transformers`` (our KV-cache loop in the replica, one per synthesis:
    the exact reference) or ``vllm`` (vLLM's OpenAI server in its own venv and process, options in ``vllm``, the same
    :class:`core.config.VLLMOptions` as the VLM's; concurrent syntheses are batched there, the frame constraint
    runs as a vLLM logits processor, see ``audio/lm_stream.py``). ``max_batch_size``: vLLM's ``--max-num-seqs``
    (sentences decoded together; more wait in vLLM's queue). Long input is never cut at a token cap: it is split
    into sentences of at most ``max_sentence_chars``, synthesized in order, and ``max_frames`` caps each sentence.
    vLLM's context (``--max-model-len``) is :meth:`max_model_len`.
    """

    lm: str = "canopylabs/orpheus-3b-0.1-ft"
    tokenizer: str | None = None
    snac: str = "hubertsiuzdak/snac_24khz"
    snac_noise: bool = False
    dtype: str = Field("float32", pattern=DTYPE_PATTERN)
    device: str = "cpu"
    layout: TokenLayoutConfig = TokenLayoutConfig()
    sampling: SamplingConfig = SamplingConfig()
    loop_guard: LoopGuardConfig = LoopGuardConfig()
    voices: list[str] = ORPHEUS_VOICES
    default_voice: str = "tara"
    tags: list[str] = ORPHEUS_TAGS
    max_input_chars: int = Field(4096, gt=0)
    max_sentence_chars: int = Field(300, ge=20)
    min_speed: float = Field(0.25, gt=0)
    max_speed: float = Field(4.0, gt=0)
    frames_per_char: float = Field(1.75, gt=0)
    min_frames: int = Field(12, ge=1)
    max_frames: int = Field(1200, ge=1)
    chunk_frames: int = Field(4, ge=1)
    snac_batch_frames: int = Field(256, ge=0)
    seed: int | None = None
    build: TTSBuild | None = None
    backend: str = Field("transformers", pattern="^(transformers|vllm)$")
    max_batch_size: int = Field(16, ge=1)
    vllm: VLLMOptions = VLLMOptions()

    def max_model_len(self) -> int:
        """Longest sequence one sentence can need, in tokens: its prompt (at most 4 tokens per character of a
        ``max_sentence_chars`` sentence, byte-level BPE's worst case, plus 64 for the voice and the special ids)
        and ``7 * max_frames`` audio tokens (a retry resubmits kept frames in the prompt and asks only for the
        rest, so the sum stays the same)."""
        return 4 * self.max_sentence_chars + 64 + self.layout.positions * self.max_frames

    @model_validator(mode="after")
    def _defaults_within_limits(self):
        """Every default a request falls back on must pass that request's own check (``audio/validate.py``), else
        every request leaving it out is a 400 about a field it never sent: ``default_voice`` in ``voices``,
        ``voices`` lower-case (a request's voice is matched lower-cased), :data:`DEFAULT_SPEED` within
        ``[min_speed, max_speed]``, ``seed`` with ``|seed| < 2**63``; and ``min_frames <= max_frames``; no ``vllm.speculative`` (below). Raises
        ConfigFieldError naming the key."""
        check_quantized_backend(self.backend, self.vllm)
        if self.vllm.speculative is not None:
            # vllm/v1/sample/logits_processor/__init__.py build_logitsprocs: custom logits processors (the speech
            # server's frame constraint, always loaded) raise at engine start while speculative decoding is on.
            raise ConfigFieldError("vllm.speculative", "the speech LM is served without speculative decoding: vLLM "
                                   "0.32 refuses custom logits processors (its SNAC frame constraint) while "
                                   "speculative decoding is on, so the server would not start")
        upper = [v for v in self.voices if v != v.lower()]
        if upper:
            raise ConfigFieldError("voices", f"{upper} are not lower-case: a request's voice is matched lower-cased, "
                                   "so they could never be chosen")
        if self.default_voice not in self.voices:
            raise ConfigFieldError("default_voice", f"{self.default_voice!r} is not in voices ({self.voices})")
        if self.min_speed > DEFAULT_SPEED:
            raise ConfigFieldError("min_speed", f"{self.min_speed} is over the default speed {DEFAULT_SPEED}")
        if self.max_speed < DEFAULT_SPEED:
            raise ConfigFieldError("max_speed", f"{self.max_speed} is under the default speed {DEFAULT_SPEED}")
        if self.seed is not None and not -SEED_LIMIT < self.seed < SEED_LIMIT:
            raise ConfigFieldError("seed", f"{self.seed} is outside |seed| < 2**63")
        if self.min_frames > self.max_frames:
            raise ConfigFieldError("min_frames", f"{self.min_frames} is over max_frames ({self.max_frames})")
        return self
