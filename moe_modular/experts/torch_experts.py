"""TorchExperts: Standard-format reference experts, a per-expert loop in float32.

Shape legend: T tokens, k topk, K hidden, N2 = w1 rows, El local experts.
"""
from __future__ import annotations

import torch

from moe_modular.config import MoEConfig
from moe_modular.experts.common import expert_mlp_torch
from moe_modular.interfaces import ActivationFormat, FusedMoEExpertsModular
from moe_modular.quant import dequantize_activations
from moe_modular.routing import local_route_ids
from moe_modular.weight_and_reduce import TopKWeightAndReduceContiguous


class TorchExperts(FusedMoEExpertsModular):
    """Every dtype and quant scheme (weights dequantized per expert); writes (T, k, K) unreduced
    route outputs (zero for routes whose expert is not held here) and leaves the weighted sum to
    the PF (TopKWeightAndReduceContiguous)."""

    @classmethod
    def supports(cls, moe: MoEConfig) -> tuple[bool, str]:
        return True, ""

    @classmethod
    def activation_formats(cls):
        return ActivationFormat.Standard, ActivationFormat.Standard

    def supports_expert_map(self) -> bool:
        return True

    def supports_chunking(self) -> bool:
        return True

    def workspace_shapes(self, M, N2, K, topk, global_num_experts, local_num_experts, expert_tokens_meta):
        # workspace13 holds the first GEMM's rows (at most M*topk routes), workspace2 is unused.
        return (M * topk, N2), (1,), (M, topk, K), torch.float32

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceContiguous()

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input) -> None:
        """output (T, k, K); hidden_states (T, K) fp8 or activation dtype; topk_ids (T, k) global ids
        (mapped through expert_map) or local ids with -1 when expert_map is None; a route whose id is out of
        range is not computed (its row stays zero)."""
        T, k = topk_ids.shape
        x = dequantize_activations(hidden_states, a1q_scale, self.quant.config)
        flat = local_route_ids(topk_ids, expert_map, w1.size(0)).reshape(-1)
        out = output.view(T * k, -1)
        out.zero_()
        tok_of_route = torch.arange(T, device=x.device).repeat_interleave(k)
        for e in torch.unique(flat).tolist():
            if e < 0:
                continue
            routes = (flat == e).nonzero().squeeze(1)
            h = workspace13[: routes.numel()]
            y = expert_mlp_torch(x[tok_of_route[routes]], e, w1, w2, activation, self.quant, h)
            out[routes] = y.to(out.dtype)
