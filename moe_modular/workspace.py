"""WorkspaceCache: grow-only scratch buffers shared by the modular kernels that hold the same cache.

One cache is created by whoever owns the layers (a model, a test) and passed to every
FusedMoEModularKernel that should share buffers; nothing is process-global.
"""
from __future__ import annotations

import math
from typing import Optional

import torch


class WorkspaceCache:
    """Flat grow-only buffers keyed by (slot name, device, dtype).

    `get(name, shape, dtype, device)` returns a view of the right shape over a buffer that only
    grows; a request no larger than the buffer allocates nothing. `num_allocations` counts the
    allocations made so far (tests use it to prove reuse).
    """

    def __init__(self, poison: Optional[float] = None) -> None:
        """poison: a value every new buffer is filled with (tests pass NaN so unwritten rows show)."""
        self.poison = poison
        self._buffers: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}
        self.num_allocations = 0

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(shape)
        key = (name, torch.device(device), dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            # Free the old buffer before taking the larger one.
            self._buffers.pop(key, None)
            del buf
            buf = torch.empty(max(numel, 1), dtype=dtype, device=device)
            if self.poison is not None and (dtype.is_floating_point or dtype.is_complex):
                buf.fill_(self.poison)
            self._buffers[key] = buf
            self.num_allocations += 1
        return buf[:numel].view(shape)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        self._buffers.clear()
