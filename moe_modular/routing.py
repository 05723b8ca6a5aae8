"""Routing: router logits -> (topk_weights, topk_ids), and the expert maps of expert parallelism.

fused_topk    softmax over all experts, top-k, optional renormalization.
grouped_topk  DeepSeek-V3 style: experts split into groups, only the best topk_group groups compete,
              softmax or sigmoid scores, an optional correction bias that steers selection only.
make_expert_map / local_expert_ids
              which global experts a rank holds (LINEAR or ROUND_ROBIN placement) and their local index.

Shape legend: T tokens, K hidden, E global experts, El = E / ep_size local experts, k topk,
G expert groups, Eg = E / G experts per group.
"""
from __future__ import annotations

import enum
import math
from typing import Callable, Optional

import torch

from moe_modular.config import ExpertPlacement

INDEX_DTYPES: tuple[torch.dtype, ...] = (torch.int32, torch.int64)


class ScoringFunc(enum.Enum):
    """How router logits become per-expert scores (computed in float32)."""

    SOFTMAX = "softmax"  # normalized over the E experts of a token
    SIGMOID = "sigmoid"  # independent per expert, in (0, 1)

    @classmethod
    def parse(cls, name: "str | ScoringFunc") -> "ScoringFunc":
        if isinstance(name, cls):
            return name
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"scoring_func ({name!r}) must be one of {[s.value for s in cls]}") from None


def _softmax_scores(logits_TE: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits_TE.float(), dim=-1)


