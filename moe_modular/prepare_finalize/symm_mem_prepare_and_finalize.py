"""SymmMemPrepareAndFinalize: Standard-format expert parallelism on torch symmetric memory (NVSHMEM).

Shape legend: T tokens on this rank, k topk, S routes sent (one row per (token, expert) route),
R routes received, K hidden, E global experts, El local experts, W ranks,
G activation scale groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from all2all.rows import RowField, RowFormat
from all2all.symm_mem import (
    SymmMemManager,
    SymmMemTokenConfig,
    local_experts_error,
    runtime_unavailable_reason,
    world_size_error,
)
from moe_modular.config import MoEConfig
from moe_modular.interfaces import (
    ActivationFormat,
    ExpertTokensMetadata,
    PrepareResult,
)
from moe_modular.prepare_finalize.common import apply_weight_on_input, check_micro_batch, finalize_handle
from moe_modular.prepare_finalize.deepep_common import linear_expert_table
from moe_modular.prepare_finalize.ep_common import (
    ExpertPlacementTables,
    activation_row_bytes,
    activation_wire_dtype,
    quantize_for_dispatch,
    scale_width,
)
from moe_modular.prepare_finalize.ep_prepare_and_finalize import EPPrepareAndFinalize
from moe_modular.wire_bytes import PhaseBytes, RouteCounts
from moe_modular.profiler_scope import phase
from moe_modular.quant import MoEQuantParams, QuantConfig
from moe_modular.weight_and_reduce import (
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceNoOp,
    resolve_weight_and_reduce,
)


@dataclass(frozen=True)
class _Dispatched:
    """What finalize needs from the prepare of the same forward (PrepareResult.handle)."""

    T: int
    micro_batch: int
    k: int
    route_S: torch.Tensor  # (S,) int64 flat route index (token * k + slot) of each sent row
    recv_pos_R: torch.Tensor  # (R,) int64 row of the receive buffer holding each received route
    recv_local_R1: torch.Tensor  # (R, 1) int64 local expert of each received route
    recv_weights_R1: torch.Tensor  # (R, 1) float32 its router weight


def received_positions(splits_offsets_2EW: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From all_to_all_vdev_2d's output layout (2, El * W) (row 0 rows per (local expert, source
    rank), row 1 their start in the receive buffer) -> (pos_R, expert_R): the buffer row of every
    received route in (expert, source, arrival) order and its local expert. Alignment gaps between
    experts are skipped."""
    so = splits_offsets_2EW.reshape(2, -1).long()
    splits, offsets = so[0], so[1]
    n_cells = splits.numel()
    cell_R = torch.repeat_interleave(torch.arange(n_cells, device=splits.device), splits)
    start_of_cell = torch.cumsum(splits, 0) - splits
    within_R = torch.arange(cell_R.numel(), device=splits.device) - start_of_cell[cell_R]
    return offsets[cell_R] + within_R, cell_R


