"""ParallelContext: the process group, device and ParallelConfig an EP layer runs under.

The expert-parallel PrepareAndFinalize classes take one in `make(moe, context)`. Managers are
created through the all2all registry on first request and cached in the context, so every layer
built from the same context shares them (and their per-config handles).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from all2all.base import All2AllManager, group_device, resolve_backend
from moe_modular.config import ExpertPlacement, MoEConfig, ParallelConfig


class ParallelContext:
    """group: an initialized process group whose ranks are the EP ranks.
    device: where activations live (the group's device when None).
    parallel: the EP layout; its ep_size / ep_rank must match the group's size / rank.
    """

    def __init__(self, group: Any, device: Optional[torch.device] = None,
                 parallel: Optional[ParallelConfig] = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ParallelContext needs an initialized torch.distributed process group")
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if parallel is None:
            parallel = ParallelConfig(ep_size=size, ep_rank=rank)
        if parallel.ep_size != size or parallel.ep_rank != rank:
            raise ValueError(
                f"ParallelConfig (ep_size={parallel.ep_size}, ep_rank={parallel.ep_rank}) must match the "
                f"process group (size={size}, rank={rank})"
            )
        self.group = group
        self.device = torch.device(device) if device is not None else group_device(group)
        self.parallel = parallel
        self._managers: dict[str, All2AllManager] = {}
        self._destroyed = False

    @classmethod
    def from_group(cls, group: Any = None, device: Optional[torch.device] = None,
                   placement: ExpertPlacement = ExpertPlacement.LINEAR) -> "ParallelContext":
        """A context over `group` (the default group when None) with ep_size/ep_rank read from it."""
        group = group if group is not None else dist.group.WORLD
        parallel = ParallelConfig(ep_size=dist.get_world_size(group), ep_rank=dist.get_rank(group),
                                  placement=placement)
        return cls(group, device, parallel)

    @property
    def rank(self) -> int:
        return self.parallel.ep_rank

    @property
    def world_size(self) -> int:
        return self.parallel.ep_size

    def all2all(self, backend_name: str) -> All2AllManager:
        """The manager for `backend_name`, created once per context (unknown names list the valid ones)."""
        if self._destroyed:
            raise RuntimeError("ParallelContext was destroyed")
        manager = self._managers.get(backend_name)
        if manager is None:
            manager = resolve_backend(backend_name)(self.group, self.device)
            self._managers[backend_name] = manager
        return manager

    def check_moe(self, moe: MoEConfig, who: str) -> None:
        """Raise unless `moe.parallel` has this context's ep_size and ep_rank (placement is per layer)."""
        p = moe.parallel
        if (p.ep_size, p.ep_rank) != (self.parallel.ep_size, self.parallel.ep_rank):
            raise ValueError(
                f"{who}: moe.parallel (ep_size={p.ep_size}, ep_rank={p.ep_rank}) must match the context "
                f"(ep_size={self.parallel.ep_size}, ep_rank={self.parallel.ep_rank})"
            )

    def destroy(self) -> None:
        """Destroy every manager this context created (idempotent); the process group stays up."""
        if self._destroyed:
            return
        for manager in self._managers.values():
            manager.destroy()
        self._managers.clear()
        self._destroyed = True

    def __repr__(self) -> str:
        return (f"ParallelContext(rank={self.rank}, world_size={self.world_size}, device={self.device}, "
                f"placement={self.parallel.placement.value}, managers={sorted(self._managers)})")
