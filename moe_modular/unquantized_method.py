"""UnquantizedFusedMoEMethod: bf16 / fp16 / fp32 expert weights."""
from __future__ import annotations

from typing import Optional

import torch

from moe_modular.method import FusedMoEMethodBase
from moe_modular.quant import MoEQuantParams


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    def __init__(self, moe, backend="none", experts_type=None) -> None:
        if moe.quant.is_quantized:
            raise ValueError(f"UnquantizedFusedMoEMethod needs moe.quant unquantized, got {moe.quant.name}")
        super().__init__(moe, backend, experts_type)

    def create_weights(self, layer: torch.nn.Module, device: Optional[torch.device]) -> None:
        m = self.moe
        kw = dict(dtype=m.dtype, device=device)
        layer.w13_weight = torch.nn.Parameter(
            torch.empty(m.num_local_experts, 2 * m.intermediate_dim, m.hidden_dim, **kw), requires_grad=False)
        layer.w2_weight = torch.nn.Parameter(
            torch.empty(m.num_local_experts, m.hidden_dim, m.intermediate_dim, **kw), requires_grad=False)

    def load_weights(self, layer, w13_EN2K, w2_EKN, **scales) -> None:
        if scales:
            raise ValueError(f"UnquantizedFusedMoEMethod.load_weights takes no scales, got {sorted(scales)}")
        self._check_weight_shapes(self.moe, w13_EN2K, w2_EKN)
        layer.w13_weight.data.copy_(w13_EN2K)
        layer.w2_weight.data.copy_(w2_EKN)

    def quant_params(self, layer) -> MoEQuantParams:
        return MoEQuantParams(self.moe.quant)
