"""MoEPrepareAndFinalizeNoEP: one rank, Standard format; quantize in prepare, reduce in finalize.

Shape legend: T tokens, K hidden, k topk.
"""
from __future__ import annotations

from typing import Optional

import torch

from moe_modular.config import MoEConfig
from moe_modular.interfaces import (
    ActivationFormat,
    FusedMoEPrepareAndFinalizeModular,
    PrepareResult,
    check_supported,
)
from moe_modular.prepare_finalize.common import apply_weight_on_input, check_micro_batch
from moe_modular.quant import MoEQuantParams, quantize_activations
from moe_modular.weight_and_reduce import (
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceNoOp,
    resolve_weight_and_reduce,
)


class MoEPrepareAndFinalizeNoEP(FusedMoEPrepareAndFinalizeModular):
    """No dispatch: the experts see this rank's (T, K) tokens with the caller's routing."""

    @classmethod
    def supports(cls, moe: MoEConfig) -> tuple[bool, str]:
        if moe.ep_size != 1:
            return False, f"serves a single rank; ep_size is {moe.ep_size}"
        return True, ""

    @classmethod
    def make(cls, moe: MoEConfig, context=None) -> "MoEPrepareAndFinalizeNoEP":
        check_supported(cls, moe)
        return cls()

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                quant: MoEQuantParams, micro_batch: int = 0) -> PrepareResult:
        """a1 (T, K) -> a1q (T, K) fp8 or activation dtype, with its scale (no handle: finalize needs none)."""
        check_micro_batch(self, micro_batch)
        a1 = apply_weight_on_input(a1, topk_weights, apply_router_weight_on_input)
        a1q, scale = quantize_activations(a1, quant.config, quant.a1_scale)
        return PrepareResult(a1q=a1q, a1q_scale=scale)

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                 weight_and_reduce_impl, handle) -> None:
        impl = resolve_weight_and_reduce(weight_and_reduce_impl, TopKWeightAndReduceContiguous())
        impl.apply(output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input)

    def finalize_passes_through(self, weight_and_reduce_impl) -> bool:
        impl = resolve_weight_and_reduce(weight_and_reduce_impl, TopKWeightAndReduceContiguous())
        return isinstance(impl, TopKWeightAndReduceNoOp)

    @classmethod
    def activation_format(cls) -> ActivationFormat:
        return ActivationFormat.Standard

    def topk_indices_dtype(self) -> Optional[torch.dtype]:
        return None

    def max_num_tokens_per_rank(self) -> Optional[int]:
        return None

    def num_dispatchers(self) -> int:
        return 1

    def output_is_reduced(self) -> bool:
        return True
