"""WorkspaceCache: grow-only scratch buffers, keyed by name, device and dtype.

The all-to-all handles keep their communication buffers in one; the modular kernels share their
workspaces through one (moe_modular.workspace re-exports it: one cache is created by whoever owns the
layers, a model or a test, and passed to every FusedMoEModularKernel that should share buffers; nothing
is process-global). It lives here, in the lower of the two packages, so that all2all imports nothing
from moe_modular.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

_MAX_VIEWS = 4096
# A buffer that must grow takes at least this factor of its old size (a slowly growing batch reallocates
# O(log) times, not on every forward), rounded up to whole GROW_ALIGN elements.
GROWTH = 1.5
GROW_ALIGN = 256


class WorkspaceCache:
    """Flat grow-only buffers keyed by (slot name, device, dtype).

    `get(name, shape, dtype, device)` returns a view of the right shape over a buffer that only
    grows, by at least GROWTH times when it must; a request no larger than the buffer allocates nothing. `num_allocations` counts the
    allocations made so far (tests use it to prove reuse).
    """

    def __init__(self, poison: Optional[float] = None) -> None:
        """poison: a value every new buffer is filled with (tests pass NaN so unwritten rows show)."""
        self.poison = poison
        self._buffers: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}
        # the views handed out, per request, over the current buffers (dropped with their buffer)
        self._views: dict[tuple, torch.Tensor] = {}
        self.num_allocations = 0

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        request = (name, shape, dtype, device)
        view = self._views.get(request)
        if view is not None:  # the same view object again: this runs on every forward
            return view
        numel = math.prod(shape)
        key = (name, torch.device(device), dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            # Free the old buffer (and the views over it) before taking the larger one.
            self._buffers.pop(key, None)
            self._views = {r: v for r, v in self._views.items() if r[0] != name or r[2] != dtype}
            size = max(numel, 1) if buf is None else max(numel, math.ceil(buf.numel() * GROWTH))
            size = -(-size // GROW_ALIGN) * GROW_ALIGN if buf is not None else size
            del buf
            buf = torch.empty(size, dtype=dtype, device=device)
            if self.poison is not None and (dtype.is_floating_point or dtype.is_complex):
                buf.fill_(self.poison)
            self._buffers[key] = buf
            self.num_allocations += 1
        if len(self._views) >= _MAX_VIEWS:  # a server sees many batch sizes: keep the memo bounded
            self._views.clear()
        view = self._views[request] = buf[:numel].view(shape)
        return view

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        self._buffers.clear()
        self._views.clear()
