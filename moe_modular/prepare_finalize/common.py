"""Helpers shared by the PrepareAndFinalize classes.

Shape legend: T tokens, K hidden, k topk, E global experts, El local experts.
"""
from __future__ import annotations

from typing import Optional

import torch

from moe_modular.routing import local_route_ids


def apply_weight_on_input(a1_TK: torch.Tensor, topk_weights_Tk: torch.Tensor, enabled: bool) -> torch.Tensor:
    """Scale each token by its (single) router weight before the experts, when enabled (topk == 1)."""
    if not enabled:
        return a1_TK
    if topk_weights_Tk.size(1) != 1:
        raise ValueError(f"apply_router_weight_on_input needs topk == 1, got topk ({topk_weights_Tk.size(1)})")
    return (a1_TK.float() * topk_weights_Tk.float()).to(a1_TK.dtype)


def local_expert_ids(topk_ids_Tk: torch.Tensor, expert_map: Optional[torch.Tensor], first_expert: int,
                     num_local_experts: int) -> torch.Tensor:
    """Global ids (T, k) -> local ids (T, k) int64, -1 where the expert is not held here.

    With an expert_map (E,) global -> local or -1, it decides; otherwise local experts are the
    contiguous range [first_expert, first_expert + num_local_experts).
    """
    ids = topk_ids_Tk.long()
    if expert_map is not None:
        return local_route_ids(ids, expert_map, num_local_experts)  # an id outside the map: -1
    local = ids - first_expert
    return torch.where((local >= 0) & (local < num_local_experts), local, torch.full_like(local, -1))
