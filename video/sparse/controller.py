"""Installing the sparse processors on a transformer for one generation: `WanSparseAttention` (processors, the
forward pre-hook that reads the latent grid and counts steps, per-request options) and `sparse_attention`, the
context manager the video engine wraps each job in.
"""

from __future__ import annotations

import contextlib

import torch

from ..config import SparseAttentionConfig
from .layout import Grid
from .processor import SparseState, WanSparseAttnProcessor



class WanSparseAttention:
    """Installs `WanSparseAttnProcessor` on a `WanTransformer3DModel` and tracks the latent grid and the step.

    Usage (one generation at a time per transformer)::

        sparse = WanSparseAttention.install(pipe.transformer, SparseAttentionConfig())
        with sparse.session(num_inference_steps=30, sparsity=0.125):
            frames = pipe(..., num_inference_steps=30).frames

    A forward pre-hook on the transformer reads the latent shape [B, C, F, H, W] (-> token grid F/p_t x H/p_h x
    W/p_w) and counts denoising steps by changes of the timestep (classifier-free guidance calls the transformer
    twice with the same timestep; it counts once). Several transformers (Wan2.2's `transformer_2`) can share one
    controller: pass `state=` of the first to `install` the second.
    """

    def __init__(self, state: SparseState):
        self.state = state
        self._installed: list[tuple[torch.nn.Module, object, dict]] = []

    @classmethod
    def install(
        cls, transformer: torch.nn.Module, config: SparseAttentionConfig | None = None, state: SparseState | None = None
    ) -> "WanSparseAttention":
        """Replace every attention processor of `transformer` with a `WanSparseAttnProcessor`; returns the controller.

        Args:
            transformer: a diffusers `WanTransformer3DModel`.
            config: defaults for sessions; `SparseAttentionConfig()` if None.
            state: share the state of another controller (for a second transformer of the same pipeline).
        """
        state = state or SparseState(config=config or SparseAttentionConfig())
        controller = cls(state)
        controller.add(transformer)
        return controller

    def add(self, transformer: torch.nn.Module) -> None:
        """Install the processors and the pre-hook on one more transformer sharing this controller's state."""
        original = dict(transformer.attn_processors)
        processors = {}
        for name in original:
            layer = int(name.split(".")[1]) if name.startswith("blocks.") else 0
            processors[name] = WanSparseAttnProcessor(self.state, layer)
        transformer.set_attn_processor(processors)
        patch = tuple(transformer.config.patch_size)
        hook = transformer.register_forward_pre_hook(
            lambda module, args, kwargs: self._observe(patch, args, kwargs), with_kwargs=True
        )
        self._installed.append((transformer, hook, original))

    def remove(self) -> None:
        """Put the processors found at install time back and drop the hooks."""
        for transformer, hook, original in self._installed:
            hook.remove()
            transformer.set_attn_processor(original)
        self._installed.clear()

    def _observe(self, patch: tuple[int, int, int], args: tuple, kwargs: dict) -> None:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        timestep = kwargs.get("timestep", args[1] if len(args) > 1 else None)
        if hidden is not None:
            _, _, f, h, w = hidden.shape
            self.state.grid = (f // patch[0], h // patch[1], w // patch[2])
        if timestep is not None:
            t = float(torch.as_tensor(timestep).float().max())
            if t != self.state.last_timestep:
                self.state.step += 1
                self.state.last_timestep = t

    def begin(
        self,
        num_inference_steps: int | None = None,
        sparsity: float | None = None,
        tile: Grid | None = None,
        dense_fraction: float | None = None,
        dense_layers: list[int] | None = None,
        backend: str | None = None,
        compile: bool | None = None,
        full_is_dense: bool = True,
    ) -> None:
        """Start a generation with per-request options (None = the config's default).

        Args:
            num_inference_steps: denoising steps of this generation; the first
                round(dense_fraction * num_inference_steps) run dense. None: no dense warm-up.
            sparsity: kept fraction in (0, 1]. With `full_is_dense` (default), 1.0 runs diffusers' dense path;
                False routes 1.0 through the sparse backend with every block kept (exactness checks).
            tile, dense_fraction, dense_layers, backend, compile: as in `SparseAttentionConfig`.

        Raises:
            ValueError: on an out-of-range option (pydantic validation of the merged config).
        """
        overrides = dict(sparsity=sparsity, tile=tile, dense_fraction=dense_fraction, dense_layers=dense_layers,
                         backend=backend, compile=compile)
        merged = SparseAttentionConfig(**{**self.state.config.model_dump(),
                                          **{k: v for k, v in overrides.items() if v is not None}})
        s = self.state
        s.sparsity = None if (merged.sparsity >= 1.0 and full_is_dense) else merged.sparsity
        s.tile = merged.tile
        s.dense_steps = round(merged.dense_fraction * num_inference_steps) if num_inference_steps else 0
        s.dense_layers = frozenset(merged.dense_layers)
        s.backend, s.compiled = merged.backend, merged.compile
        s.step, s.last_timestep, s.grid = -1, None, None
        s.sparse_calls = s.dense_calls = 0

    def end(self) -> None:
        """Back to dense until the next `begin` (the processors stay installed)."""
        self.state.sparsity = None

    @contextlib.contextmanager
    def session(self, **options):
        """`begin(**options)` ... `end()` as a context manager."""
        self.begin(**options)
        try:
            yield self.state
        finally:
            self.end()


@contextlib.contextmanager
def sparse_attention(
    transformers: torch.nn.Module | list[torch.nn.Module],
    sparsity: float | None = None,
    num_inference_steps: int | None = None,
    config: SparseAttentionConfig | None = None,
    **options,
):
    """Run a generation with block-sparse self-attention; diffusers' dense processors are back afterwards.

    What the video engine wraps each job in::

        with sparse_attention(pipe.transformer, sparsity=0.125, num_inference_steps=40):
            pipe(...)

    Args:
        transformers: one `WanTransformer3DModel` or several sharing the schedule (Wan2.2 A14B's two experts).
        sparsity: kept fraction in (0, 1] (None: the config's); 1.0 runs dense.
        num_inference_steps: steps of the generation (for the dense warm-up fraction).
        config: defaults (`SparseAttentionConfig()` if None).
        options: other per-request overrides of `WanSparseAttention.begin` (tile, dense_fraction, dense_layers).

    Yields the shared `SparseState` (counters tell which path ran). Raises ValueError on invalid options.
    """
    if isinstance(transformers, torch.nn.Module):
        transformers = [transformers]
    controller = None
    try:
        for transformer in transformers:
            if controller is None:
                controller = WanSparseAttention.install(transformer, config)
            else:
                controller.add(transformer)
        with controller.session(num_inference_steps=num_inference_steps, sparsity=sparsity, **options) as state:
            yield state
    finally:
        if controller is not None:
            controller.remove()