def _sigmoid_scores(logits_TE: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(logits_TE.float())


SCORING_FUNCS: dict[ScoringFunc, Callable[[torch.Tensor], torch.Tensor]] = {
    ScoringFunc.SOFTMAX: _softmax_scores,
    ScoringFunc.SIGMOID: _sigmoid_scores,
}


# ---------------------------------------------------------------------------------------------
# Argument checks (each error names the field, its value and the allowed range or set)
# ---------------------------------------------------------------------------------------------

def _check_int_in(name: str, value, lo: int, hi: int, why: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        suffix = f" ({why})" if why else ""
        raise ValueError(f"{name} ({value!r}) must be an int in [{lo}, {hi}]{suffix}")


def _check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} ({value!r}) must be an int >= 1")


def _check_index_dtype(indices_dtype: torch.dtype) -> None:
    if indices_dtype not in INDEX_DTYPES:
        raise ValueError(f"indices_dtype ({indices_dtype}) must be one of {[str(d) for d in INDEX_DTYPES]}")


def _check_gating(hidden_states: torch.Tensor, gating_output: torch.Tensor) -> int:
    """Returns E after checking gating_output is (T, E) with T = hidden_states.shape[0]."""
    if gating_output.dim() != 2 or hidden_states.dim() < 1 or gating_output.size(0) != hidden_states.size(0):
        raise ValueError(
            f"gating_output shape {tuple(gating_output.shape)} must be (num_tokens, num_experts) with "
            f"num_tokens = hidden_states.shape[0] ({hidden_states.size(0) if hidden_states.dim() else None})"
        )
    if not gating_output.is_floating_point():
        raise ValueError(f"gating_output dtype ({gating_output.dtype}) must be a floating-point dtype")
    num_experts = gating_output.size(1)
    if num_experts < 1:
        raise ValueError(f"gating_output shape {tuple(gating_output.shape)} must have num_experts >= 1")
    return num_experts


# ---------------------------------------------------------------------------------------------
# Top-k routing
# ---------------------------------------------------------------------------------------------

def fused_topk(
    hidden_states_TK: torch.Tensor,
    gating_output_TE: torch.Tensor,
    topk: int,
    renormalize: bool,
    indices_dtype: torch.dtype = torch.int32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing over all experts.

    hidden_states_TK (T, K) any dtype: only its token count is read (checked against the logits).
    gating_output_TE (T, E) float (bf16 / fp16 / fp32): router logits; the softmax runs in float32.
    topk: experts per token, in [1, E].  renormalize: scale each row's k weights to sum to 1.
    indices_dtype: torch.int32 (default) or torch.int64.

    Returns topk_weights_Tk (T, k) float32 and topk_ids_Tk (T, k) indices_dtype, ordered by
    descending score within a row.
    """
    num_experts = _check_gating(hidden_states_TK, gating_output_TE)
    _check_int_in("topk", topk, 1, num_experts, f"num_experts = {num_experts}")
    _check_index_dtype(indices_dtype)
    scores_TE = _softmax_scores(gating_output_TE)
    topk_weights_Tk, topk_ids_Tk = torch.topk(scores_TE, topk, dim=-1, sorted=True)
    if renormalize:
        topk_weights_Tk = topk_weights_Tk / topk_weights_Tk.sum(dim=-1, keepdim=True)
    return topk_weights_Tk, topk_ids_Tk.to(indices_dtype)


def grouped_topk(
    hidden_states_TK: torch.Tensor,
    gating_output_TE: torch.Tensor,
    topk: int,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    scoring_func: "ScoringFunc | str" = ScoringFunc.SOFTMAX,
    routed_scaling_factor: float = 1.0,
    e_score_correction_bias: Optional[torch.Tensor] = None,
    indices_dtype: torch.dtype = torch.int32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 style grouped routing.

    1. scores = scoring_func(logits) in float32; selection scores s = scores + bias (bias when given).
    2. The E experts form G = num_expert_group consecutive groups of Eg = E / G. A group's score is
       the sum of its two best selection scores when a bias is given (its best one when Eg = 1),
       else its best selection score.
    3. The topk_group best groups are kept; the topk best experts by selection score among them win.
    4. Weights are the unbiased scores of the winners; renormalized to sum 1 when renormalize, then
       multiplied by routed_scaling_factor.

    hidden_states_TK (T, K) any dtype: only its token count is read.
    gating_output_TE (T, E) float: router logits.
    e_score_correction_bias (E,) float, optional: added to scores for selection only.
    indices_dtype: torch.int32 (default) or torch.int64.

    Returns topk_weights_Tk (T, k) float32 and topk_ids_Tk (T, k) indices_dtype, ordered by
    descending selection score within a row.
    """
    num_experts = _check_gating(hidden_states_TK, gating_output_TE)
    _check_int_in("num_expert_group", num_expert_group, 1, num_experts, f"num_experts = {num_experts}")
    if num_experts % num_expert_group != 0:
        raise ValueError(f"num_expert_group ({num_expert_group}) must divide num_experts ({num_experts})")
    per_group = num_experts // num_expert_group
    _check_int_in("topk_group", topk_group, 1, num_expert_group, f"num_expert_group = {num_expert_group}")
    _check_int_in("topk", topk, 1, topk_group * per_group,
                  f"topk_group * experts per group = {topk_group} * {per_group}")
    scoring = ScoringFunc.parse(scoring_func)
    if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, (int, float)) \
            or not math.isfinite(routed_scaling_factor) or routed_scaling_factor <= 0:
        raise ValueError(f"routed_scaling_factor ({routed_scaling_factor!r}) must be a finite number > 0")
    if e_score_correction_bias is not None and tuple(e_score_correction_bias.shape) != (num_experts,):
        raise ValueError(
            f"e_score_correction_bias shape {tuple(e_score_correction_bias.shape)} must be "
            f"(num_experts,) = ({num_experts},)"
        )
    _check_index_dtype(indices_dtype)

    T = gating_output_TE.size(0)
    scores_TE = SCORING_FUNCS[scoring](gating_output_TE)
    if e_score_correction_bias is not None:
        select_TE = scores_TE + e_score_correction_bias.to(device=scores_TE.device, dtype=torch.float32)
        best_TGb = select_TE.view(T, num_expert_group, per_group).topk(min(2, per_group), dim=-1).values
        group_scores_TG = best_TGb.sum(dim=-1)
    else:
        select_TE = scores_TE
        group_scores_TG = select_TE.view(T, num_expert_group, per_group).amax(dim=-1)

    kept_groups_Tg = torch.topk(group_scores_TG, topk_group, dim=-1, sorted=False).indices
    group_mask_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, kept_groups_Tg, True)
    expert_mask_TE = group_mask_TG.unsqueeze(-1).expand(T, num_expert_group, per_group).reshape(T, num_experts)
    masked_TE = select_TE.masked_fill(~expert_mask_TE, float("-inf"))
    topk_ids_Tk = torch.topk(masked_TE, topk, dim=-1, sorted=True).indices
    topk_weights_Tk = scores_TE.gather(1, topk_ids_Tk)

    if renormalize:
        topk_weights_Tk = topk_weights_Tk / topk_weights_Tk.sum(dim=-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        topk_weights_Tk = topk_weights_Tk * float(routed_scaling_factor)
    return topk_weights_Tk, topk_ids_Tk.to(indices_dtype)


# ---------------------------------------------------------------------------------------------
# Expert placement over EP ranks
# ---------------------------------------------------------------------------------------------

def _linear_ids(num_experts: int, ep_size: int, ep_rank: int) -> torch.Tensor:
    El = num_experts // ep_size
    return torch.arange(ep_rank * El, (ep_rank + 1) * El, dtype=torch.int64)


def _round_robin_ids(num_experts: int, ep_size: int, ep_rank: int) -> torch.Tensor:
    return torch.arange(ep_rank, num_experts, ep_size, dtype=torch.int64)


PLACEMENTS: dict[ExpertPlacement, Callable[[int, int, int], torch.Tensor]] = {
    ExpertPlacement.LINEAR: _linear_ids,
    ExpertPlacement.ROUND_ROBIN: _round_robin_ids,
}


def _check_placement_args(num_experts, ep_size, ep_rank, placement) -> None:
    _check_positive_int("num_experts", num_experts)
    _check_positive_int("ep_size", ep_size)
    _check_int_in("ep_rank", ep_rank, 0, ep_size - 1, f"ep_size = {ep_size}")
    if num_experts % ep_size != 0:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by ep_size ({ep_size})")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement ({placement!r}) must be one of {[p.value for p in PLACEMENTS]}")


