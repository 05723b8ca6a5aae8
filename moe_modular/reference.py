"""moe_torch: the float32 oracle every test compares against.

Shape legend: T tokens, K hidden, N intermediate, N2 = 2N, E experts (global, or local when an
expert_map is given), k topk.

Quantized schemes are modelled exactly as the kernels see them: weights are the given quantized
tensors dequantized with their scales; activations (the input and the intermediate) are quantized
and dequantized with the same scheme; all arithmetic is float32.
"""
from __future__ import annotations

from typing import Optional

import torch

from moe_modular.config import Activation
from moe_modular.activation import act_and_mul_torch
from moe_modular.quant import MoEQuantParams, dequantize_weights, fake_quantize_activations
from moe_modular.routing import local_route_ids


def moe_torch(
    hidden_TK: torch.Tensor,
    w1_EN2K: torch.Tensor,
    w2_EKN: torch.Tensor,
    topk_weights_Tk: torch.Tensor,
    topk_ids_Tk: torch.Tensor,
    activation: Activation = Activation.SILU,
    quant: Optional[MoEQuantParams] = None,
    expert_map: Optional[torch.Tensor] = None,
    apply_router_weight_on_input: bool = False,
) -> torch.Tensor:
    """Reference MoE forward in float32.

    hidden_TK (T, K) float; w1_EN2K (E, 2N, K), w2_EKN (E, K, N) float or fp8 (scales in `quant`);
    topk_weights_Tk (T, k) float; topk_ids_Tk (T, k) int global expert ids;
    expert_map (E_global,) int: global id -> index into w1/w2, -1 for experts not held (their
    routes contribute zero); an id out of range contributes zero too. Returns (T, K) float32.
    """
    quant = quant or MoEQuantParams()
    T, K = hidden_TK.shape
    topk = topk_ids_Tk.shape[1]
    if apply_router_weight_on_input and topk != 1:
        raise ValueError(f"apply_router_weight_on_input needs topk == 1, got topk ({topk})")
    a = hidden_TK.float()
    if apply_router_weight_on_input:
        a = a * topk_weights_Tk.float()
    a = fake_quantize_activations(a, quant, quant.a1_scale)
    w1 = dequantize_weights(w1_EN2K, quant.w1_scale, quant.config)
    w2 = dequantize_weights(w2_EKN, quant.w2_scale, quant.config)

    ids = local_route_ids(topk_ids_Tk, expert_map, w1.size(0))
    out = torch.zeros((T, K), dtype=torch.float32, device=hidden_TK.device)
    flat_ids = ids.reshape(-1)
    flat_tok = torch.arange(T, device=a.device).repeat_interleave(topk)
    flat_w = topk_weights_Tk.float().reshape(-1)
    for e in torch.unique(flat_ids).tolist():
        if e < 0:
            continue
        sel = (flat_ids == e).nonzero().squeeze(1)
        tok = flat_tok[sel]
        h = a[tok] @ w1[e].t()
        h = act_and_mul_torch(h, activation)
        h = fake_quantize_activations(h, quant, quant.a2_scale)
        y = h @ w2[e].t()
        if not apply_router_weight_on_input:
            y = y * flat_w[sel].unsqueeze(1)
        out.index_add_(0, tok, y)
    return out
