"""BatchedPrepareAndFinalize: the single-rank reference of the BatchedExperts format.

Shape legend: T tokens, K hidden, k topk, El local experts, B = max tokens per expert slot
(max_num_tokens * num_dispatchers), G = ceil(K / group) activation scale groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from moe_modular.config import MoEConfig
from moe_modular.interfaces import (
    ActivationFormat,
    ExpertTokensMetadata,
    FusedMoEPrepareAndFinalizeModular,
    PrepareResult,
    check_supported,
)
from moe_modular.prepare_finalize.common import (
    apply_weight_on_input,
    check_micro_batch,
    finalize_handle,
    local_expert_ids,
)
from moe_modular.quant import ActivationQuant, MoEQuantParams, quantize_activations
from moe_modular.weight_and_reduce import TopKWeightAndReduceNaiveBatched, resolve_weight_and_reduce


@dataclass(frozen=True)
class _Routes:
    """What finalize needs from the prepare of the same forward (PrepareResult.handle)."""

    T: int
    local_ids_Tk: torch.Tensor  # (T, k) int64 local ids (-1: not held here), by which prepare laid out the slots


class BatchedPrepareAndFinalize(FusedMoEPrepareAndFinalizeModular):
    """Scatter each route's token into its local expert's slots: (El, B, K) + expert_num_tokens.

    Slot order: for local expert e, routes in token-major then topk order. Routes to experts not
    held here (expert_map -1) are dropped and contribute zero.
    """

    def __init__(self, max_num_tokens: int, num_local_experts: int, num_dispatchers: int = 1, rank: int = 0):
        for name, v, lo in (("max_num_tokens", max_num_tokens, 1), ("num_local_experts", num_local_experts, 1),
                            ("num_dispatchers", num_dispatchers, 1), ("rank", rank, 0)):
            if not isinstance(v, int) or v < lo:
                raise ValueError(f"BatchedPrepareAndFinalize.{name} ({v!r}) must be an int >= {lo}")
        self.max_num_tokens = max_num_tokens
        self.num_local_experts = num_local_experts
        self._num_dispatchers = num_dispatchers
        self.rank = rank

    @classmethod
    def supports(cls, moe: MoEConfig) -> tuple[bool, str]:
        if moe.ep_size != 1:
            return False, f"single-rank reference; ep_size is {moe.ep_size}"
        return True, ""

    @classmethod
    def make(cls, moe: MoEConfig, context=None) -> "BatchedPrepareAndFinalize":
        check_supported(cls, moe)
        return cls(moe.max_num_tokens, moe.num_local_experts, 1, moe.ep_rank)

    def _local_ids(self, topk_ids, expert_map):
        return local_expert_ids(topk_ids, expert_map, self.rank * self.num_local_experts, self.num_local_experts)

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                quant: MoEQuantParams, micro_batch: int = 0) -> PrepareResult:
        """a1 (T, K) -> a1q (El, B, K), scale (1,) per-tensor / (El, B, 1) per-token / (El, B, G) group."""
        check_micro_batch(self, micro_batch)
        T, K = a1.shape
        if T > self.max_num_tokens:
            raise ValueError(f"tokens ({T}) must be <= max_num_tokens ({self.max_num_tokens})")
        El, B = self.num_local_experts, self.max_num_tokens * self._num_dispatchers
        a1 = apply_weight_on_input(a1, topk_weights, apply_router_weight_on_input)
        aq, scale = quantize_activations(a1, quant.config, quant.a1_scale)
        local = self._local_ids(topk_ids, expert_map)
        b_a1q = torch.zeros((El, B, K), dtype=aq.dtype, device=a1.device)
        row_scaled = scale is not None and quant.config.activation is not ActivationQuant.PER_TENSOR
        b_scale = (torch.ones((El, B, scale.size(1)), dtype=torch.float32, device=a1.device)
                   if row_scaled else scale)
        counts = torch.zeros(El, dtype=torch.int32, device=a1.device)
        for e in range(El):
            tok, _ = (local == e).nonzero(as_tuple=True)
            n = tok.numel()
            if n == 0:
                continue
            b_a1q[e, :n] = aq[tok]
            if row_scaled:
                b_scale[e, :n] = scale[tok]
            counts[e] = n
        meta = ExpertTokensMetadata(expert_num_tokens=counts, expert_num_tokens_cpu=counts.cpu())
        return PrepareResult(a1q=b_a1q, a1q_scale=b_scale, expert_tokens_meta=meta, handle=_Routes(T, local))

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                 weight_and_reduce_impl, handle) -> None:
        impl = resolve_weight_and_reduce(weight_and_reduce_impl, TopKWeightAndReduceNaiveBatched())
        routes = finalize_handle(self, handle, _Routes, output.size(0))
        # The batched reduction reads local ids; prepare laid the slots out by them.
        impl.apply(output, fused_expert_output, topk_weights, routes.local_ids_Tk, apply_router_weight_on_input)

    @classmethod
    def activation_format(cls) -> ActivationFormat:
        return ActivationFormat.BatchedExperts

    def topk_indices_dtype(self) -> Optional[torch.dtype]:
        return None

    def max_num_tokens_per_rank(self) -> Optional[int]:
        return self.max_num_tokens

    def num_dispatchers(self) -> int:
        return self._num_dispatchers

    def output_is_reduced(self) -> bool:
        return True
