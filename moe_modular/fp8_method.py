"""Fp8MoEMethod: fp8 e4m3 expert weights with the scales of moe.quant's scheme."""
from __future__ import annotations

from typing import Optional

import torch

from moe_modular.method import FusedMoEMethodBase
from moe_modular.quant import FP8_DTYPE, MoEQuantParams, quantize_weights, weight_scale_shape


class Fp8MoEMethod(FusedMoEMethodBase):
    """Weights are quantized from high precision in load_weights; static per-tensor schemes also
    take a1_scale / a2_scale (1,) float32 there."""

    def __init__(self, moe, backend="none", experts_type=None) -> None:
        if not moe.quant.is_quantized:
            raise ValueError("Fp8MoEMethod needs an fp8 moe.quant, got unquantized")
        super().__init__(moe, backend, experts_type)

    def create_weights(self, layer: torch.nn.Module, device: Optional[torch.device]) -> None:
        m = self.moe
        El, N, K = m.num_local_experts, m.intermediate_dim, m.hidden_dim
        layer.w13_weight = torch.nn.Parameter(torch.empty(El, 2 * N, K, dtype=FP8_DTYPE, device=device),
                                              requires_grad=False)
        layer.w2_weight = torch.nn.Parameter(torch.empty(El, K, N, dtype=FP8_DTYPE, device=device),
                                             requires_grad=False)
        layer.w13_weight_scale = torch.nn.Parameter(
            torch.ones(weight_scale_shape(m.quant, El, 2 * N, K), dtype=torch.float32, device=device), requires_grad=False)
        layer.w2_weight_scale = torch.nn.Parameter(
            torch.ones(weight_scale_shape(m.quant, El, K, N), dtype=torch.float32, device=device), requires_grad=False)
        if m.quant.static_activation_scale:
            layer.a13_scale = torch.nn.Parameter(torch.ones(1, device=device), requires_grad=False)
            layer.a2_scale = torch.nn.Parameter(torch.ones(1, device=device), requires_grad=False)

    def load_weights(self, layer, w13_EN2K, w2_EKN, **scales) -> None:
        self._check_weight_shapes(self.moe, w13_EN2K, w2_EKN)
        static = self.moe.quant.static_activation_scale
        expected = {"a1_scale", "a2_scale"} if static else set()
        if set(scales) != expected:
            raise ValueError(f"Fp8MoEMethod.load_weights for {self.moe.quant.name} takes scales "
                             f"{sorted(expected)}, got {sorted(scales)}")
        q13, s13 = quantize_weights(w13_EN2K, self.moe.quant)
        q2, s2 = quantize_weights(w2_EKN, self.moe.quant)
        layer.w13_weight.data.copy_(q13)
        layer.w2_weight.data.copy_(q2)
        layer.w13_weight_scale.data.copy_(s13)
        layer.w2_weight_scale.data.copy_(s2)
        if static:
            layer.a13_scale.data.copy_(scales["a1_scale"].reshape(1))
            layer.a2_scale.data.copy_(scales["a2_scale"].reshape(1))

    def quant_params(self, layer) -> MoEQuantParams:
        static = self.moe.quant.static_activation_scale
        return MoEQuantParams(self.moe.quant, layer.w13_weight_scale, layer.w2_weight_scale,
                              layer.a13_scale if static else None, layer.a2_scale if static else None)
