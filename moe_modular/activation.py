"""The gated activations, act(gate) * up, in float32 torch: the definition the Triton kernels
(kernels/act_and_mul.py, the first GEMM's fused epilogue) are checked against, and what the torch experts
and the oracle compute. Needs torch only."""
from __future__ import annotations

import torch

from moe_modular.config import Activation

SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0


def act_and_mul_torch(x_TN2: torch.Tensor, activation: Activation) -> torch.Tensor:
    """Float32 oracle: x_TN2 (T, 2N) any float dtype -> (T, N) float32."""
    x = x_TN2.float()
    if activation is Activation.SWIGLU_OAI:
        gate, up = x[..., 0::2], x[..., 1::2]
        gate = gate.clamp(max=SWIGLU_OAI_LIMIT)
        up = up.clamp(min=-SWIGLU_OAI_LIMIT, max=SWIGLU_OAI_LIMIT)
        return (up + 1.0) * gate * torch.sigmoid(SWIGLU_OAI_ALPHA * gate)
    n = x.shape[-1] // 2
    gate, up = x[..., :n], x[..., n:]
    if activation is Activation.SILU:
        return torch.nn.functional.silu(gate) * up
    if activation is Activation.GELU:
        return torch.nn.functional.gelu(gate) * up
    raise ValueError(f"activation ({activation!r}) must be one of {[a.value for a in Activation]}")