def local_expert_ids(
    num_experts: int,
    ep_size: int,
    ep_rank: int,
    placement: ExpertPlacement = ExpertPlacement.LINEAR,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """The global ids of the experts rank ep_rank holds, in local order: (El,) int64 on device.

    Entry i is the global expert stored at local index i (the row of w1 / w2 on this rank).
    LINEAR: rank r holds [r*El, (r+1)*El).  ROUND_ROBIN: rank r holds r, r+ep_size, r+2*ep_size, ...
    """
    _check_placement_args(num_experts, ep_size, ep_rank, placement)
    return PLACEMENTS[placement](num_experts, ep_size, ep_rank).to(device)


def make_expert_map(
    num_experts: int,
    ep_size: int,
    ep_rank: int,
    placement: ExpertPlacement = ExpertPlacement.LINEAR,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """Global -> local expert index for rank ep_rank: (E,) int32 on device, -1 for experts held
    by other ranks. The inverse of local_expert_ids."""
    held_El = local_expert_ids(num_experts, ep_size, ep_rank, placement)
    expert_map_E = torch.full((num_experts,), -1, dtype=torch.int32)
    expert_map_E[held_El] = torch.arange(held_El.numel(), dtype=torch.int32)
    return expert_map_E.to(device)


def local_route_ids(topk_ids: torch.Tensor, expert_map: Optional[torch.Tensor], num_local_experts: int) -> torch.Tensor:
    """Routing ids -> local expert ids (int64), -1 for a route not computed here: global ids through expert_map (E,)
    (-1 entries: held elsewhere), or local ids when expert_map is None. Any id outside the map, or a local id
    outside [0, num_local_experts), is -1 too: such a route contributes nothing (the documented behaviour of every
    experts class for ids out of range; FusedMoEModularKernel(check_inputs=True) refuses them instead)."""
    ids = topk_ids.long()
    if expert_map is not None:
        E = expert_map.numel()
        inside = (ids >= 0) & (ids < E)
        ids = torch.where(inside, expert_map.to(ids.device).long()[ids.clamp(0, max(E - 1, 0))],
                          torch.full_like(ids, -1))
    return torch.where((ids >= 0) & (ids < num_local_experts), ids, torch.full_like(ids, -1))
