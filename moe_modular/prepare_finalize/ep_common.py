"""Helpers shared by the expert-parallel PrepareAndFinalize classes.

Shape legend: T tokens on this rank, R rows received, K hidden, k topk, E global experts,
El local experts, W world size (EP ranks), G activation scale groups (ceil(K / group)).

Expert ids in the caller's topk_ids are global; an id of -1 marks a route that does no work
(SliceAllGatherPrepareAndFinalize pads with it). Placement (which rank holds which expert) comes
from moe.parallel.placement through moe_modular.routing.make_expert_map.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from all2all.rows import RowField, RowFormat
from moe_modular.config import MoEConfig
from moe_modular.quant import (
    FP8_DTYPE,
    ActivationQuant,
    MoEQuantParams,
    QuantConfig,
    finite_amax,
    quantize_activations,
    scale_from_amax,
)
from moe_modular.routing import make_expert_map
from moe_modular.wire_bytes import token_row_bytes


@dataclass(frozen=True)
class ExpertPlacementTables:
    """owner_E (E,) int64: the rank holding each global expert; local_E (E,) int64: its index there."""

    owner_E: torch.Tensor
    local_E: torch.Tensor
    num_local_experts: int

    @classmethod
    def build(cls, moe: MoEConfig, device: torch.device) -> "ExpertPlacementTables":
        E, W = moe.num_experts, moe.ep_size
        owner = torch.full((E,), -1, dtype=torch.int64)
        local = torch.full((E,), -1, dtype=torch.int64)
        for r in range(W):
            m = make_expert_map(E, W, r, moe.parallel.placement).to(torch.int64).cpu()
            held = m >= 0
            owner[held] = r
            local[held] = m[held]
        if (owner < 0).any():
            missing = (owner < 0).nonzero().squeeze(1).tolist()
            raise ValueError(f"experts {missing} are held by no rank under placement {moe.parallel.placement.value}")
        return cls(owner.to(device), local.to(device), moe.num_local_experts)

    def owner_of(self, topk_ids_Tk: torch.Tensor) -> torch.Tensor:
        """(T, k) global ids -> (T, k) int64 owning rank, -1 for id -1."""
        ids = topk_ids_Tk.long()
        valid = ids >= 0
        return torch.where(valid, self.owner_E[ids.clamp(min=0)], torch.full_like(ids, -1))

    def local_on(self, topk_ids_Tk: torch.Tensor, rank: int) -> torch.Tensor:
        """(T, k) global ids -> (T, k) int64 local ids on `rank`, -1 where `rank` does not hold the expert."""
        ids = topk_ids_Tk.long()
        safe = ids.clamp(min=0)
        held = (ids >= 0) & (self.owner_E[safe] == rank)
        return torch.where(held, self.local_E[safe], torch.full_like(ids, -1))


def check_context(cls_name: str, moe: MoEConfig, context: Any) -> None:
    """make() of an EP PF: `context` must be a ParallelContext whose layout is moe.parallel."""
    from moe_modular.parallel_context import ParallelContext

    if not isinstance(context, ParallelContext):
        raise TypeError(f"{cls_name}.make needs a ParallelContext, got {type(context).__name__}")
    context.check_moe(moe, cls_name)


def quantize_for_dispatch(
    a1_TK: torch.Tensor, quant: MoEQuantParams, group: Any
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Quantize this rank's tokens before they travel.

    Per-token and group scales are per row and travel with their token. A dynamic per-tensor
    scale is made global: the amax of every rank's tokens (one all-reduce of a scalar), so the
    receivers need no scale from the sender and the result equals quantizing the whole EP batch
    at once. Returns (xq (T, K) fp8 or a1's dtype, scale (1,) / (T, 1) / (T, G) float32 or None).
    """
    cfg = quant.config
    if not cfg.is_quantized:
        return a1_TK, None
    if cfg.activation is ActivationQuant.PER_TENSOR and not cfg.static_activation_scale:
        amax = finite_amax(a1_TK.float()).reshape(1) if a1_TK.numel() else torch.zeros(
            1, dtype=torch.float32, device=a1_TK.device)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        scale = scale_from_amax(amax)
        static_cfg = QuantConfig(cfg.quant_dtype, cfg.activation, cfg.weight, cfg.block_shape, True)
        return quantize_activations(a1_TK, static_cfg, scale)
    return quantize_activations(a1_TK, cfg, quant.a1_scale)


def scale_width(cfg: QuantConfig, K: int) -> int:
    """Scale elements that travel with each token row: 0 (none / per-tensor), 1 (per-token), G (group)."""
    if not cfg.is_quantized or cfg.activation is ActivationQuant.PER_TENSOR:
        return 0
    if cfg.activation is ActivationQuant.PER_TOKEN:
        return 1
    return -(-K // cfg.group_size)


def token_row_format(K: int, x_dtype: torch.dtype, n_scale: int, topk: int, with_routing: bool) -> RowFormat:
    """A dispatched token: activations, per-row scale (if any), then global ids + weights (if routing travels)."""
    fields = [RowField("x", x_dtype, K)]
    if n_scale:
        fields.append(RowField("scale", torch.float32, n_scale))
    if with_routing:
        fields += [RowField("ids", torch.int32, topk), RowField("weights", torch.float32, topk)]
    return RowFormat(tuple(fields))


def activation_wire_dtype(moe: MoEConfig) -> torch.dtype:
    """The dtype activations travel in: fp8 for quantized schemes, else the activation dtype."""
    return FP8_DTYPE if moe.quant.is_quantized else moe.dtype


def masked_weights(topk_weights_Rk: torch.Tensor, local_ids_Rk: torch.Tensor) -> torch.Tensor:
    """float32 weights with 0 on routes not held here (id -1), so stray expert output there adds nothing."""
    return torch.where(local_ids_Rk >= 0, topk_weights_Rk.float(), torch.zeros_like(topk_weights_Rk, dtype=torch.float32))


def local_expert_counts(local_ids_Rk: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """(El,) int32 routes per local expert, computed on the device without a host sync."""
    ids = local_ids_Rk.reshape(-1)
    valid = ids >= 0
    counts = torch.zeros(num_local_experts + 1, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, torch.where(valid, ids, torch.full_like(ids, num_local_experts)),
                        torch.ones_like(ids, dtype=torch.int32))
    return counts[:num_local_experts]


def activation_row_bytes(moe: MoEConfig, fp8: bool) -> int:
    """A dispatched row of this package's PFs: K elements plus the scales that travel with it (none unquantized)."""
    return token_row_bytes(moe.hidden_dim, fp8, moe.dtype, scale_width(moe.quant, moe.hidden_dim) if fp8 else 0)
