"""DeepEPHTPrepareAndFinalize: Standard-format expert parallelism over DeepEP's high-throughput kernels.

Shape legend: T tokens on this rank, R tokens received, K hidden, Kp hidden padded to DeepEP's row
alignment, k topk, El local experts, W ranks, G activation scale groups (ceil(K / group)).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from all2all.deepep import (
    HT_COMBINE_DTYPE,
    HT_MAX_TOPK,
    DeepEPHighThroughputManager,
    DeepEPHTBufferConfig,
    ht_padded_hidden,
    ht_rank_count_error,
)
from moe_modular.config import MoEConfig
from moe_modular.interfaces import (
    ActivationFormat,
    ExpertTokensMetadata,
    PrepareResult,
)
from moe_modular.prepare_finalize.common import apply_weight_on_input, check_micro_batch, finalize_handle
from moe_modular.prepare_finalize.deepep_common import (
    deepep_supports,
    linear_expert_table,
    pad_hidden,
    to_linear_ids,
)
from moe_modular.prepare_finalize.ep_common import (
    ExpertPlacementTables,
    masked_weights,
    quantize_for_dispatch,
    scale_width,
)
from moe_modular.prepare_finalize.ep_prepare_and_finalize import EPPrepareAndFinalize
from moe_modular.wire_bytes import PhaseBytes, RouteCounts, token_row_bytes
from moe_modular.profiler_scope import phase
from moe_modular.quant import FP8_DTYPE, ActivationQuant, MoEQuantParams, QuantConfig, quantize_activations
from moe_modular.weight_and_reduce import (
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceNoOp,
    resolve_weight_and_reduce,
)


@dataclass(frozen=True)
class _Dispatched:
    """What finalize needs from the prepare of the same forward (PrepareResult.handle)."""

    T: int
    handle: Any  # DeepEP's communication handle
    recv_local_Rk: torch.Tensor  # (R, k) int64 local ids, -1 for routes held elsewhere
    recv_weights_Rk: torch.Tensor  # (R, k) float32


class DeepEPHTPrepareAndFinalize(EPPrepareAndFinalize):
    """Each token travels once to every rank holding one of its experts (DeepEP normal kernels).

    prepare: int64 ids (topk_indices_dtype); fp8 group ("block") schemes are quantized before the
    dispatch and their (T, G) scales travel with the tokens; every other scheme travels in bf16 and
    is quantized after the dispatch (a dynamic per-tensor scale is then the amax over all ranks'
    received tokens, one scalar all-reduce, equal to quantizing the whole EP batch). Rows are padded
    to Kp (DeepEP copies whole 512-byte units) and cut back to K on arrival. DeepEP returns the
    received routes as local expert ids (-1: held elsewhere); they go to the experts as they are,
    with expert_map None.
    finalize: the local weight-and-reduce of each received token's routes (the experts' impl, or
    TopKWeightAndReduceContiguous when they delegate), then DeepEP's bf16 combine sums the partial
    results of every rank back onto the token's own rank.
    """

    BACKEND = DeepEPHighThroughputManager.backend_name

    def __init__(self, moe: MoEConfig, manager: DeepEPHighThroughputManager) -> None:
        super().__init__(moe, manager)
        self.quant_before = self.quantizes_before_dispatch(moe.quant)
        self.padded_hidden = self.padded_hidden_size(moe)
        self.handle = manager.get_handle(DeepEPHTBufferConfig(self.padded_hidden * HT_COMBINE_DTYPE.itemsize))
        self.linear_E = linear_expert_table(ExpertPlacementTables.build(moe, manager.device))

    # ---- capabilities -----------------------------------------------------------------------
    @classmethod
    def quantizes_before_dispatch(cls, quant: QuantConfig) -> bool:
        """fp8 group (1 x Bk) activation scales travel with their tokens; other schemes quantize after."""
        return quant.is_quantized and quant.activation is ActivationQuant.GROUP

    @classmethod
    def padded_hidden_size(cls, moe: MoEConfig) -> int:
        """Kp: K padded so both the dispatched rows (fp8 or bf16) and the bf16 combine rows are whole
        512-byte units."""
        sizes = (HT_COMBINE_DTYPE.itemsize,)
        if cls.quantizes_before_dispatch(moe.quant):
            sizes += (FP8_DTYPE.itemsize,)
        return ht_padded_hidden(moe.hidden_dim, sizes)

    @classmethod
    def check_config(cls, moe: MoEConfig) -> Optional[str]:
        """None when DeepEP's high-throughput kernels can serve `moe`, else why not (no backend needed)."""
        error = ht_rank_count_error(moe.ep_size)
        if error is not None:
            return error
        if moe.dtype != HT_COMBINE_DTYPE:
            return f"dtype ({moe.dtype}) must be {HT_COMBINE_DTYPE}: DeepEP's high-throughput combine is bf16 only"
        if moe.topk > HT_MAX_TOPK:
            return f"topk ({moe.topk}) must be <= {HT_MAX_TOPK} for DeepEP's high-throughput kernels"
        return None

    @classmethod
    def supports(cls, moe: MoEConfig) -> tuple[bool, str]:
        return deepep_supports(moe, cls.check_config)

    @classmethod
    def wire_bytes(cls, moe: MoEConfig, counts: RouteCounts, wire, experts_reduce: bool) -> PhaseBytes:
        """Token-level like the all-to-all, rows padded to Kp; fp8 (with group scales) only for group
        schemes, else bf16; the combine sends one bf16 Kp row per (token, rank)."""
        Kp = cls.padded_hidden_size(moe)
        fp8 = cls.quantizes_before_dispatch(moe.quant)
        row = token_row_bytes(Kp, fp8, HT_COMBINE_DTYPE, scale_width(moe.quant, moe.hidden_dim) if fp8 else 0)
        return PhaseBytes.of([n * row for n in counts.sent(counts.pairs)],
                             [n * Kp * HT_COMBINE_DTYPE.itemsize for n in counts.returned(counts.pairs)])

    @classmethod
    def vllm_all2all_backend(cls) -> Optional[str]:
        return "deepep_high_throughput"

    @classmethod
    def activation_format(cls) -> ActivationFormat:
        return ActivationFormat.Standard

    def topk_indices_dtype(self) -> Optional[torch.dtype]:
        return torch.int64

    def max_num_tokens_per_rank(self) -> Optional[int]:
        return None

    # ---- prepare ------------------------------------------------------------------------------
    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                quant: MoEQuantParams, micro_batch: int = 0) -> PrepareResult:
        """a1 (T, K) bf16; topk_weights (T, k) float32; topk_ids (T, k) int64 global ids (-1: no route).
        The placement comes from moe.parallel (expert_map is not consulted).
        Returns the received tokens: a1q (R, K) fp8 or bf16, a1q_scale (R, G) / (R, 1) / (1,) / None,
        topk_ids (R, k) int64 local ids or -1, topk_weights (R, k) float32, per-local-expert counts.
        DeepEP returns freshly allocated received tensors, so micro-batches need no buffers of their own."""
        check_micro_batch(self, micro_batch)
        moe = self.moe
        if num_experts != moe.num_experts:
            raise ValueError(f"num_experts ({num_experts}) must equal moe.num_experts ({moe.num_experts})")
        T, K = a1.shape
        if K != moe.hidden_dim:
            raise ValueError(f"a1 hidden size ({K}) must equal moe.hidden_dim ({moe.hidden_dim})")
        a1 = apply_weight_on_input(a1, topk_weights, apply_router_weight_on_input)
        ids_Tk = to_linear_ids(self.linear_E, topk_ids)
        weights_Tk = topk_weights.float().contiguous()
        if self.quant_before:
            xq_TK, scale_TG = quantize_activations(a1, quant.config, quant.a1_scale)
            x: Any = (pad_hidden(xq_TK, self.padded_hidden), scale_TG.contiguous())
        else:
            x = pad_hidden(a1, self.padded_hidden)

        buf = self.handle.deep_ep_buffer
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buf.get_dispatch_layout(ids_Tk, num_experts)
        with phase("dispatch"):
            recv_x, recv_ids_Rk, recv_w_Rk, recv_per_expert, deep_ep_handle, _ = buf.dispatch(
                x, topk_idx=ids_Tk, topk_weights=weights_Tk,
                num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank,
                is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                config=self.manager.dispatch_config())

        if self.quant_before:
            rx_RKp, a1q_scale = recv_x
            a1q = rx_RKp[:, :K].contiguous()
        else:
            a1q, a1q_scale = quantize_for_dispatch(recv_x[:, :K].contiguous(), quant, self.group)
        recv_ids_Rk = recv_ids_Rk.long()
        recv_w_Rk = recv_w_Rk.float()
        counts_cpu = torch.tensor(list(recv_per_expert), dtype=torch.int32)
        meta = ExpertTokensMetadata(expert_num_tokens=counts_cpu.to(a1q.device), expert_num_tokens_cpu=counts_cpu)
        return PrepareResult(a1q=a1q, a1q_scale=a1q_scale, expert_tokens_meta=meta,
                             topk_ids=recv_ids_Rk, topk_weights=recv_w_Rk,
                             handle=_Dispatched(T, deep_ep_handle, recv_ids_Rk, recv_w_Rk))

    # ---- finalize -----------------------------------------------------------------------------
    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                 weight_and_reduce_impl, handle) -> None:
        """output (T, K) bf16; fused_expert_output (R, k, K) / (R*k, K) route rows, or (R, K) when the
        experts reduced (impl NoOp); topk_weights / topk_ids (T, k) as given to prepare."""
        st = finalize_handle(self, handle, _Dispatched, output.size(0))
        K = self.moe.hidden_dim
        R = st.recv_local_Rk.size(0)
        impl = resolve_weight_and_reduce(weight_and_reduce_impl, TopKWeightAndReduceContiguous())
        if isinstance(impl, TopKWeightAndReduceNoOp):
            if tuple(fused_expert_output.shape) != (R, K):
                raise ValueError(f"reduced expert output must be ({R}, {K}), got {tuple(fused_expert_output.shape)}")
            reduced_RK = fused_expert_output
        else:
            reduced_RK = torch.empty((R, K), dtype=torch.float32, device=fused_expert_output.device)
            impl.apply(reduced_RK, fused_expert_output, masked_weights(st.recv_weights_Rk, st.recv_local_Rk),
                       st.recv_local_Rk, apply_router_weight_on_input)
        send_RKp = pad_hidden(reduced_RK.to(HT_COMBINE_DTYPE), self.padded_hidden)
        with phase("combine"):
            combined_TKp, _, _ = self.handle.deep_ep_buffer.combine(send_RKp, st.handle,
                                                                    config=self.manager.combine_config())
        output.copy_(combined_TKp[:, :K])
