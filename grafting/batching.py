"""Continuous batching of the in-process LLM (:class:`grafting.local_client.TransformersClient`): concurrent
requests share each decode step.

Each request (a :class:`~core.llm_client.CompletionRequest`: token ids, or ``(T, H)`` embeddings with image
features spliced in) is prefilled on its own (batch 1), then joins the running batch; every
decode step runs one LLM forward for all active sequences (left-padded KV cache, per-row attention mask and
position ids); finished or cancelled sequences leave the batch after any step, new ones join before the next.
The scheme is Orca's iteration-level scheduling (Yu et al., OSDI 2022) without paged memory: the batched cache is
a left-padded ``DynamicCache`` that is re-padded only when membership changes.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from core.llm_client import CompletionRequest

from .generate import SequenceState, prefill


class BatcherClosed(RuntimeError):
    """Raised by :meth:`ContinuousBatcher.submit`, and emitted to unfinished requests, once the batcher is closed."""


@dataclass
class _Slot:
    state: SequenceState
    emit: Callable[[Any], None]
    logits: torch.Tensor  # (V,) next-token logits of this row
    length: int  # real (unpadded) tokens of this row in the KV cache


def _safe_emit(emit: Callable[[Any], None], item: Any) -> bool:
    """Hand ``item`` to a request's callback; False if the callback failed (e.g. its event loop is gone)."""
    try:
        emit(item)
        return True
    except Exception:  # noqa: BLE001 - a consumer's failure must not stop the batch
        return False


def _pad_cache_left(cache: DynamicCache, length: int) -> None:
    """Left-pad every layer's keys/values ``(B, H, L, D)`` with zeros to ``length`` positions (in place)."""
    for layer in cache.layers:
        pad = length - layer.keys.shape[-2]
        if pad > 0:
            layer.keys = F.pad(layer.keys, (0, 0, pad, 0))
            layer.values = F.pad(layer.values, (0, 0, pad, 0))


def _concat_caches(a: DynamicCache, b: DynamicCache) -> DynamicCache:
    """Rows of ``a`` then rows of ``b``, both left-padded to the longer of the two."""
    length = max(a.get_seq_length(), b.get_seq_length())
    _pad_cache_left(a, length)
    _pad_cache_left(b, length)
    for la, lb in zip(a.layers, b.layers):
        la.keys = torch.cat([la.keys, lb.keys], dim=0)
        la.values = torch.cat([la.values, lb.values], dim=0)
    return a


def _trim_cache_left(cache: DynamicCache, drop: int) -> None:
    """Remove ``drop`` leading (all-padding) positions from every layer (in place)."""
    if drop > 0:
        for layer in cache.layers:
            layer.keys = layer.keys[:, :, drop:]
            layer.values = layer.values[:, :, drop:]


