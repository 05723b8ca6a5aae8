"""Input checks of the forward: free ones (dtype, shape, device; no device-to-host sync) that always run, and
the routing ids' value range, which costs a sync and runs only where the caller asks (check_inputs).

Shape legend: T tokens, k topk, E global experts, El local experts.
"""
from __future__ import annotations

import torch

_INT_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)


def check_routing(topk_ids_Tk: torch.Tensor, topk_weights_Tk: torch.Tensor) -> None:
    """topk_ids (T, k) of an integer dtype (not bool), topk_weights (T, k) floating point (no sync)."""
    if topk_ids_Tk.dtype not in _INT_DTYPES:
        raise ValueError(f"topk_ids dtype ({topk_ids_Tk.dtype}) must be an integer dtype, one of "
                         f"{[str(d).removeprefix('torch.') for d in _INT_DTYPES]}")
    if not topk_weights_Tk.dtype.is_floating_point:
        raise ValueError(f"topk_weights dtype ({topk_weights_Tk.dtype}) must be floating point")


def check_expert_map(expert_map_E: torch.Tensor, num_experts: int, num_local_experts: int,
                     device: torch.device) -> None:
    """expert_map (E,) of an integer dtype, one entry per global expert, on the inputs' device (no sync)."""
    if expert_map_E.dtype not in _INT_DTYPES:
        raise ValueError(f"expert_map dtype ({expert_map_E.dtype}) must be an integer dtype")
    if expert_map_E.dim() != 1 or expert_map_E.numel() != num_experts:
        raise ValueError(f"expert_map shape {tuple(expert_map_E.shape)} must be ({num_experts},): one entry "
                         f"(a local index in [0, {num_local_experts}) or -1) per global expert")
    if expert_map_E.device != device:
        raise ValueError(f"expert_map is on {expert_map_E.device}, the inputs on {device}")


def check_routing_values(topk_ids_Tk: torch.Tensor, num_experts: int) -> None:
    """Every routing id in [0, num_experts). Reads the ids' range on the host: a device-to-host sync."""
    if topk_ids_Tk.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(topk_ids_Tk.to(torch.int64)))
    if lo < 0 or hi >= num_experts:
        bad = topk_ids_Tk[(topk_ids_Tk < 0) | (topk_ids_Tk >= num_experts)]
        raise ValueError(f"topk_ids hold {bad.numel()} id(s) outside [0, {num_experts}) (global_num_experts), e.g. "
                         f"{bad.flatten()[:4].tolist()}; the range is {lo} to {hi}")
