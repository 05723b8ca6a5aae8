"""NaiveBatchedExperts: BatchedExperts-format reference experts, a loop over local experts.

Shape legend: El local experts, B slots per expert, K hidden, N2 = w1 rows.
"""
from __future__ import annotations

import torch

from moe_modular.config import MoEConfig
from moe_modular.experts.common import expert_mlp_torch
from moe_modular.interfaces import ActivationFormat, FusedMoEExpertsModular
from moe_modular.quant import ActivationQuant, dequantize_activations
from moe_modular.weight_and_reduce import TopKWeightAndReduceDelegate


class NaiveBatchedExperts(FusedMoEExpertsModular):
    """Every dtype and quant scheme; for local expert e computes its expert_num_tokens[e] slots
    and writes (El, B, K); the PF, which knows the slot layout, weights and reduces."""

    @classmethod
    def supports(cls, moe: MoEConfig) -> tuple[bool, str]:
        return True, ""

    @classmethod
    def activation_formats(cls):
        return ActivationFormat.BatchedExperts, ActivationFormat.BatchedExperts

    def supports_expert_map(self) -> bool:
        return True

    def supports_chunking(self) -> bool:
        return False

    def workspace_shapes(self, M, N2, K, topk, global_num_experts, local_num_experts, expert_tokens_meta):
        # M is B here; workspace13 holds one expert's first-GEMM rows.
        return (M, N2), (1,), (local_num_experts, M, K), torch.float32

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceDelegate()

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input) -> None:
        """output (El, B, K); hidden_states (El, B, K); a1q_scale (1,) or (El, B, 1|G)."""
        if expert_tokens_meta is None:
            raise ValueError("NaiveBatchedExperts needs expert_tokens_meta (expert_num_tokens)")
        counts = expert_tokens_meta.expert_num_tokens_cpu
        if counts is None:
            counts = expert_tokens_meta.expert_num_tokens.cpu()
        cfg = self.quant.config
        per_row = a1q_scale is not None and cfg.activation is not ActivationQuant.PER_TENSOR
        for e in range(hidden_states.size(0)):
            n = int(counts[e])
            if n == 0:
                continue
            s = a1q_scale[e, :n] if per_row else a1q_scale
            x = dequantize_activations(hidden_states[e, :n], s, cfg)
            y = expert_mlp_torch(x, e, w1, w2, activation, self.quant, workspace13[:n])
            output[e, :n] = y.to(output.dtype)
