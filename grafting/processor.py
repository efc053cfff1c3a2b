"""Messages -> model inputs: chat template, image placeholders, pixel values.

OpenAI-style messages (``system``/``developer``/``user``/``assistant``; content a string or a list of
``text``/``image_url``/``image`` parts) are rendered with the LLM's own chat template. Text from the messages is
always tokenized as plain text: the tokenizer's control tokens (``<|im_start|>``, ``<|endoftext|>``, ...) typed in
it never become control ids, so a client cannot forge turns; only the template's own tokens and the image
placeholders this module inserts are control ids. Each image becomes the
span ``<start> <image>*N <end>`` with ``N = grid_h * grid_w / 4`` (MoonViT's 2x2 patch merge), pixels made by
transformers' ``Kimi_K25ImageProcessor`` so real checkpoints see the pixels they were trained on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image
from transformers.utils.chat_template_utils import encode_marked_chat, mark_control_tokens

from core.media import ImageInputError, load_image_url
from core.validate import InputError, check_messages

from .model import ImageTokenIds, image_token_counts

ROLES = {"system", "developer", "user", "assistant"}
# The message and content-part keys that are honoured. The chat template renders no other (OpenAI's ``name``,
# ``tool_calls``, ``refusal``, ...), so any other key with a value other than null is refused, never ignored.
MESSAGE_KEYS = {"role", "content"}
PART_KEYS = {"text": {"type", "text"}, "image_url": {"type", "image_url"}, "image": {"type", "image"}}


class PromptError(InputError):
    """A malformed conversation (HTTP 400 unless ``status_code`` says otherwise). ``param`` names the offending
    field (default ``messages``); ``code`` is stable (default ``invalid_messages``)."""

    def __init__(self, message: str, param: str | None = "messages", code: str | None = "invalid_messages",
                 status_code: int = 400):
        super().__init__(message, param, code, status_code)


@dataclass
class Prompt:
    """Model inputs for one conversation.

    input_ids: ``(1, T)`` long. pixel_values: ``(P, 3, 14, 14)`` float or None. image_grid_thw: ``(I, 3)`` long
    or None. num_image_tokens: LLM positions taken by images (included in T).
    """

    input_ids: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    num_image_tokens: int = 0
    images: list[Image.Image] = field(default_factory=list, repr=False)

    @property
    def num_tokens(self) -> int:
        """Prompt length in tokens (T)."""
        return int(self.input_ids.shape[1])


@dataclass
class ImageLimitsView:
    """The image limits the processor enforces (bytes, pixels, count, allowed remote hosts)."""

    max_image_bytes: int = 10 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096
    max_images: int = 4
    allowed_image_hosts: tuple[str, ...] = ()


class GraftProcessor:
    """Turns OpenAI-style messages into :class:`Prompt` for :class:`~grafting.model.GraftedVLM`.

    Args:
        tokenizer: the LLM's tokenizer (with chat template). image_processor: ``Kimi_K25ImageProcessor``.
        image_tokens: the three placeholder strings (must each be one existing token).
        limits: image limits; max_prompt_tokens: longest prompt accepted (an image span is never truncated:
            over-long prompts are refused).
    Raises (from :meth:`__call__`): PromptError (400) for malformed messages, typed placeholder text, too long
        prompts; ImageInputError (400/413/415) for bad images.
    """

    def __init__(self, tokenizer, image_processor, image_tokens: tuple[str, str, str],
                 limits: ImageLimitsView | None = None, max_prompt_tokens: int = 4096):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token_strings = tuple(image_tokens)
        ids = []
        for s in self.image_token_strings:
            tid = tokenizer.convert_tokens_to_ids(s)
            if tid is None or tid == tokenizer.unk_token_id or len(tokenizer(s, add_special_tokens=False).input_ids) != 1:
                raise ValueError(f"image token {s!r} is not a single token of the LLM vocabulary")
            ids.append(tid)
        self.image_token_ids = ImageTokenIds(*ids, self.image_token_strings)
        self.limits = limits or ImageLimitsView()
        self.max_prompt_tokens = max_prompt_tokens
        control = sorted((t.content for t in tokenizer.added_tokens_decoder.values()
                          if t.special or not t.content.isspace()), key=len, reverse=True)
        self._control_re = re.compile("|".join(map(re.escape, control)) or "(?!)")  # longest first; (?!): none

    # -- messages ---------------------------------------------------------------------------------
    def _check_text(self, text: Any, param: str) -> str:
        if not isinstance(text, str):
            raise PromptError(f"{param} must be a string", param)
        for s in self.image_token_strings:
            if s in text:
                raise PromptError(f"{param} contains the reserved image placeholder text {s!r}; "
                                  "send images as image_url parts", param, "reserved_token_text")
        return text

    def normalize(self, messages: Any) -> tuple[list[dict], list[Any]]:
        """Validate messages; return (chat-template messages with string content, image sources in order).

        Text parts of one message are joined with newlines; each image part becomes one image-token marker
        that :meth:`__call__` expands into the full span.
        """
        check_messages(messages, PromptError)
        conv, images = [], []
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict):
                raise PromptError(f"messages[{i}] must be an object", f"messages[{i}]")
            for key, value in msg.items():
                if key not in MESSAGE_KEYS and value is not None:
                    raise PromptError(f"messages[{i}].{key} is not supported (only role and content)",
                                      f"messages[{i}].{key}", "unsupported_parameter")
            role = msg.get("role")
            if not isinstance(role, str) or role not in ROLES:  # a list or object is unhashable: no set lookup
                raise PromptError(f"messages[{i}].role {role!r} is not one of system, developer, user, assistant",
                                  f"messages[{i}].role", "invalid_role")
            content = msg.get("content")
            if content is None and role == "assistant":
                content = ""
            if isinstance(content, str):
                text = self._check_text(content, f"messages[{i}].content")
            elif isinstance(content, list):
                if not content:  # as OpenAI: a list of parts holds at least one
                    raise PromptError(f"messages[{i}].content is an empty list (send at least one text or image "
                                      "part)", f"messages[{i}].content")
                pieces = []
                for j, part in enumerate(content):
                    p = f"messages[{i}].content[{j}]"
                    kind = part.get("type") if isinstance(part, dict) else None
                    if isinstance(kind, str) and kind in PART_KEYS:
                        for key, value in part.items():
                            if key not in PART_KEYS[kind] and value is not None:
                                raise PromptError(f"{p}.{key} is not supported in a {kind} part", f"{p}.{key}",
                                                  "unsupported_parameter")
                    if kind == "text":
                        pieces.append(self._check_text(part.get("text"), p + ".text"))
                    elif kind in ("image_url", "image"):
                        if role != "user":
                            raise PromptError(f"{p}: images are accepted in user messages only", p)
                        if kind == "image_url":
                            iu = part.get("image_url")
                            for key, value in (iu.items() if isinstance(iu, dict) else ()):
                                if key != "url" and not (key == "detail" and value in (None, "auto")):
                                    raise PromptError(f"{p}.image_url.{key} {value!r} is not supported (images are "
                                                      "always seen at full detail: detail auto only)",
                                                      f"{p}.image_url.{key}", "unsupported_parameter")
                            url = iu.get("url") if isinstance(iu, dict) else iu
                            images.append((url, p + ".image_url.url"))
                        else:
                            if not isinstance(part.get("image"), Image.Image):
                                raise PromptError(f"{p}.image must be a PIL image", p)
                            images.append((part["image"], p))
                        pieces.append(self.image_token_strings[1])
                    else:
                        raise PromptError(f"{p}.type {kind!r} is not supported (text, image_url)", p + ".type")
                text = "\n".join(pieces)
            else:
                raise PromptError(f"messages[{i}].content must be a string or a list of parts",
                                  f"messages[{i}].content")
            conv.append({"role": "system" if role == "developer" else role, "content": text})
        if len(images) > self.limits.max_images:
            raise PromptError(f"{len(images)} images in the request, over the limit of {self.limits.max_images}",
                              "messages", "too_many_images")
        return conv, images

    def load_images(self, sources: list[Any]) -> list[Image.Image]:
        """Decode image sources (URL strings or PIL images) with the limits. Raises ImageInputError."""
        out = []
        for src, param in sources:
            if isinstance(src, Image.Image):
                w, h = src.size
                if w * h > self.limits.max_image_pixels:
                    raise ImageInputError(f"image is {w}x{h}, over the pixel limit", param, "image_too_large", 413)
                out.append(src.convert("RGB"))
            else:
                out.append(load_image_url(src, self.limits.max_image_bytes, self.limits.max_image_pixels,
                                          self.limits.allowed_image_hosts, param=param))
        return out

    # -- tokens -----------------------------------------------------------------------------------
    def template_ids(self, conv: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``conv`` (``normalize``'s output: string contents) under the LLM's chat template, with the
        text of the messages tokenized as plain text.

        Control tokens are the tokenizer's added tokens (special ones, and non-special ones other than pure
        whitespace). When no message text contains one, the ids are exactly ``apply_chat_template``'s (what the
        base LLM gets). Otherwise the text's control tokens are marked and encoded as plain-text pieces by
        transformers' own mechanism for ``apply_chat_template(sanitize_control_tokens=True)``
        (``mark_control_tokens`` / ``encode_marked_chat``), while the template's tokens and the image markers
        :meth:`normalize` inserted stay control ids. Raises PromptError (400, ``reserved_token_text``) in the
        one case transformers cannot sanitize: a token that the tokenizer also produces from its plain text."""
        marker = self.image_token_strings[1]  # an image part's marker, inserted by normalize (never client text)
        if any(self._control_re.search(piece) for m in conv for piece in m["content"].split(marker)):
            conv = [dict(m, content=marker.join(mark_control_tokens(piece, self._control_re)
                                                for piece in m["content"].split(marker))) for m in conv]
            rendered = self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                                          tokenize=False)
            try:
                return encode_marked_chat(self.tokenizer, rendered)
            except ValueError as exc:
                raise PromptError(f"messages hold text that cannot be sent as plain text: {exc}", "messages",
                                  "reserved_token_text") from None
        out = self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tokenize=True)
        if hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)

    def __call__(self, messages: Any, add_generation_prompt: bool = True) -> Prompt:
        """Build the :class:`Prompt` for an OpenAI-style conversation (see class docstring for errors)."""
        conv, sources = self.normalize(messages)
        images = self.load_images(sources)
        ids = self.template_ids(conv, add_generation_prompt)
        if not images:
            return self._finish(ids, None, None, 0, [])
        feats = self.image_processor(images=images, return_tensors="pt")
        grid = feats["image_grid_thw"]
        per_image = image_token_counts(grid)
        return self._finish(self._expand(ids, per_image), feats["pixel_values"], grid, sum(per_image), images)

    def _expand(self, ids: list[int], per_image: list[int]) -> list[int]:
        """``ids`` with the ``k``-th image marker expanded into ``<start> <image>*per_image[k] <end>``. Raises
        PromptError when the chat template kept another number of markers than ``len(per_image)``."""
        t = self.image_token_ids
        expanded, k = [], 0
        for tid in ids:
            if tid == t.image:
                if k < len(per_image):
                    expanded += [t.start] + [t.image] * per_image[k] + [t.end]
                k += 1
            else:
                expanded.append(tid)
        if k != len(per_image):  # the chat template dropped or duplicated a marker
            raise PromptError(f"chat template kept {k} of {len(per_image)} image markers", "messages")
        return expanded

    def ids_with_image_rows(self, messages: Any, rows: list[int]) -> torch.Tensor:
        """The ``(1, T)`` long prompt ids of a conversation whose images are given by their number of LLM rows
        instead of pixels: each ``{"type": "image_ref", "key": ...}`` part (a captured conversation,
        :mod:`grafting.traffic`) becomes the span of ``rows[k]`` placeholders that an image part with that many
        projected rows gets from :meth:`__call__`, the rest validated and rendered as :meth:`__call__` does.
        Raises PromptError as :meth:`__call__` does (malformed messages, too long), and when the number of
        ``image_ref`` parts is not ``len(rows)``."""
        stand_in = Image.new("RGB", (1, 1))  # normalize checks an image part's kind only; its pixels are unused
        refs = 0

        def part(p: Any) -> Any:
            nonlocal refs
            if isinstance(p, dict) and p.get("type") == "image_ref":
                refs += 1
                return {"type": "image", "image": stand_in}
            return p

        messages = [dict(m, content=[part(p) for p in m["content"]])
                    if isinstance(m, dict) and isinstance(m.get("content"), list) else m for m in messages]
        if refs != len(rows):
            raise PromptError(f"{refs} image references but {len(rows)} images' rows", "messages")
        conv, _ = self.normalize(messages)
        ids = self._expand(self.template_ids(conv), list(rows))
        return self._finish(ids, None, None, sum(rows), []).input_ids

    def _finish(self, ids, pixel_values, grid, n_image_tokens, images) -> Prompt:
        if len(ids) > self.max_prompt_tokens:
            raise PromptError(f"prompt is {len(ids)} tokens (images included), over the limit of "
                              f"{self.max_prompt_tokens}", "messages", "context_length_exceeded")
        return Prompt(torch.tensor([ids], dtype=torch.long), pixel_values, grid, n_image_tokens, images)
