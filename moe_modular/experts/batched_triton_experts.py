"""BatchedTritonExperts: BatchedExperts-format experts in Triton.

Shape legend: El local experts, Bt slots per expert, K hidden, N2 = w1 rows, N = N2 / 2,
G groups of the intermediate.

Expert e computes its first expert_num_tokens[e] slots (read on the device; no host sync):
  GEMM1 (El, Bt, N2) -> act_and_mul (+ fp8 re-quantization) -> GEMM2 into output (El, Bt, K).
Slots at or past expert_num_tokens[e] are left untouched; the PF weights and reduces the rest.
"""
from __future__ import annotations

from typing import Optional

import torch

from moe_modular.config import Activation
from moe_modular.experts.triton_common import check_device, h1_view
from moe_modular.experts.triton_plan import WorkspaceLayout, batched_layout, fuses_activation
from moe_modular.experts.triton_experts_base import TritonExpertsBase
from moe_modular.interfaces import ActivationFormat, ExpertTokensMetadata
from moe_modular.kernels.gemm_config import AScale, BatchedRows, GemmEpilogue, GemmScales
from moe_modular.weight_and_reduce import TopKWeightAndReduceDelegate

try:  # the kernels apply launches, imported once (not on every forward); without triton supports() says no
    from moe_modular.kernels.act_and_mul import RowMode, act_and_mul
    from moe_modular.kernels.moe_gemm import moe_gemm
except ImportError:  # pragma: no cover - triton is a dependency; triton_common.TRITON_IMPORT_ERROR says why
    pass


class BatchedTritonExperts(TritonExpertsBase):
    """bf16 / fp16 / fp32, unquantized or any fp8 scheme (as TritonExperts); SiLU, GELU,
    swiglu-oai. Takes slots already grouped per local expert, so expert maps were applied by the
    PF. Writes unweighted (El, Bt, K) slot outputs; the PF picks the reduction (Delegate).

    Extra keywords (tile_table, tile_config, fuse_activation): TritonExpertsBase.
    """

    @classmethod
    def activation_formats(cls) -> tuple[ActivationFormat, ActivationFormat]:
        return ActivationFormat.BatchedExperts, ActivationFormat.BatchedExperts

    def supports_chunking(self) -> bool:
        return False

    def _layout(self, B: int, N2: int, K: int, El: int) -> tuple[int, WorkspaceLayout]:
        return self._layouts.get_or_make(
            (B, N2, K, El), lambda: batched_layout(self.moe, self._fused(self.moe.activation), B, N2, El))

    def _fused(self, activation: Activation) -> bool:
        return fuses_activation(self.fuse_activation, self.moe.quant, activation)

    def workspace_shapes(self, M, N2, K, topk, global_num_experts, local_num_experts, expert_tokens_meta):
        """M is Bt. workspace13 holds h1 (El, Bt, N2) (nothing when the first GEMM applies the
        activation); workspace2 the intermediate and its scales. Output (El, Bt, K) unweighted."""
        ws13, ws2 = self._layout(M, N2, K, local_num_experts)
        return (ws13,), (ws2.numel(self.moe.dtype),), (local_num_experts, M, K), self.moe.dtype

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceDelegate()

    def apply(
        self,
        output: torch.Tensor,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: Activation,
        global_num_experts: int,
        expert_map: Optional[torch.Tensor],
        a1q_scale: Optional[torch.Tensor],
        a2_scale: Optional[torch.Tensor],
        workspace13: torch.Tensor,
        workspace2: torch.Tensor,
        expert_tokens_meta: Optional[ExpertTokensMetadata],
        apply_router_weight_on_input: bool,
    ) -> None:
        """output (El, Bt, K) activation dtype; hidden_states (El, Bt, K) fp8 (a1q_scale (1,) /
        (El, Bt, 1) / (El, Bt, G)) or the activation dtype; w1 (El, N2, K), w2 (El, K, N);
        expert_tokens_meta.expert_num_tokens (El,) int32 on the device; a2_scale (1,) when static.
        topk_weights / topk_ids / expert_map are not read (the PF reduces)."""
        if expert_tokens_meta is None:
            raise ValueError("BatchedTritonExperts needs expert_tokens_meta (expert_num_tokens)")
        check_device(hidden_states)
        El, B, K = hidden_states.shape
        _, N2, _ = w1.shape
        if w1.shape[0] != El:
            raise ValueError(f"hidden_states experts ({El}) must equal w1.size(0) ({w1.shape[0]})")
        N = N2 // 2
        counts = expert_tokens_meta.expert_num_tokens
        activation = Activation.parse(activation)
        q, modes = self.quant, self.modes
        group = q.config.block_shape if q.config.is_block else (1, 1)
        cfg = self.tiles(B, El, N, K, self.moe.topk, hidden_states.device)
        _, layout = self._layout(B, N2, K, El)
        buf = layout.carve(workspace2)
        a1_mode = modes.a1
        if a1_mode is AScale.TENSOR and a1q_scale is not None and a1q_scale.numel() != 1:
            raise ValueError(f"a1q_scale ({tuple(a1q_scale.shape)}) must be (1,) for {q.config.name}")

        inter = buf["intermediate"]
        inter_scale = buf.get("intermediate_scale", a2_scale)
        rows = BatchedRows(counts)
        if self._fused(activation):
            moe_gemm(hidden_states, w1, inter.view(El, B, N), self.tiles.fused_gemm1(cfg.gemm1), rows,
                     epilogue=GemmEpilogue(activation), launch=cfg.launch1)
        else:
            h1 = h1_view(workspace13, (El, B, N2), self.moe, self._fused(self.moe.activation), activation)
            moe_gemm(hidden_states, w1, h1, cfg.gemm1, rows,
                     scales=GemmScales(a1q_scale, a1_mode, q.w1_scale, modes.w, group), launch=cfg.launch1)
            act_and_mul(h1.view(El * B, N2), activation, inter, quant=modes.intermediate, scale=inter_scale,
                        amax_El=buf.get("amax"), group_size=group[1] if q.config.is_block else 128,
                        row_mode=RowMode.BATCHED, num_local_experts=El, expert_num_tokens_El=counts, slots=B)
        if inter_scale is not None and inter_scale.dim() == 2:
            inter_scale = inter_scale.view(El, B, inter_scale.shape[1])
        moe_gemm(inter.view(El, B, N), w2, output, cfg.gemm2, rows,
                 scales=GemmScales(inter_scale, modes.a2, q.w2_scale, modes.w, group), launch=cfg.launch2)
