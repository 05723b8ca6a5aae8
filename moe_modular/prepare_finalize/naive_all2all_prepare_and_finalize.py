"""NaiveAll2AllPrepareAndFinalize: every rank sees every rank's tokens (broadcasts), partial sums
are all-reduced. The simple reference of expert parallelism.

Shape legend: T tokens on this rank, Tall tokens of all ranks, K hidden, k topk, El local experts,
G activation scale groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from all2all.base import All2AllHandleConfig, All2AllManager, RowLayout
from moe_modular.config import MoEConfig
from moe_modular.interfaces import (
    ActivationFormat,
    ExpertTokensMetadata,
    PrepareResult,
)
from moe_modular.prepare_finalize.common import apply_weight_on_input, buffer_tag, check_micro_batch, finalize_handle
from moe_modular.prepare_finalize.ep_common import (
    ExpertPlacementTables,
    activation_row_bytes,
    local_expert_counts,
    masked_weights,
    scale_width,
    token_row_format,
)
from moe_modular.prepare_finalize.ep_prepare_and_finalize import EPPrepareAndFinalize
from moe_modular.wire_bytes import FLOAT32_BYTES, PhaseBytes, RouteCounts
from moe_modular.profiler_scope import phase
from moe_modular.quant import FP8_DTYPE, ActivationQuant, MoEQuantParams, QuantConfig, quantize_activations
from moe_modular.weight_and_reduce import (
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceNoOp,
    resolve_weight_and_reduce,
)


@dataclass(frozen=True)
class _Gathered:
    """What finalize needs from the prepare of the same forward (PrepareResult.handle)."""

    T: int
    micro_batch: int
    layout: RowLayout
    local_Ak: torch.Tensor  # (Tall, k) int64 local ids, -1 when held elsewhere
    weights_Ak: torch.Tensor  # (Tall, k) float32


class NaiveAll2AllPrepareAndFinalize(EPPrepareAndFinalize):
    """Standard-format EP over the gather family of managers (here: `naive`).

    prepare gathers all ranks' tokens (Tall, K) to every rank and returns them with LOCAL
    expert ids (-1 for routes held elsewhere) and their weights; the modular kernel then calls
    the experts with expert_map=None. finalize weights and sums this rank's routes per token in
    float32, sums those partials over ranks (float32) and keeps this rank's T rows.

    Quantization: a dynamic per-tensor scale is computed after the gather, over all tokens (the
    scale of the whole EP batch, no extra collective); every other scheme quantizes before
    (per-token / group scales travel in the row, a static scale is known everywhere). fp8
    travels as bytes.
    """

    BACKEND = "naive"
    # The combine's float32 partial sums a rank sends, in units of (W-1) * T * K: a ring all-reduce sends twice what a
    # reduce-scatter does.
    COMBINE_PARTIAL_SENDS = 2

    def __init__(self, moe: MoEConfig, manager: All2AllManager) -> None:
        super().__init__(moe, manager)
        self.tables = ExpertPlacementTables.build(moe, manager.device)
        self.before = type(self).quantizes_before_dispatch(moe.quant)
        x_dtype = FP8_DTYPE if (self.before and moe.quant.is_quantized) else moe.dtype
        self.n_scale = scale_width(moe.quant, moe.hidden_dim)
        self.row_format = token_row_format(moe.hidden_dim, x_dtype, self.n_scale, moe.topk, True)
        self.handle = manager.get_handle(
            All2AllHandleConfig(moe.max_num_tokens, self.row_format.row_bytes, moe.num_experts, moe.topk))

    # ---- capabilities -----------------------------------------------------------------------
    @classmethod
    def supports(cls, moe: MoEConfig) -> tuple[bool, str]:
        """Every dtype, scheme, placement and world size; see quantizes_before_dispatch."""
        return True, ""

    @classmethod
    def quantizes_before_dispatch(cls, quant: QuantConfig) -> bool:
        """False only for a dynamic per-tensor scale (computed after the gather, over all tokens)."""
        return not (quant.is_quantized and quant.activation is ActivationQuant.PER_TENSOR
                    and not quant.static_activation_scale)

    @classmethod
    def wire_bytes(cls, moe: MoEConfig, counts: RouteCounts, wire, experts_reduce: bool) -> PhaseBytes:
        """The gather: every rank receives the other W-1 ranks' T rows; the combine: the (W*T, K) float32 partial
        sums summed over ranks, COMBINE_PARTIAL_SENDS * (W-1) * T * K values sent per rank."""
        W, T, K = counts.world_size, counts.tokens_per_rank, moe.hidden_dim
        row = activation_row_bytes(moe, moe.quant.is_quantized and cls.quantizes_before_dispatch(moe.quant))
        return PhaseBytes.of([(W - 1) * T * row] * W, [cls.COMBINE_PARTIAL_SENDS * (W - 1) * T * K * FLOAT32_BYTES] * W)

    @classmethod
    def vllm_all2all_backend(cls) -> Optional[str]:
        return "naive"

    @classmethod
    def activation_format(cls) -> ActivationFormat:
        return ActivationFormat.Standard

    def topk_indices_dtype(self) -> Optional[torch.dtype]:
        return None

    def max_num_tokens_per_rank(self) -> Optional[int]:
        return None

    def has_prepare_no_receive(self) -> bool:
        return True

    # ---- prepare ------------------------------------------------------------------------------
    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                quant: MoEQuantParams, micro_batch: int = 0) -> PrepareResult:
        """a1 (T, K); topk_weights (T, k) float32; topk_ids (T, k) global ids (-1: no route).
        Returns all ranks' tokens: a1q (Tall, K), a1q_scale (1,) / (Tall, 1) / (Tall, G) / None,
        topk_ids (Tall, k) local ids or -1, topk_weights (Tall, k), expert_tokens_meta."""
        return self._start(a1, topk_weights, topk_ids, num_experts, apply_router_weight_on_input, quant, False,
                           micro_batch)()

    def prepare_no_receive(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                           quant: MoEQuantParams, micro_batch: int = 0) -> Callable[[], PrepareResult]:
        return self._start(a1, topk_weights, topk_ids, num_experts, apply_router_weight_on_input, quant, True,
                           micro_batch)

    def _start(self, a1, topk_weights, topk_ids, num_experts, apply_on_input, quant: MoEQuantParams,
               async_op: bool, micro_batch: int) -> Callable[[], PrepareResult]:
        moe = self.moe
        mb = check_micro_batch(self, micro_batch)
        if num_experts != moe.num_experts:
            raise ValueError(f"num_experts ({num_experts}) must equal moe.num_experts ({moe.num_experts})")
        T = a1.size(0)
        a1 = apply_weight_on_input(a1, topk_weights, apply_on_input)
        if self.before:
            xq, scale = quantize_activations(a1, quant.config, quant.a1_scale)
        else:
            xq, scale = a1, None
        layout = self.manager.gather_counts(T)
        fields = [xq] + ([scale] if self.n_scale else []) + [topk_ids.to(torch.int32), topk_weights.float()]
        with phase("dispatch"):
            pending = self.manager.dispatch(self.handle, self.row_format.pack(fields), layout,
                                            async_op=async_op, tag=buffer_tag("tokens", mb))
        per_tensor_scale = scale if (scale is not None and not self.n_scale) else None

        def receive() -> PrepareResult:
            got = self.row_format.unpack(pending.wait())
            x, s = got["x"], (got["scale"] if self.n_scale else per_tensor_scale)
            if not self.before:
                x, s = quantize_activations(x, quant.config, quant.a1_scale)
            local_Ak = self.tables.local_on(got["ids"], self.rank)
            meta = ExpertTokensMetadata(expert_num_tokens=local_expert_counts(local_Ak, moe.num_local_experts))
            return PrepareResult(a1q=x, a1q_scale=s, expert_tokens_meta=meta, topk_ids=local_Ak,
                                 topk_weights=got["weights"], handle=_Gathered(T, mb, layout, local_Ak, got["weights"]))

        return receive

    # ---- finalize -----------------------------------------------------------------------------
    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                 weight_and_reduce_impl, handle) -> None:
        """output (T, K); fused_expert_output (Tall, k, K) / (Tall*k, K) route rows, or (Tall, K)
        already reduced by the experts (NoOp)."""
        st = finalize_handle(self, handle, _Gathered, output.size(0))
        impl = resolve_weight_and_reduce(weight_and_reduce_impl, TopKWeightAndReduceContiguous())
        A, K = st.local_Ak.size(0), self.moe.hidden_dim
        partial_AK = torch.empty((A, K), dtype=torch.float32, device=fused_expert_output.device)
        if isinstance(impl, TopKWeightAndReduceNoOp):
            if tuple(fused_expert_output.shape) != (A, K):
                raise ValueError(f"reduced expert output must be ({A}, {K}), got {tuple(fused_expert_output.shape)}")
            partial_AK.copy_(fused_expert_output)
        else:
            impl.apply(partial_AK, fused_expert_output, masked_weights(st.weights_Ak, st.local_Ak), st.local_Ak,
                       apply_router_weight_on_input)
        with phase("combine"):
            mine_TK = self.manager.combine(self.handle, partial_AK, st.layout,
                                           tag=buffer_tag("partials", st.micro_batch)).wait()
        output.copy_(mine_TK.to(output.dtype))