class ContinuousBatcher:
    """A background thread that decodes all submitted requests together, at most ``max_batch_size`` at a time.

    ``submit(request, cancel, emit)`` queues a :class:`~core.llm_client.CompletionRequest`; ``emit`` is called
    from the batcher thread with each :class:`~core.llm_client.CompletionChunk` of that request (the last one is
    the usage chunk), or once with an exception if the request fails (the other requests go on); a set
    ``cancel`` drops the request from the batch before its next step, with no more chunks. ``active`` is the current batch size and
    ``max_batch_seen`` the largest batch formed. Works for any decoder-only LLM whose layers keep a standard ``DynamicCache``.

    :meth:`close` (or leaving a ``with`` block) stops the thread and joins it; whoever starts a batcher closes it
    before the process exits, since a thread still inside torch at interpreter exit aborts the process
    ("terminate called without an active exception").
    """

    def __init__(self, llm, tokenizer, max_batch_size: int = 8):
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self.llm = llm  # a causal LM (transformers ``*ForCausalLM`` or the same forward signature)
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_batch_seen = 0
        self.active = 0  # rows in the running batch (read by servers for stats)
        self.generated_tokens = 0  # tokens sampled since start, all requests (read by servers for stats)
        self._queue: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        self._lock = threading.Lock()  # orders submit() against close(): nothing is queued after the final drain
        self._thread = threading.Thread(target=self._run, name="vlm-batcher", daemon=True)
        self._thread.start()

    def submit(self, request: CompletionRequest, cancel: threading.Event | None,
               emit: Callable[[Any], None]) -> None:
        """Queue a request for generation (thread-safe, returns at once). Raises :class:`BatcherClosed` after
        :meth:`close`."""
        with self._lock:
            if self._closed.is_set():
                raise BatcherClosed("the batcher is closed")
            self._queue.put((request, cancel, emit))

    def close(self, timeout: float | None = None) -> None:
        """Stop the batcher thread and wait (up to ``timeout`` seconds; None: until it has stopped). The thread
        stops before its next decode step; every request still running or queued then gets one
        :class:`BatcherClosed` through its ``emit``. Idempotent; thread-safe."""
        with self._lock:
            self._closed.set()
            self._queue.put(None)  # wakes the thread if it is waiting for work
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __enter__(self) -> "ContinuousBatcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the batcher thread -----------------------------------------------------------------------------------
    def _admit(self, item) -> tuple[_Slot, DynamicCache] | None:
        request, cancel, emit = item
        try:
            state = SequenceState(self.tokenizer, request, cancel)
            out = prefill(self.llm, request.prompt)
        except Exception as exc:  # noqa: BLE001 - reported to that request only
            _safe_emit(emit, exc)
            return None
        return _Slot(state, emit, out.logits[0, -1], len(request.prompt)), out.cache

    @torch.inference_mode()
    def _run(self) -> None:
        active: list[_Slot] = []
        cache: DynamicCache | None = None
        while not self._closed.is_set():
            # 1. admit waiting requests (block only when idle)
            while len(active) < self.max_batch_size:
                try:
                    item = self._queue.get(block=not active)
                except queue.Empty:
                    break
                if item is None:  # close() was called
                    break
                admitted = self._admit(item)
                if admitted is None:
                    continue
                slot, slot_cache = admitted
                cache = slot_cache if cache is None else _concat_caches(cache, slot_cache)
                active.append(slot)
            self.active = len(active)
            if not active or self._closed.is_set():
                continue
            self.max_batch_seen = max(self.max_batch_seen, len(active))
            # 2. sample one token for every row
            keep = []
            for i, slot in enumerate(active):
                try:
                    chunks = slot.state.step(slot.logits)
                except Exception as exc:  # noqa: BLE001 - e.g. non-finite logits: that request fails
                    _safe_emit(slot.emit, exc)
                    continue
                if chunks:
                    self.generated_tokens += 1
                for chunk in chunks:
                    if not _safe_emit(slot.emit, chunk):
                        if slot.state.cancel is not None:
                            slot.state.cancel.set()  # nobody is listening any more
                        slot.state.finished = True
                        break
                if not slot.state.finished:
                    keep.append(i)
            if len(keep) < len(active):
                active = [active[i] for i in keep]
                self.active = len(active)
                if not active:
                    cache = None
                    continue
                cache.batch_select_indices(torch.tensor(keep))
                _trim_cache_left(cache, cache.get_seq_length() - max(s.length for s in active))
            if self._closed.is_set():
                break
            # 3. one decode step for the whole batch (a failure there fails the requests in it, not the batcher)
            try:
                cache = self._decode(active, cache)
            except Exception as exc:  # noqa: BLE001
                for s in active:
                    _safe_emit(s.emit, exc)
                active, cache, self.active = [], None, 0
        self._fail_all(active)

    def _fail_all(self, active: list[_Slot]) -> None:
        """After close(): one BatcherClosed to every running and queued request."""
        closed = BatcherClosed("the batcher was closed before this request finished")
        for s in active:
            _safe_emit(s.emit, closed)
        self.active = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                _safe_emit(item[2], closed)

    def _decode(self, active: list[_Slot], cache: DynamicCache) -> DynamicCache:
        """One LLM forward for the last token of every active row; updates their logits and lengths."""
        ids = torch.tensor([[s.state.last_token] for s in active], device=self.llm.get_input_embeddings().weight.device)
        if len(active) == 1:  # exactly the single-sequence path
            out = self.llm(input_ids=ids, cache=cache, use_cache=True)
        else:
            total = cache.get_seq_length()
            mask = torch.ones(len(active), total + 1, dtype=torch.long, device=ids.device)
            for row, s in enumerate(active):
                mask[row, : total - s.length] = 0
            positions = torch.tensor([[s.length] for s in active], device=ids.device)
            out = self.llm(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        for row, s in enumerate(active):
            s.logits = out.logits[row, -1]
            s.length += 1
        return out.cache
