"""How the ingress talks to a model deployment: in-process (tests) or through a Ray Serve handle.

Both expose ``await backend.call(method, ...)`` and ``async for x in backend.stream(method, ...)``. Closing a
stream early (client disconnect) cancels the deployment's async generator, which stops its engine work.
Errors come back as the original exception (Ray's wrappers are unwrapped).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from typing import Any, Protocol

from ..boundary import unwrap



class Backend(Protocol):
    """A model deployment as seen from the ingress."""

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any: ...

    def stream(self, method: str, *args: Any, **kwargs: Any) -> AsyncIterator[Any]: ...


class LocalBackend:
    """Calls a deployment object living in this process (no Ray): unit tests and notebooks."""

    def __init__(self, obj: Any):
        self.obj = obj

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``obj.method(*args, **kwargs)``, awaiting it if it is a coroutine."""
        result = getattr(self.obj, method)(*args, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        return result

    async def stream(self, method: str, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """Iterate ``obj.method(...)`` (an async generator); closing this closes it."""
        agen = getattr(self.obj, method)(*args, **kwargs)
        try:
            async for item in agen:
                yield item
        finally:
            await agen.aclose()


class RayBackend:
    """Calls a Ray Serve ``DeploymentHandle``; exceptions are unwrapped from ``RayTaskError``."""

    def __init__(self, handle: Any):
        self.handle = handle

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``await handle.method.remote(...)``."""
        try:
            return await getattr(self.handle, method).remote(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised unwrapped
            raise unwrap(exc) from None

    async def stream(self, method: str, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """Stream from ``handle.options(stream=True).method.remote(...)``; cancels the call when closed early."""
        gen = getattr(self.handle.options(stream=True), method).remote(*args, **kwargs)
        done = False
        try:
            async for item in gen:
                yield item
            done = True
        except Exception as exc:  # noqa: BLE001
            done = True
            raise unwrap(exc) from None
        finally:
            if not done:
                gen.cancel()
