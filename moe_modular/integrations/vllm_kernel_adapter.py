"""VllmKernelAdapter: moe-modular's FusedMoEModularKernel in the place of vLLM's FusedMoEKernel.

vLLM's fused-MoE methods keep their kernel in `method.moe_kernel` and call
`moe_kernel.apply(hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
expert_map, apply_router_weight_on_input, shared_experts, shared_experts_input)`; the layer and
its runner also read `is_monolithic`, `can_overlap_shared_experts`, `output_is_reduced()`,
`prepare_finalize.topk_indices_dtype()`, `fused_experts.process_weights_after_loading(layer)` and (0.34)
`fused_experts.keep_constants(layer)`; 0.34 also passes `a1q_scale` (input quantized before the call,
which vLLM does for its monolithic kernels only).
This class answers those with moe-modular's kernel underneath.

Shape legend: T tokens on this rank, K hidden, k topk, El local experts, N2 = 2 * intermediate.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from moe_modular.config import Activation
from moe_modular.modular_kernel import FusedMoEModularKernel


class VllmKernelAdapter:
    """kernel: the moe-modular kernel for one layer.
    activation: the layer's activation in moe-modular's enum (vLLM's is checked against it per call).
    output_is_reduced: vLLM's meaning: True when the kernel's output needs no further all-reduce
      over the tensor/expert-parallel ranks (an EP PF that combined), False when vLLM's runner
      must sum the ranks' partial outputs (single-rank PF on a sharded layer).
    layer_name: for log lines.

    `num_forward_calls` counts apply() calls, so a test can prove this kernel ran.
    vLLM also reaches the experts through `moe_kernel.fused_experts`; that is this object, whose
    `process_weights_after_loading` leaves the checkpoint layout untouched (moe-modular reads
    w13 (El, N2, K) and w2 (El, K, N2/2) as vLLM loads them).
    """

    is_monolithic = False
    can_overlap_shared_experts = False
    consumes_expert_mask = False

    def __init__(self, kernel: FusedMoEModularKernel, activation: Activation, output_is_reduced: bool,
                 layer_name: str = "") -> None:
        if not isinstance(kernel, FusedMoEModularKernel):
            raise TypeError(f"kernel ({type(kernel).__name__}) must be a FusedMoEModularKernel")
        if not isinstance(activation, Activation):
            raise TypeError(f"activation ({activation!r}) must be one of {[a.value for a in Activation]}")
        self.kernel = kernel
        self.activation = activation
        self._output_is_reduced = bool(output_is_reduced)
        self.layer_name = layer_name
        self.num_forward_calls = 0

    # ---- what vLLM reads -------------------------------------------------------------------
    @property
    def prepare_finalize(self):
        return self.kernel.prepare_finalize

    @property
    def fused_experts(self) -> "VllmKernelAdapter":
        return self

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Nothing to repack: the kernel reads vLLM's (El, N2, K) / (El, K, N) weights directly."""

    def keep_constants(self, layer: torch.nn.Module, prefix: str = "_experts_") -> None:
        """Nothing to keep on the layer: the kernel's derived tensors (workspaces, plans) are its own."""

    def output_is_reduced(self) -> bool:
        return self._output_is_reduced

    def supports_deferred_moe_finalize(self) -> bool:
        return False

    def supports_lora(self) -> bool:
        return False

    def describe(self) -> str:
        return (f"FusedMoEModularKernel({type(self.kernel.prepare_finalize).__name__}, "
                f"{type(self.kernel.fused_experts).__name__})")

    # ---- the forward -------------------------------------------------------------------------
    def apply(
        self,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: Any,
        global_num_experts: int,
        expert_map: Optional[torch.Tensor],
        apply_router_weight_on_input: bool,
        shared_experts: Any = None,
        shared_experts_input: Optional[torch.Tensor] = None,
        a1q_scale: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """hidden_states (T, K) bf16/fp16/fp32; w1 (El, N2, K); w2 (El, K, N2/2); topk_weights (T, k)
        float; topk_ids (T, k) int32/int64 global ids; expert_map (E,) int32 global -> local or -1.
        activation: vLLM's MoEActivation (must equal the planned one). Shared experts are not run
        here: `can_overlap_shared_experts` is False, so vLLM's runner runs them itself.
        a1q_scale: must be None (moe-modular quantizes the input itself, in its PrepareAndFinalize).
        Returns (T, K) in hidden_states' dtype."""
        if a1q_scale is not None:
            raise ValueError("a1q_scale (a scale of input quantized before the call) must be None: moe-modular's "
                             "kernel takes unquantized hidden_states and quantizes them itself")
        value = getattr(activation, "value", activation)
        if value != self.activation.value:
            raise ValueError(
                f"activation ({value!r}) must be {self.activation.value!r}, the one this kernel was built for"
            )
        if topk_weights.dtype != torch.float32:
            topk_weights = topk_weights.float()
        out = self.kernel(
            hidden_states, w1, w2, topk_weights, topk_ids,
            activation=self.activation,
            global_num_experts=global_num_experts,
            expert_map=expert_map,
            apply_router_weight_on_input=apply_router_weight_on_input,
        )
        self.num_forward_calls += 1
        return out
