"""Helpers shared by the DeepEP PrepareAndFinalize classes.

Shape legend: T tokens on this rank, k topk, K hidden, Kp padded hidden, E global experts,
El local experts, W ranks.

DeepEP numbers experts contiguously per rank (rank r holds [r*El, (r+1)*El)). Other placements
are mapped onto that numbering before a dispatch: expert g held by rank r at local index l
travels as r*El + l, so the ids DeepEP hands back on the receiving side (its own local ids,
-1 for routes held elsewhere) are exactly the local ids the experts index their weights with.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from all2all.deepep import deep_ep_unavailable_reason
from moe_modular.config import MoEConfig
from moe_modular.prepare_finalize.ep_common import ExpertPlacementTables


def pad_hidden(x: torch.Tensor, padded: int) -> torch.Tensor:
    """x (..., K) -> contiguous (..., padded) with zeros in the added columns (x itself when K == padded)."""
    K = x.size(-1)
    if padded < K:
        raise ValueError(f"padded hidden ({padded}) must be >= the hidden size ({K})")
    if padded == K:
        return x.contiguous()
    out = torch.zeros((*x.shape[:-1], padded), dtype=x.dtype, device=x.device)
    out[..., :K] = x
    return out


def linear_expert_table(tables: ExpertPlacementTables) -> torch.Tensor:
    """(E,) int64: the DeepEP id of every global expert, owner * El + local index."""
    return tables.owner_E * tables.num_local_experts + tables.local_E


def to_linear_ids(linear_E: torch.Tensor, topk_ids_Tk: torch.Tensor) -> torch.Tensor:
    """Global ids (T, k) -> DeepEP ids (T, k) int64 contiguous; -1 (no route) stays -1."""
    ids = topk_ids_Tk.long()
    return torch.where(ids >= 0, linear_E[ids.clamp(min=0)], torch.full_like(ids, -1)).contiguous()


def deepep_supports(moe: MoEConfig, check_config: Callable[[MoEConfig], Optional[str]]) -> tuple[bool, str]:
    """The DeepEP classes' answer: deep_ep installed, then the config's own limits, then CUDA."""
    missing = deep_ep_unavailable_reason()
    if missing is not None:
        return False, missing
    error = check_config(moe)
    if error is not None:
        return False, error
    if not torch.cuda.is_available():
        return False, "DeepEP needs CUDA GPUs; CUDA is not available here"
    return True, ""
