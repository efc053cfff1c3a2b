"""Cache-aware routing of chat requests across VLM replicas (a Ray Serve custom request router).

Each VLM replica keeps its own image-embedding cache (``grafting.image_cache``) and vLLM prefix cache, so a
repeated image is cheap only on the replica that saw it. :class:`ImageAffinityRouter` sends a request whose
image was routed to a replica before to that replica when it has capacity (its queue below the deployment's
``max_ongoing_requests``), and otherwise - or for a new image, or a text-only request - to the least loaded
replica. The model is Ray Serve LLM's ``PrefixCacheAffinityRouter`` (affinity first, load balance as the
fallback, state updated in ``on_request_routed``), with image keys in place of its text prefix tree.

Routing keys (what the ingress computes; :func:`image_routing_keys`): a BLAKE2b-128 digest of each image's
``image_url.url`` string - the data URL's bytes, not decoded (hashing ~100 kB takes ~0.1 ms; decoding would
cost the ingress milliseconds per image). The replica caches under a digest of the decoded, preprocessed pixels
(see ``grafting.image_cache``). The two agree in the direction that matters: the same URL bytes decode to the
same pixels, so equal routing keys always mean equal cache keys, and a request routed by affinity finds its
image cached unless that replica evicted it. The converse does not hold (a lossless re-encode of an image has
another routing key but the same cache key): such a request is routed as a new image and may miss on the
replica it lands on - a lost hit, never a wrong answer. The keys travel in the request payload as
``image_keys`` (the deployment ignores them).

Router state (which replica each key went to) lives in the process that holds the handle - the ingress - and is
a bounded LRU map; a key is forgotten with its replica. It is a hint: routing never affects an answer.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import (LocalityMixin, MultiplexMixin, PendingRequest, ReplicaID, RequestRouter,
                                      RunningReplica)

ROUTER_PATH = "services.deployments.routing:ImageAffinityRouter"
PAYLOAD_KEY = "image_keys"


def image_routing_keys(messages: Any) -> list[str]:
    """Routing keys (32 hex digits each) of the ``image_url`` parts of OpenAI chat ``messages``, in order.
    Malformed messages give no keys (the deployment refuses them with a 4xx; routing must never fail first)."""
    keys: list[str] = []
    if not isinstance(messages, list):
        return keys
    for msg in messages:
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "image_url":
                continue
            iu = part.get("image_url")
            url = iu.get("url") if isinstance(iu, dict) else iu
            if isinstance(url, str) and url:
                keys.append(hashlib.blake2b(url.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest())
    return keys


def router_config(max_tracked_keys: int = 4096) -> RequestRouterConfig:
    """The ``request_router_config`` of the VLM deployment: :class:`ImageAffinityRouter`, remembering at most
    ``max_tracked_keys`` image keys."""
    return RequestRouterConfig(request_router_class=ROUTER_PATH,
                               request_router_kwargs={"max_tracked_keys": max_tracked_keys})


def _payload_keys(pending_request: PendingRequest | None) -> list[str]:
    if pending_request is None:
        return []
    for arg in list(pending_request.args or []) + list((pending_request.kwargs or {}).values()):
        if isinstance(arg, dict) and isinstance(arg.get(PAYLOAD_KEY), list):
            return [k for k in arg[PAYLOAD_KEY] if isinstance(k, str)]
    return []


class ImageAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Ray Serve request router: image affinity when the holder has capacity, else least loaded.

    ``choose_replicas`` returns ranks: first the replicas that were sent the most of the request's image keys,
    then all others; Serve takes the least loaded replica of the first rank that has a free slot (queue length
    below ``max_ongoing_requests``) and falls through to the next rank otherwise. "Least loaded" is Serve's view:
    the lowest cached queue length among the rank's replicas that have a fresh entry; replicas without one (or
    full) are probed only when none has one, else in the background, so an idle replica whose entry expired can
    lose to a busier one. Without known keys there is one rank, all replicas: the least loaded wins.
    ``routed_by_affinity`` / ``routed_by_load`` count the decisions (this process's router only).
    """

    def initialize_state(self, max_tracked_keys: int = 4096, **kwargs: Any) -> None:
        """Called by Serve with ``request_router_kwargs``: ``max_tracked_keys`` bounds the key -> replicas map."""
        self.max_tracked_keys = int(max_tracked_keys)
        self._where: OrderedDict[str, set[ReplicaID]] = OrderedDict()
        self.routed_by_affinity = 0
        self.routed_by_load = 0

    def holders(self, keys: list[str], candidates: list[RunningReplica]) -> list[RunningReplica]:
        """The candidates that were sent the largest number (> 0) of ``keys``; empty if none was."""
        score: dict[ReplicaID, int] = {}
        for k in keys:
            for rid in self._where.get(k, ()):
                score[rid] = score.get(rid, 0) + 1
        best = max((score.get(r.replica_id, 0) for r in candidates), default=0)
        return [r for r in candidates if best > 0 and score.get(r.replica_id, 0) == best]

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Ranks of replicas for ``pending_request`` (see the class docstring)."""
        keys = _payload_keys(pending_request)
        first = self.holders(keys, candidate_replicas) if keys else []
        if not first:
            return [candidate_replicas]
        rest = [r for r in candidate_replicas if r not in first]
        return [first, rest] if rest else [first]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """Remember that the request's image keys are now (about to be) cached on ``replica_id``."""
        keys = _payload_keys(pending_request)
        if not keys:
            return
        if self.holders(keys, [r for r in self._replicas_list if r.replica_id == replica_id]):
            self.routed_by_affinity += 1
        else:
            self.routed_by_load += 1
        for k in keys:
            self._where.setdefault(k, set()).add(replica_id)
            self._where.move_to_end(k)
        while len(self._where) > self.max_tracked_keys:
            self._where.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """Forget a dead replica's keys (its cache died with it)."""
        super().on_replica_actor_died(replica_id)
        self._forget({replica_id})

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's replica-set update; keys of replicas that left are forgotten."""
        old = set(self._replica_id_set)
        super().update_replicas(replicas)
        self._forget(old - set(self._replica_id_set))

    def _forget(self, gone: set[ReplicaID]) -> None:
        if not gone or not hasattr(self, "_where"):  # Serve may update replicas before initialize_state
            return
        for k in list(self._where):
            self._where[k] -= gone
            if not self._where[k]:
                del self._where[k]
