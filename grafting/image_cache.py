"""Image-embedding cache: a repeated image skips the vision tower and the projector.

Key (the choice, and why): a BLAKE2b-128 digest of the tower's exact input for one image - its preprocessed
``pixel_values`` rows (the decoded pixels after the profile's resize, rescale, normalisation and patching by
``Kimi_K25ImageProcessor``), their dtype and shape, and its ``(t, h, w)`` patch grid. So:

- the same picture sent again, or re-encoded losslessly (PNG <-> WebP lossless, another PNG compression level,
  a different data-URL wrapper), decodes to the same pixels and hits;
- every preprocessing setting (``max_image_side``, the processor's mean/std, patch size) is part of the key by
  construction, since it changes the tower input: no list of settings to keep in sync, no stale hit after a
  profile change;
- a lossy re-encode (another JPEG quality) changes pixels and misses, as it must (the features differ).

The cache lives in one engine (one model), so tower/projector weights are fixed for its lifetime and are not in
the key. Values are the projected features of one image, ``(h * w / 4, H_llm)`` in the LLM embedding dtype,
stored on the CPU; the cache is bounded by the bytes of those tensors (``numel * element_size``) and evicts the
least recently used entry first. Misses are encoded one image at a time,
so a hit returns exactly the values a fresh encode of that image gives (see :func:`cached_image_features`);
bit-identical embeddings are also what lets vLLM's prefix cache (keyed by the embeddings) hit for a repeated
image.

Thread-safe: the transformers backend prefills in the batcher's thread while other requests prepare in worker
threads.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheStats:
    """Counters of one :class:`ImageFeatureCache` since it was made: ``hits``/``misses`` (images looked up),
    ``evictions`` (entries dropped to stay within the bound), ``entries``, ``bytes`` held now, ``max_bytes``."""

    hits: int
    misses: int
    evictions: int
    entries: int
    bytes: int
    max_bytes: int

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict (what a Ray Serve replica returns to the ingress)."""
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions, "entries": self.entries,
                "bytes": self.bytes, "max_bytes": self.max_bytes}


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements (``numel * element_size``), the unit the cache is bounded in."""
    return t.numel() * t.element_size()


class ImageFeatureCache:
    """LRU map from image key (:func:`image_keys`) to that image's projected features, bounded by bytes.

    Args: max_bytes: upper bound on the summed bytes of the stored tensors (> 0). A tensor larger than the bound
        is never stored (its lookup stays a miss) rather than emptying the cache for it.
    Raises: ValueError if ``max_bytes`` is not positive.
    """

    def __init__(self, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self.max_bytes = int(max_bytes)
        self._items: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._hits = self._misses = self._evictions = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> torch.Tensor | None:
        """The stored features for ``key`` (CPU tensor; marks it most recently used) or None; counts a hit or
        a miss."""
        with self._lock:
            t = self._items.get(key)
            if t is None:
                self._misses += 1
                return None
            self._items.move_to_end(key)
            self._hits += 1
            return t

    def put(self, key: str, features: torch.Tensor) -> bool:
        """Store a CPU copy of ``features`` under ``key``, evicting least recently used entries until the bound
        holds. Returns False (nothing stored) when the tensor alone exceeds ``max_bytes``."""
        value = features.detach().to("cpu", copy=True).contiguous()
        size = tensor_bytes(value)
        if size > self.max_bytes:
            return False
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= tensor_bytes(old)
            while self._items and self._bytes + size > self.max_bytes:
                _, dropped = self._items.popitem(last=False)
                self._bytes -= tensor_bytes(dropped)
                self._evictions += 1
            self._items[key] = value
            self._bytes += size
            return True

    def peek(self, key: str) -> torch.Tensor | None:
        """The stored features for ``key`` or None, without counting a hit or a miss or changing the LRU order
        (for readers that are not serving the image: traffic capture)."""
        with self._lock:
            return self._items.get(key)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._items

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def stats(self) -> CacheStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            return CacheStats(self._hits, self._misses, self._evictions, len(self._items), self._bytes,
                              self.max_bytes)


def image_keys(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> list[str]:
    """One cache key per packed image (see the module docstring for what the key covers).

    Args: pixel_values ``(total_patches, 3, 14, 14)`` float, images packed in order; image_grid_thw
        ``(num_images, 3)`` long, ``(t, h, w)`` in patches (image ``i`` owns ``t*h*w`` consecutive rows).
    Returns: 32-hex-digit BLAKE2b-128 digests, in image order.
    Raises: ValueError if the grid does not account for every row of ``pixel_values``.
    """
    counts = [int(t * h * w) for t, h, w in image_grid_thw.tolist()]
    if sum(counts) != pixel_values.shape[0]:
        raise ValueError(f"image grid covers {sum(counts)} patches but pixel_values has {pixel_values.shape[0]}")
    pv = pixel_values.detach().to("cpu").contiguous()
    keys, start = [], 0
    for (t, h, w), n in zip(image_grid_thw.tolist(), counts):
        rows = pv[start:start + n]
        start += n
        h_ = hashlib.blake2b(digest_size=16)
        h_.update(f"{t},{h},{w};{rows.dtype};{tuple(rows.shape)};".encode())
        h_.update(rows.view(torch.uint8).numpy().tobytes() if rows.numel() else b"")
        keys.append(h_.hexdigest())
    return keys


def cached_image_features(compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                          pixel_values: torch.Tensor, image_grid_thw: torch.Tensor,
                          cache: ImageFeatureCache, device: torch.device | str,
                          dtype: torch.dtype) -> torch.Tensor:
    """Projected features of packed images, looking each image up in ``cache`` first.

    Each image that misses is encoded on its own by ``compute(pixel_values, image_grid_thw)`` (the tower +
    projector: ``(rows, 3, 14, 14)``, ``(1, 3)`` -> ``(rows / 4, H)``) and stored. On its own, not packed with the
    request's other misses: packing changes the last bits of an image's features (other batch shapes, other
    kernel blocking), and a cached value must not depend on which images it first came with. So a hit is
    bit-identical to a fresh encode of that image; for a one-image prompt that is also the uncached packed path.
    Returns ``(total_patches // 4, H)`` on ``device`` in ``dtype``, images in order - the same layout as
    ``compute`` on all images.
    """
    keys = image_keys(pixel_values, image_grid_thw)
    rows = [int(t * h * w) for t, h, w in image_grid_thw.tolist()]
    starts = [sum(rows[:i]) for i in range(len(rows))]
    out = []
    for i, key in enumerate(keys):
        feats = cache.get(key)
        if feats is None:
            feats = compute(pixel_values[starts[i]:starts[i] + rows[i]], image_grid_thw[i:i + 1])
            cache.put(key, feats)
        out.append(feats.to(device, dtype))
    return torch.cat(out)
