"""The grafted vision-LLM: frozen vision tower -> trained projector -> frozen LLM.

Image features replace the image placeholder positions of the input embeddings before the LLM's first layer
(LLaVA, arXiv:2304.08485; Kimi-VL). The LLM vocabulary is never resized: placeholders are existing special
tokens whose embeddings are overwritten. With no image in the input the LLM is called with ``input_ids``
itself, so logits are bit-identical to the base LLM's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from .image_cache import ImageFeatureCache, cached_image_features, image_keys
from .projector import GraftProjector

MERGE = 4  # MoonViT's 2x2 patch merge: patches per LLM image token


def image_token_counts(image_grid_thw: torch.Tensor) -> list[int]:
    """LLM image tokens of each image: ``t * h * w / MERGE`` of its ``(t, h, w)`` patch grid (int64 ``(images, 3)``,
    as ``Kimi_K25ImageProcessor`` makes it), in order (MoonViT's 2x2 patch merge, Kimi K2.5)."""
    return (image_grid_thw.prod(-1) // MERGE).tolist()


@dataclass(frozen=True)
class ImageTokenIds:
    """Token ids of an image span ``start, image * N, end`` (all existing LLM vocabulary entries), and ``texts``:
    the three tokens' strings, in the same order (each tokenizes to exactly its one id: checked by
    :class:`grafting.processor.GraftProcessor`)."""

    start: int
    image: int
    end: int
    texts: tuple[str, str, str]

    def all(self) -> tuple[int, int, int]:
        """The three ids as a tuple (for masking them out of generation)."""
        return (self.start, self.image, self.end)

    def banned(self) -> dict[int, str]:
        """``{id: text}`` of the three tokens: a :class:`~core.llm_client.CompletionRequest`'s ``banned_tokens``
        (an in-process client bans the ids, vLLM's server the texts as ``bad_words``)."""
        return dict(zip(self.all(), self.texts))


class GraftedVLM(nn.Module):
    """Frozen MoonViT tower + trainable projector + frozen causal LLM.

    Args:
        tower: a ``Kimi_K25VisionModel`` (frozen by the caller or by :meth:`freeze_backbones`).
        projector: :class:`GraftProjector` mapping ``(N, 4, C_vision)`` merge groups to ``(N, H_llm)``.
        llm: any ``*ForCausalLM`` (GLM-4 ``Glm4ForCausalLM``, GLM-4.5 ``Glm4MoeForCausalLM``, Llama/SmolLM2, ...).
        image_token_ids: the placeholder ids.
    """

    def __init__(self, tower: PreTrainedModel, projector: GraftProjector, llm: PreTrainedModel,
                 image_token_ids: ImageTokenIds):
        super().__init__()
        self.tower = tower
        self.projector = projector
        self.llm = llm
        self.image_token_ids = image_token_ids
        # Set by the engine (``vlm.engine.image_cache``); used only outside autograd, so training never sees it.
        self.image_cache: ImageFeatureCache | None = None

    def freeze_backbones(self) -> None:
        """Freeze tower and LLM (eval mode, no grads); only the projector trains. If the LLM uses gradient
        checkpointing, ``enable_input_require_grads`` is needed for projector gradients; we instead feed
        ``inputs_embeds`` that already require grad (they come from the projector)."""
        for m in (self.tower, self.llm):
            m.eval()
            for p in m.parameters():
                p.requires_grad_(False)

    @property
    def device(self) -> torch.device:
        """Device of the LLM's input embeddings (where ``input_ids`` must live)."""
        return self.llm.get_input_embeddings().weight.device

    def image_features(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """Encode packed images into LLM-space tokens.

        With :attr:`image_cache` set and autograd off, each image is looked up by content first and only the
        misses run through tower and projector (:func:`grafting.image_cache.cached_image_features`).

        Args:
            pixel_values: ``(total_patches, 3, 14, 14)`` float, as made by ``Kimi_K25ImageProcessor``.
            image_grid_thw: ``(num_images, 3)`` long, (1, grid_h, grid_w) per image in patches.
        Returns: ``(total_patches // 4, H_llm)`` in the LLM embedding dtype, images in order.
        """
        if self.image_cache is not None and not torch.is_grad_enabled():
            return cached_image_features(self.encode_images, pixel_values, image_grid_thw, self.image_cache,
                                         self.device, self.llm.get_input_embeddings().weight.dtype)
        return self.encode_images(pixel_values, image_grid_thw)

    @torch.inference_mode()
    def features_by_key(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor,
                        want: set[str]) -> dict[str, torch.Tensor]:
        """``{key: features}`` of the packed images whose key (:func:`grafting.image_cache.image_keys`) is in
        ``want``: each image's ``(h * w / 4, H_llm)`` rows in the LLM embedding dtype, on the CPU, the rows the
        LLM gets for it (what :meth:`image_features` gives that image alone). Read from :attr:`image_cache`
        without counting a lookup (:meth:`~grafting.image_cache.ImageFeatureCache.peek`) when there, else
        encoded alone (tower + projector: as a cache miss is). Shapes as in :meth:`image_features`."""
        keys = image_keys(pixel_values, image_grid_thw)
        rows = [int(t * h * w) for t, h, w in image_grid_thw.tolist()]
        out, start = {}, 0
        for i, (key, n) in enumerate(zip(keys, rows)):
            if key in want and key not in out:
                feats = self.image_cache.peek(key) if self.image_cache is not None else None
                if feats is None:
                    feats = self.encode_images(pixel_values[start:start + n], image_grid_thw[i:i + 1])
                out[key] = feats.detach().to("cpu", self.llm.get_input_embeddings().weight.dtype)
            start += n
        return out

    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """Tower + projector on packed images, never cached (shapes as in :meth:`image_features`)."""
        tower_dtype = next(self.tower.parameters()).dtype
        tower_device = next(self.tower.parameters()).device
        out = self.tower(pixel_values.to(tower_device, tower_dtype), grid_thw=image_grid_thw.to(tower_device))
        groups = out.pooler_output  # (N, 4, C)
        proj = self.projector(groups.to(self.projector.device), image_token_counts(image_grid_thw))
        return proj.to(self.device, self.llm.get_input_embeddings().weight.dtype)

    def embed(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
              image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        """Input embeddings with image placeholder positions overwritten by projected image features.

        Args: input_ids ``(B, T)`` long; pixel_values/image_grid_thw as in :meth:`image_features` for all
            images of the batch in reading order (row by row).
        Returns: ``(B, T, H_llm)``.
        Raises: ValueError if the number of placeholder positions differs from the number of image tokens.
        """
        if pixel_values is None:
            return self.llm.get_input_embeddings()(input_ids.to(self.device))
        return self.embed_features(input_ids, self.image_features(pixel_values, image_grid_thw))

    def embed_features(self, input_ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """Input embeddings of ``input_ids`` ``(B, T)`` long with the image placeholder positions overwritten, in
        reading order, by ``feats`` ``(N, H_llm)`` (any float dtype; cast to the embeddings'): what :meth:`embed`
        does with the features it computes, and what a captured prompt's stored features are put back with
        (:mod:`grafting.traffic`). Returns ``(B, T, H_llm)``. Raises ValueError if the number of placeholder
        positions is not ``N`` or ``H_llm`` is not the LLM's width."""
        embeds = self.llm.get_input_embeddings()(input_ids.to(self.device))
        if feats.ndim != 2 or feats.shape[1] != embeds.shape[-1]:
            raise ValueError(f"image features of shape {tuple(feats.shape)}: want (N, {embeds.shape[-1]}), "
                             f"the LLM's width")
        mask = input_ids.to(self.device) == self.image_token_ids.image
        n = int(mask.sum())
        if n != feats.shape[0]:
            raise ValueError(f"{n} image placeholder tokens in the input but {feats.shape[0]} image features")
        # masked_scatter fills in row-major (reading) order, which is the order the images were packed in.
        return embeds.masked_scatter(mask.unsqueeze(-1), feats.to(embeds.dtype))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, **kwargs):
        """LLM forward on grafted embeddings; returns the LLM's ``CausalLMOutputWithPast``.

        With no ``pixel_values`` the LLM is called with ``input_ids`` directly (logits exactly the base LLM's).
        ``labels`` ``(B, T)`` with -100 on ignored positions gives the shifted cross-entropy ``loss``.
        """
        if pixel_values is None:
            return self.llm(input_ids=input_ids.to(self.device), attention_mask=attention_mask, labels=labels, **kwargs)
        embeds = self.embed(input_ids, pixel_values, image_grid_thw)
        return self.llm(inputs_embeds=embeds, attention_mask=attention_mask, labels=labels, **kwargs)
