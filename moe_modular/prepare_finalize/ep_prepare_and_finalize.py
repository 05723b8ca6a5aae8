"""EPPrepareAndFinalize: what every expert-parallel PF built on one All2All manager shares.

Each such PF runs on one rank of moe.parallel, takes its manager (the registry name in BACKEND) from a
ParallelContext in make(), needs a process group and counts every rank as a dispatcher.
"""
from __future__ import annotations

from typing import Any

from all2all.base import All2AllManager
from moe_modular.config import MoEConfig
from moe_modular.interfaces import FusedMoEPrepareAndFinalizeModular, check_supported
from moe_modular.prepare_finalize.ep_common import check_context


class EPPrepareAndFinalize(FusedMoEPrepareAndFinalizeModular):
    """Base of the PFs that dispatch through an All2All manager (subclasses set BACKEND)."""

    BACKEND: str  # the All2All manager's registry name

    def __init__(self, moe: MoEConfig, manager: All2AllManager) -> None:
        if manager.world_size != moe.ep_size or manager.rank != moe.ep_rank:
            raise ValueError(
                f"manager (rank {manager.rank} of {manager.world_size}) must match moe.parallel "
                f"(ep_rank {moe.ep_rank} of ep_size {moe.ep_size})")
        self.moe = moe
        self.manager = manager
        self.group = manager.group
        self.rank, self.world_size = manager.rank, manager.world_size

    @classmethod
    def manager_for(cls, moe: MoEConfig, context: Any) -> All2AllManager:
        """make()'s checks (context is a ParallelContext laid out as moe.parallel; supports(moe)), then
        the context's manager of this class's BACKEND."""
        check_context(cls.__name__, moe, context)
        check_supported(cls, moe)
        return context.all2all(cls.BACKEND)

    @classmethod
    def make(cls, moe: MoEConfig, context=None) -> "EPPrepareAndFinalize":
        return cls(moe, cls.manager_for(moe, context))

    @classmethod
    def requires_distributed(cls) -> bool:
        return True

    def num_dispatchers(self) -> int:
        return self.world_size
