"""LowLatencyAll2AllPrepareAndFinalize: batched-format EP over fixed-size per-expert slots.

Shape legend: T tokens on this rank (<= Tm = max tokens per rank), k topk, K hidden, E global
experts, El local experts, W world size, B = W * Tm slots per local expert on the receiver,
X packed row bytes, G activation scale groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from all2all.base import All2AllHandleConfig, All2AllManager
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
    activation_wire_dtype,
    quantize_for_dispatch,
    scale_width,
    token_row_format,
)
from moe_modular.prepare_finalize.ep_prepare_and_finalize import EPPrepareAndFinalize
from moe_modular.wire_bytes import PhaseBytes, RouteCounts
from moe_modular.profiler_scope import phase
from moe_modular.quant import MoEQuantParams, QuantConfig
from moe_modular.weight_and_reduce import TopKWeightAndReduceNaiveBatched, resolve_weight_and_reduce


@dataclass(frozen=True)
class _Slots:
    """What finalize needs from the prepare of the same forward (PrepareResult.handle)."""

    T: int
    micro_batch: int
    route_slot_Tk: torch.Tensor  # (T, k) int64 slot of each route in the (W, El, Tm) send layout (dump slot if none)
    route_valid_Tk: torch.Tensor  # (T, k) bool: the route has an expert
    compact_index: torch.Tensor  # (W*El*Tm,) int64: received slot (s, e, j) -> row in the (El, B) layout


class LowLatencyAll2AllPrepareAndFinalize(EPPrepareAndFinalize):
    """BatchedExperts-format EP with static shapes: no host sync, CUDA-graph capturable.

    Each route (token, expert) gets a slot in a fixed (W, El, Tm) send layout (the token is sent
    once per expert it routes to, as the batched format needs); one equal-split all-to-all moves
    all slots and one moves the (W, El) slot counts. The receiver packs each local expert's
    tokens to the front of its B = W * Tm slots, in source-rank then source-slot order, and
    reports expert_num_tokens (El,). Experts are called with the batched layout only (no ids);
    finalize sends every slot back unreduced and the token's rank weights and sums its routes in
    float32 (TopKWeightAndReduceNaiveBatched semantics, done by the PF).

    Quantization happens before dispatch for every scheme: per-token / group scales travel in
    the slot row, a dynamic per-tensor scale is the amax over all ranks (one scalar all-reduce).
    fp8 travels as bytes.
    """

    BACKEND = "nccl_low_latency"

    def __init__(self, moe: MoEConfig, manager: All2AllManager) -> None:
        super().__init__(moe, manager)
        self.Tm = moe.max_num_tokens
        self.El = moe.num_local_experts
        self.tables = ExpertPlacementTables.build(moe, manager.device)
        self.n_scale = scale_width(moe.quant, moe.hidden_dim)
        self.row_format = token_row_format(moe.hidden_dim, activation_wire_dtype(moe), self.n_scale, moe.topk, False)
        self.handle = manager.get_handle(
            All2AllHandleConfig(self.Tm, self.row_format.row_bytes, moe.num_experts, moe.topk))
        self.slots_layout = manager.static_layout(self.El * self.Tm)
        self.counts_layout = manager.static_layout(1)

    # ---- capabilities -----------------------------------------------------------------------
    @classmethod
    def supports(cls, moe: MoEConfig) -> tuple[bool, str]:
        """Every dtype, scheme, placement and world size; see quantizes_before_dispatch."""
        return True, ""

    @classmethod
    def quantizes_before_dispatch(cls, quant: QuantConfig) -> bool:
        """True for every scheme (the dynamic per-tensor scale is made global first)."""
        return True

    @classmethod
    def wire_bytes(cls, moe: MoEConfig, counts: RouteCounts, wire, experts_reduce: bool) -> PhaseBytes:
        """Fixed slots: El * Tm rows to every other rank, empty slots included, both ways."""
        W, K, El, Tm = counts.world_size, moe.hidden_dim, moe.num_local_experts, moe.max_num_tokens
        row = activation_row_bytes(moe, moe.quant.is_quantized and cls.quantizes_before_dispatch(moe.quant))
        return PhaseBytes.of([(W - 1) * El * Tm * row] * W, [(W - 1) * El * Tm * K * moe.dtype.itemsize] * W)

    @classmethod
    def activation_format(cls) -> ActivationFormat:
        return ActivationFormat.BatchedExperts

    def topk_indices_dtype(self) -> Optional[torch.dtype]:
        return None

    def max_num_tokens_per_rank(self) -> Optional[int]:
        return self.Tm

    def has_prepare_no_receive(self) -> bool:
        return True

    # ---- prepare ------------------------------------------------------------------------------
    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                quant: MoEQuantParams, micro_batch: int = 0) -> PrepareResult:
        """a1 (T, K), T <= Tm; topk_weights (T, k) float32; topk_ids (T, k) global ids (-1: no route).
        Returns a1q (El, B, K), a1q_scale (1,) / (El, B, 1) / (El, B, G) / None, expert_tokens_meta."""
        return self._start(a1, topk_weights, topk_ids, num_experts, apply_router_weight_on_input, quant, False,
                           micro_batch)()

    def prepare_no_receive(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                           quant: MoEQuantParams, micro_batch: int = 0) -> Callable[[], PrepareResult]:
        return self._start(a1, topk_weights, topk_ids, num_experts, apply_router_weight_on_input, quant, True,
                           micro_batch)

    def _route_slots(self, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(T, k) global ids -> (slot (T, k) int64 in [0, W*El*Tm] (the last is the dump slot),
        valid (T, k) bool, counts (W, El) int32 routes per (rank, local expert)); no host sync."""
        E, El, Tm = self.moe.num_experts, self.El, self.Tm
        ids = topk_ids.reshape(-1).long()
        valid = ids >= 0
        bucket = torch.where(valid, ids, torch.full_like(ids, E))  # E collects the routes without an expert
        counts_E1 = torch.zeros(E + 1, dtype=torch.int64, device=ids.device)
        counts_E1.scatter_add_(0, bucket, torch.ones_like(bucket))
        start_E1 = torch.cumsum(counts_E1, 0) - counts_E1
        order = torch.sort(bucket, stable=True).indices
        pos = torch.empty_like(bucket)
        pos[order] = torch.arange(bucket.numel(), device=ids.device) - start_E1[bucket[order]]
        safe = bucket.clamp(max=E - 1)
        block = self.tables.owner_E[safe] * El + self.tables.local_E[safe]
        dump = self.world_size * El * Tm
        slot = torch.where(valid, block * Tm + pos, torch.full_like(pos, dump))
        counts_WEl = torch.zeros(self.world_size * El, dtype=torch.int32, device=ids.device)
        counts_WEl.index_copy_(0, self.tables.owner_E * El + self.tables.local_E, counts_E1[:E].to(torch.int32))
        return slot.view_as(topk_ids), valid.view_as(topk_ids), counts_WEl.view(self.world_size, El)

    def _start(self, a1, topk_weights, topk_ids, num_experts, apply_on_input, quant: MoEQuantParams,
               async_op: bool, micro_batch: int) -> Callable[[], PrepareResult]:
        moe, W, El, Tm, K = self.moe, self.world_size, self.El, self.Tm, self.moe.hidden_dim
        mb = check_micro_batch(self, micro_batch)
        if num_experts != moe.num_experts:
            raise ValueError(f"num_experts ({num_experts}) must equal moe.num_experts ({moe.num_experts})")
        T, k = topk_ids.shape
        if T > Tm:
            raise ValueError(f"tokens on this rank ({T}) must be <= max_num_tokens ({Tm})")
        a1 = apply_weight_on_input(a1, topk_weights, apply_on_input)
        xq, scale = quantize_for_dispatch(a1, quant, self.group)
        rows_TX = self.row_format.pack([xq] + ([scale] if self.n_scale else []))
        slot_Tk, valid_Tk, counts_WEl = self._route_slots(topk_ids)

        X, nslots = self.row_format.row_bytes, W * El * Tm
        send = self.handle.buffer(buffer_tag("ll_send", mb), (nslots + 1, X), torch.uint8)
        send.zero_()
        tok_of_route = torch.arange(T, device=a1.device).repeat_interleave(k)
        send.index_copy_(0, slot_Tk.reshape(-1), rows_TX.index_select(0, tok_of_route))
        with phase("dispatch"):
            counts_pending = self.manager.dispatch(self.handle, counts_WEl, self.counts_layout,
                                                   async_op=async_op, tag=buffer_tag("counts", mb))
            slots_pending = self.manager.dispatch(self.handle, send[:nslots], self.slots_layout,
                                                  async_op=async_op, tag=buffer_tag("slots", mb))
        per_tensor_scale = scale if (scale is not None and not self.n_scale) else None

        def receive() -> PrepareResult:
            rc_WEl = counts_pending.wait().long()  # rc[s, e]: tokens source s put in local expert e's slots
            recv = slots_pending.wait()  # (W*El*Tm, X), block s from source s, then (El, Tm)
            j = torch.arange(Tm, device=recv.device).view(1, 1, Tm)
            rc = rc_WEl.unsqueeze(2)
            filled = j < rc
            off_filled = (torch.cumsum(rc_WEl, 0) - rc_WEl).unsqueeze(2)
            empty_WEl = Tm - rc_WEl
            off_empty = (torch.cumsum(empty_WEl, 0) - empty_WEl).unsqueeze(2)
            total_El = rc_WEl.sum(dim=0)
            pos = torch.where(filled, off_filled + j, total_El.view(1, El, 1) + off_empty + (j - rc))
            e_idx = torch.arange(El, device=recv.device).view(1, El, 1)
            compact_index = (e_idx * (W * Tm) + pos).reshape(-1)  # a permutation of [0, El*B)
            packed = torch.empty_like(recv)
            packed.index_copy_(0, compact_index, recv)
            got = self.row_format.unpack(packed)
            a1q = got["x"].view(El, W * Tm, K)
            a1q_scale = got["scale"].view(El, W * Tm, self.n_scale) if self.n_scale else per_tensor_scale
            meta = ExpertTokensMetadata(expert_num_tokens=total_El.to(torch.int32))
            return PrepareResult(a1q=a1q, a1q_scale=a1q_scale, expert_tokens_meta=meta,
                                 handle=_Slots(T, mb, slot_Tk, valid_Tk, compact_index))

        return receive

    # ---- finalize -----------------------------------------------------------------------------
    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                 weight_and_reduce_impl, handle) -> None:
        """output (T, K); fused_expert_output (El, B, K) unweighted rows in the slots prepare laid out."""
        st = finalize_handle(self, handle, _Slots, output.size(0))
        impl = resolve_weight_and_reduce(weight_and_reduce_impl, TopKWeightAndReduceNaiveBatched())
        if not isinstance(impl, TopKWeightAndReduceNaiveBatched):
            raise ValueError(
                f"{type(self).__name__} needs unreduced batched expert rows (TopKWeightAndReduceNaiveBatched or "
                f"Delegate), got {impl!r}"
            )
        W, El, Tm, K = self.world_size, self.El, self.Tm, self.moe.hidden_dim
        if tuple(fused_expert_output.shape) != (El, W * Tm, K):
            raise ValueError(f"expert output must be ({El}, {W * Tm}, {K}), got {tuple(fused_expert_output.shape)}")
        dtype = fused_expert_output.dtype
        back_rows = fused_expert_output.reshape(El * W * Tm, K).index_select(0, st.compact_index)
        with phase("combine"):
            got = self.manager.combine(self.handle, back_rows.view(torch.uint8), self.slots_layout,
                                       tag=buffer_tag("slots", st.micro_batch)).wait()
        got_K = got.view(dtype).reshape(W * El * Tm, K)
        T, k = st.route_slot_Tk.shape
        slot = torch.where(st.route_valid_Tk, st.route_slot_Tk, torch.zeros_like(st.route_slot_Tk))
        y_TkK = got_K.index_select(0, slot.reshape(-1)).view(T, k, K).float()
        y_TkK = torch.where(st.route_valid_Tk.unsqueeze(2), y_TkK, torch.zeros_like(y_TkK))
        if not apply_router_weight_on_input:
            y_TkK = y_TkK * topk_weights.float().unsqueeze(2)
        output.copy_(y_TkK.sum(dim=1).to(output.dtype))
