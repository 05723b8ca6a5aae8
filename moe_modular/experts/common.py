"""Torch building blocks shared by the reference experts.

Shape legend: R rows (routes of one expert), K hidden, N intermediate, N2 = 2N.
"""
from __future__ import annotations

from typing import Optional

import torch

from moe_modular.config import Activation
from moe_modular.activation import act_and_mul_torch
from moe_modular.quant import MoEQuantParams, dequantize_weights, fake_quantize_activations


def expert_mlp_torch(
    x_RK: torch.Tensor,
    e: int,
    w1: torch.Tensor,
    w2: torch.Tensor,
    activation: Activation,
    quant: MoEQuantParams,
    h_RN2: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One expert's MLP on float32 rows x_RK (R, K) -> (R, K) float32.

    w1 (El, N2, K), w2 (El, K, N) in the weight dtype, dequantized here with quant's scales;
    the intermediate is quantized like the kernels do (fake-quant with a2_scale).
    h_RN2: optional float32 (R, N2) scratch for the first GEMM.
    """
    cfg = quant.config
    w1e = dequantize_weights(w1[e:e + 1], None if quant.w1_scale is None else quant.w1_scale[e:e + 1], cfg)[0]
    w2e = dequantize_weights(w2[e:e + 1], None if quant.w2_scale is None else quant.w2_scale[e:e + 1], cfg)[0]
    if h_RN2 is None:
        h_RN2 = x_RK @ w1e.t()
    else:
        torch.matmul(x_RK, w1e.t(), out=h_RN2)
    h = act_and_mul_torch(h_RN2, activation)
    h = fake_quantize_activations(h, quant, quant.a2_scale)
    return h @ w2e.t()