class SymmMemPrepareAndFinalize(EPPrepareAndFinalize):
    """One row per (token, expert) route, exchanged with torch's all_to_all_vdev_2d and sent back
    with all_to_all_vdev_2d_offset.

    prepare: quantize before the dispatch (ep_common.quantize_for_dispatch: per-token and group
    scales travel in the row; a dynamic per-tensor scale is the amax over every rank's tokens); each
    row carries the route's activations, scale and router weight. The experts get the received
    routes (R, K) with topk_ids (R, 1) = the local expert and topk_weights (R, 1) = the weight.
    finalize: the local weight-and-reduce of every route row (the experts' impl, or
    TopKWeightAndReduceContiguous when they delegate) in the activation dtype, the reverse exchange,
    then each rank sums its tokens' k returned routes.

    Needs 2 to 16 ranks and at most 16 local experts (torch's kernels); one rank is refused.
    """

    BACKEND = SymmMemManager.backend_name

    def __init__(self, moe: MoEConfig, manager: SymmMemManager) -> None:
        super().__init__(moe, manager)
        self.tables = ExpertPlacementTables.build(moe, manager.device)
        self.linear_E = linear_expert_table(self.tables)
        self.n_scale = scale_width(moe.quant, moe.hidden_dim)
        fields = [RowField("x", activation_wire_dtype(moe), moe.hidden_dim)]
        if self.n_scale:
            fields.append(RowField("scale", torch.float32, self.n_scale))
        fields.append(RowField("weight", torch.float32, 1))
        self.row_format = RowFormat(tuple(fields))
        self.combine_dtype = moe.dtype
        self.handle = manager.token_handle(SymmMemTokenConfig(
            max_num_tokens=moe.max_num_tokens, topk=moe.topk, num_local_experts=moe.num_local_experts,
            dispatch_row_bytes=self.row_format.row_bytes,
            combine_row_bytes=moe.hidden_dim * moe.dtype.itemsize))

    # ---- capabilities -----------------------------------------------------------------------
    @classmethod
    def check_config(cls, moe: MoEConfig) -> Optional[str]:
        """None when torch's 2-D all-to-all ops can serve `moe`, else why not (no backend needed)."""
        return world_size_error(moe.ep_size) or local_experts_error(moe.num_local_experts)

    @classmethod
    def quantizes_before_dispatch(cls, quant: QuantConfig) -> bool:
        """True for every scheme (ep_common.quantize_for_dispatch runs before the exchange)."""
        return True

    @classmethod
    def supports(cls, moe: MoEConfig) -> tuple[bool, str]:
        """The rank count and expert limits first (a single rank is refused), then CUDA and NVSHMEM."""
        reason = cls.check_config(moe) or runtime_unavailable_reason()
        return reason is None, reason or ""

    @classmethod
    def wire_bytes(cls, moe: MoEConfig, counts: RouteCounts, wire, experts_reduce: bool) -> PhaseBytes:
        """One row per route to the expert's rank and one activation-dtype row per route back."""
        row = activation_row_bytes(moe, moe.quant.is_quantized)
        return PhaseBytes.of([n * row for n in counts.sent(counts.routes)],
                             [n * moe.hidden_dim * moe.dtype.itemsize for n in counts.returned(counts.routes)])

    @classmethod
    def activation_format(cls) -> ActivationFormat:
        return ActivationFormat.Standard

    def topk_indices_dtype(self) -> Optional[torch.dtype]:
        return None

    def max_num_tokens_per_rank(self) -> Optional[int]:
        return None

    # ---- prepare ------------------------------------------------------------------------------
    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                quant: MoEQuantParams, micro_batch: int = 0) -> PrepareResult:
        """a1 (T, K), T <= moe.max_num_tokens; topk_weights (T, k) float32; topk_ids (T, k) global ids
        (-1: no route); the placement comes from moe.parallel (expert_map is not consulted).
        Returns a1q (R, K), a1q_scale (R, G) / (R, 1) / (1,) / None, topk_ids (R, 1) int64 local
        experts, topk_weights (R, 1) float32, per-local-expert route counts. One host sync (the
        received layout). The received rows are copied out of the symmetric buffer here; the layout the combine
        needs stays in the manager's slot `micro_batch`."""
        mb = check_micro_batch(self, micro_batch)
        moe, W, El = self.moe, self.world_size, self.moe.num_local_experts
        if num_experts != moe.num_experts:
            raise ValueError(f"num_experts ({num_experts}) must equal moe.num_experts ({moe.num_experts})")
        T, k = topk_ids.shape
        if T > moe.max_num_tokens:
            raise ValueError(f"tokens ({T}) must be <= max_num_tokens ({moe.max_num_tokens}), the symmetric "
                             f"buffers' capacity per rank")
        a1 = apply_weight_on_input(a1, topk_weights, apply_router_weight_on_input)
        xq_TK, scale = quantize_for_dispatch(a1, quant, self.group)

        ids_flat = topk_ids.reshape(-1).long()
        valid = (ids_flat >= 0).nonzero().squeeze(1)
        key_valid = self.linear_E[ids_flat[valid]]  # owner * El + local: rank-major, then local expert
        route_S = valid[torch.sort(key_valid, stable=True).indices]
        key_S = self.linear_E[ids_flat[route_S]]
        splits_WEl = torch.bincount(key_S, minlength=W * El)
        tok_S = route_S // k
        fields = [xq_TK.index_select(0, tok_S)]
        if self.n_scale:
            fields.append(scale.index_select(0, tok_S))
        fields.append(topk_weights.reshape(-1).float().index_select(0, route_S).unsqueeze(1))
        rows_SB = self.row_format.pack(fields)

        with phase("dispatch"):
            recv_CB, splits_offsets = self.manager.dispatch_2d(self.handle, rows_SB, splits_WEl, slot=mb)
        so_2EW = splits_offsets.cpu()  # the step's host sync
        pos_R, cell_R = received_positions(so_2EW)
        pos_R = pos_R.to(recv_CB.device)
        got = self.row_format.unpack(recv_CB.index_select(0, pos_R))
        local_R1 = (cell_R // W).to(recv_CB.device).unsqueeze(1)
        weights_R1 = got["weight"]
        counts_cpu = so_2EW[0].reshape(El, W).sum(dim=1).to(torch.int32)
        meta = ExpertTokensMetadata(expert_num_tokens=counts_cpu.to(recv_CB.device), expert_num_tokens_cpu=counts_cpu)
        a1q_scale = got["scale"] if self.n_scale else scale
        return PrepareResult(a1q=got["x"], a1q_scale=a1q_scale, expert_tokens_meta=meta,
                             topk_ids=local_R1, topk_weights=weights_R1,
                             handle=_Dispatched(T, mb, k, route_S, pos_R, local_R1, weights_R1))

    # ---- finalize -----------------------------------------------------------------------------
    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                 weight_and_reduce_impl, handle) -> None:
        """output (T, K); fused_expert_output (R, 1, K) / (R, K) route rows (or (R, K) reduced by the
        experts, impl NoOp); topk_weights / topk_ids (T, k) as given to prepare."""
        st = finalize_handle(self, handle, _Dispatched, output.size(0))
        K = self.moe.hidden_dim
        R = st.recv_pos_R.numel()
        impl = resolve_weight_and_reduce(weight_and_reduce_impl, TopKWeightAndReduceContiguous())
        if isinstance(impl, TopKWeightAndReduceNoOp):
            if tuple(fused_expert_output.shape) != (R, K):
                raise ValueError(f"reduced expert output must be ({R}, {K}), got {tuple(fused_expert_output.shape)}")
            rows_RK = fused_expert_output
        else:
            rows_RK = torch.empty((R, K), dtype=torch.float32, device=fused_expert_output.device)
            impl.apply(rows_RK, fused_expert_output, st.recv_weights_R1, st.recv_local_R1,
                       apply_router_weight_on_input)
        wire_RK = rows_RK.to(self.combine_dtype).contiguous()
        cin = self.manager.combine_input(self.handle)
        cin.index_copy_(0, st.recv_pos_R, wire_RK.view(torch.uint8).reshape(R, K * wire_RK.element_size()))
        S = st.route_S.numel()
        with phase("combine"):
            back_SB = self.manager.combine_2d(self.handle, S, slot=st.micro_batch)
            back_SK = back_SB.contiguous().view(self.combine_dtype).reshape(S, K)
        acc = torch.zeros((st.T * st.k, K), dtype=torch.float32, device=back_SK.device)
        acc.index_copy_(0, st.route_S, back_SK.float())
        output.copy_(acc.view(st.T, st.k, K).sum(dim=1).to(output.dtype))
