"""TopKWeightAndReduce implementations.

Shape legend: T tokens, k topk, K hidden, El local experts, B batched slots per expert.
"""
from __future__ import annotations

from typing import Optional

import torch

from moe_modular.interfaces import TopKWeightAndReduce


def _out(output: Optional[torch.Tensor], T: int, K: int, like: torch.Tensor) -> torch.Tensor:
    if output is None:
        return torch.empty((T, K), dtype=like.dtype, device=like.device)
    if tuple(output.shape) != (T, K):
        raise ValueError(f"output shape ({tuple(output.shape)}) must be ({T}, {K})")
    return output


class TopKWeightAndReduceNoOp(TopKWeightAndReduce):
    """The experts already weighted and reduced: fused_expert_output is (T, K)."""

    def apply(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input):
        if output is None:
            return fused_expert_output
        if output.data_ptr() != fused_expert_output.data_ptr():
            output.copy_(fused_expert_output)
        return output


class TopKWeightAndReduceContiguous(TopKWeightAndReduce):
    """fused_expert_output (T, k, K) or (T*k, K), one row per route -> sum_k w_tk * y_tk."""

    def apply(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input):
        T, k = topk_ids.shape
        K = fused_expert_output.shape[-1]
        y = fused_expert_output.reshape(T, k, K).float()
        if not apply_router_weight_on_input:
            y = y * topk_weights.reshape(T, k, 1).float()
        out = _out(output, T, K, fused_expert_output)
        out.copy_(y.sum(dim=1))
        return out


class TopKWeightAndReduceNaiveBatched(TopKWeightAndReduce):
    """fused_expert_output (El, B, K) in the batched format; topk_ids here are LOCAL expert ids
    (routes with an id outside [0, El), e.g. -1, are held elsewhere and skipped).

    Slot order convention: for local expert e, slot j holds the j-th route (in token-major,
    then topk order) whose id is e, as BatchedPrepareAndFinalize lays them out.
    """

    def apply(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input):
        El, _, K = fused_expert_output.shape
        T = topk_ids.shape[0]
        out = _out(output, T, K, fused_expert_output)
        acc = torch.zeros((T, K), dtype=torch.float32, device=fused_expert_output.device)
        for e in range(El):
            tok, slot = (topk_ids == e).nonzero(as_tuple=True)
            n = tok.numel()
            if n == 0:
                continue
            y = fused_expert_output[e, :n].float()
            if not apply_router_weight_on_input:
                y = y * topk_weights[tok, slot].float().unsqueeze(1)
            acc.index_add_(0, tok, y)
        out.copy_(acc)
        return out


class TopKWeightAndReduceDelegate(TopKWeightAndReduce):
    """A marker: the PrepareAndFinalize picks its own default reduction in finalize."""

    def apply(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input):
        raise RuntimeError(
            "TopKWeightAndReduceDelegate is a marker; the PrepareAndFinalize must replace it in finalize"
        )


def resolve_weight_and_reduce(impl: TopKWeightAndReduce, default: TopKWeightAndReduce) -> TopKWeightAndReduce:
    """The impl a PF should run: its own default when the experts delegate the choice."""
    return default if isinstance(impl, TopKWeightAndReduceDelegate) else impl
