"""EPPrepareAndFinalize: what every expert-parallel PF built on one All2All manager shares.

Each such PF runs on one rank of moe.parallel, takes its manager (the registry name in BACKEND) from a
ParallelContext in make(), needs a process group and counts every rank as a dispatcher. When it is made (once
per layer, not per forward) every rank's layer config is gathered and compared: a layer built differently on
two ranks would otherwise compute wrong outputs, abort inside a collective or hang.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch.distributed as dist

from all2all.base import All2AllManager
from moe_modular.config import MoEConfig, dtype_name
from moe_modular.interfaces import FusedMoEPrepareAndFinalizeModular, check_supported
from moe_modular.prepare_finalize.ep_common import check_context


@dataclass(frozen=True)
class LayerFingerprint:
    """What every EP rank of one layer must agree on."""

    prepare_finalize: str
    num_experts: int
    hidden_dim: int
    intermediate_dim: int
    topk: int
    dtype: str
    quant: str
    activation: str
    placement: str
    ep_size: int
    max_num_tokens: int

    @classmethod
    def of(cls, moe: MoEConfig, pf_name: str) -> "LayerFingerprint":
        return cls(pf_name, moe.num_experts, moe.hidden_dim, moe.intermediate_dim, moe.topk, dtype_name(moe.dtype),
                   moe.quant.name, moe.activation.value, moe.parallel.placement.value, moe.ep_size,
                   moe.max_num_tokens)


def fingerprint_differences(every: list[LayerFingerprint]) -> list[str]:
    """'field: rank r = v, ...' for each field whose value is not the same on every rank (rank order)."""
    out = []
    for name, first in asdict(every[0]).items():
        values = [getattr(f, name) for f in every]
        if any(v != first for v in values):
            out.append(f"{name}: " + ", ".join(f"rank {r} = {v}" for r, v in enumerate(values)))
    return out


def check_same_layer_on_every_rank(moe: MoEConfig, pf_name: str, group: Any) -> None:
    """All-gather this rank's LayerFingerprint over `group` (one small collective) and raise on every rank, naming
    the fields and ranks that differ."""
    mine = LayerFingerprint.of(moe, pf_name)
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    diffs = fingerprint_differences(every)
    if diffs:
        raise ValueError(f"{pf_name}: the layer is configured differently on the EP ranks; " + "; ".join(diffs))


class EPPrepareAndFinalize(FusedMoEPrepareAndFinalizeModular):
    """Base of the PFs that dispatch through an All2All manager (subclasses set BACKEND)."""

    BACKEND: str  # the All2All manager's registry name

    def __init__(self, moe: MoEConfig, manager: All2AllManager) -> None:
        if manager.world_size != moe.ep_size or manager.rank != moe.ep_rank:
            raise ValueError(
                f"manager (rank {manager.rank} of {manager.world_size}) must match moe.parallel "
                f"(ep_rank {moe.ep_rank} of ep_size {moe.ep_size})")
        if manager.world_size > 1:  # one rank has nothing to compare with
            check_same_layer_on_every_rank(moe, type(self).__name__, manager.group)
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
