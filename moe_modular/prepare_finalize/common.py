"""Helpers shared by the PrepareAndFinalize classes.

Shape legend: T tokens, K hidden, k topk, E global experts, El local experts.
"""
from __future__ import annotations

from typing import Any, Optional, TypeVar

import torch

from moe_modular.interfaces import MICRO_BATCHES
from moe_modular.routing import local_route_ids

H = TypeVar("H")


def check_micro_batch(pf: object, micro_batch: Any) -> int:
    """micro_batch must be an int in [0, MICRO_BATCHES); returns it."""
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or not 0 <= micro_batch < MICRO_BATCHES:
        raise ValueError(f"{type(pf).__name__}: micro_batch ({micro_batch!r}) must be an int in [0, {MICRO_BATCHES})")
    return micro_batch


def buffer_tag(name: str, micro_batch: int) -> str:
    """The name of a communication buffer of one micro-batch (each micro-batch in flight has its own)."""
    return f"{name}.mb{micro_batch}"


def finalize_handle(pf: object, handle: Any, handle_type: "type[H]", num_tokens: int) -> H:
    """The handle finalize was given, checked: it must be the PrepareResult.handle of this PF type's prepare
    of the same number of tokens (num_tokens: output's rows)."""
    if not isinstance(handle, handle_type):
        raise ValueError(
            f"{type(pf).__name__}.finalize needs the handle its prepare returned (PrepareResult.handle, a "
            f"{handle_type.__name__}), got {type(handle).__name__}")
    tokens = handle.T
    if tokens != num_tokens:
        raise ValueError(
            f"{type(pf).__name__}.finalize: output has {num_tokens} rows but the handle is of a prepare of "
            f"{tokens} tokens; pass the handle of the prepare of the same tokens")
    return handle


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
