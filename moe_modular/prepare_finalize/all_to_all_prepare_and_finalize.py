"""AllToAllPrepareAndFinalize: token-level expert parallelism over all_to_all_single.

Shape legend: T tokens on this rank, S token rows sent (one per (token, rank holding one of its
experts)), R token rows received, K hidden, k topk, W world size, El local experts,
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
from moe_modular.prepare_finalize.combine_wire import COMBINE_WIRES, CombineWire, combine_wire, default_combine_wire
from moe_modular.prepare_finalize.common import apply_weight_on_input, buffer_tag, check_micro_batch, finalize_handle
from moe_modular.prepare_finalize.ep_common import (
    ExpertPlacementTables,
    activation_row_bytes,
    activation_wire_dtype,
    local_expert_counts,
    masked_weights,
    quantize_for_dispatch,
    scale_width,
    token_row_format,
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
    layout: RowLayout  # token rows, dispatch direction
    send_rank_S: torch.Tensor  # (S,) int64 destination of each sent row
    send_tok_S: torch.Tensor  # (S,) int64 token of each sent row
    owner_Tk: torch.Tensor  # (T, k) int64 rank holding each route's expert, -1 for id -1
    recv_local_Rk: torch.Tensor  # (R, k) int64 local ids of received tokens, -1 when held elsewhere
    recv_weights_Rk: torch.Tensor  # (R, k) float32


class AllToAllPrepareAndFinalize(EPPrepareAndFinalize):
    """Standard-format EP: each token travels once to every rank that holds one of its experts.

    Contract with the experts: prepare returns the received tokens (R, K) with topk_ids holding
    LOCAL expert ids, -1 for routes whose expert lives on another rank, and the tokens' float32
    topk_weights; the modular kernel then calls the experts with expert_map=None. Experts must
    leave zero in route rows with id -1 (or reduce them away themselves).

    Quantization happens before dispatch for every scheme: per-token and group scales travel in
    the token's row; a dynamic per-tensor scale is the amax over all ranks' tokens (one scalar
    all-reduce), equal to quantizing the whole EP batch at once. fp8 travels as bytes.

    Combine wire (`combine_wire`, see combine_wire.py): per_route, prereduced or prereduced_hilo;
    None picks the activation dtype's default (prereduced for bf16, prereduced_hilo for fp16,
    per_route for float32). With experts that reduce themselves (finalize impl NoOp), per_route sends
    their reduced rows, one per (token, rank). `last_combine_rows` counts the wire rows this rank
    sent in the latest finalize (hi and lo count as two).

    One host sync per forward: the exchange of per-rank row counts (and, for per_route, the
    route counts are derived locally on both sides, without communication).
    """

    BACKEND = "nccl_all_to_all"

    def __init__(self, moe: MoEConfig, manager: All2AllManager, combine_wire_name: Optional[str] = None) -> None:
        self.wire: CombineWire = (default_combine_wire(moe.dtype) if combine_wire_name is None
                                  else combine_wire(combine_wire_name))
        super().__init__(moe, manager)
        self.tables = ExpertPlacementTables.build(moe, manager.device)
        self.n_scale = scale_width(moe.quant, moe.hidden_dim)
        self.row_format = token_row_format(moe.hidden_dim, activation_wire_dtype(moe), self.n_scale, moe.topk, True)
        self.handle = manager.get_handle(
            All2AllHandleConfig(moe.max_num_tokens, self.row_format.row_bytes, moe.num_experts, moe.topk))
        self.last_combine_rows = 0

    # ---- capabilities -----------------------------------------------------------------------
    @classmethod
    def supports(cls, moe: MoEConfig) -> tuple[bool, str]:
        """Every dtype, scheme, placement and world size (1 included); see quantizes_before_dispatch."""
        return True, ""

    @classmethod
    def quantizes_before_dispatch(cls, quant: QuantConfig) -> bool:
        """True for every scheme (the dynamic per-tensor scale is made global first)."""
        return True

    @classmethod
    def combine_wires(cls) -> tuple[str, ...]:
        return tuple(COMBINE_WIRES)

    @classmethod
    def wire_bytes(cls, moe: MoEConfig, counts: RouteCounts, wire: Optional[CombineWire],
                   experts_reduce: bool) -> PhaseBytes:
        """A token goes once to each other rank holding one of its experts. Combine by wire (the default wire
        of moe.dtype when None): per_route with unreduced experts sends one row per route back (the experts'
        output dtype); per_route with experts that reduce sends one row per (token, rank) in that dtype;
        prereduced one bf16 row per (token, rank); prereduced_hilo two."""
        wire = wire if wire is not None else default_combine_wire(moe.dtype)
        K = moe.hidden_dim
        row = activation_row_bytes(moe, moe.quant.is_quantized and cls.quantizes_before_dispatch(moe.quant))
        dispatch = [n * row for n in counts.sent(counts.pairs)]
        if wire.per_route and not experts_reduce:
            combine = [n * K * moe.dtype.itemsize for n in counts.returned(counts.routes)]
        else:
            elem = moe.dtype.itemsize if wire.per_route else torch.bfloat16.itemsize
            combine = [n * wire.rows_per_entry * K * elem for n in counts.returned(counts.pairs)]
        return PhaseBytes.of(dispatch, combine)

    @classmethod
    def make(cls, moe: MoEConfig, context=None, combine_wire: Optional[str] = None) -> "AllToAllPrepareAndFinalize":
        return cls(moe, cls.manager_for(moe, context), combine_wire)

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
        Returns the received tokens: a1q (R, K), a1q_scale (1,) / (R, 1) / (R, G) / None,
        topk_ids (R, k) local ids or -1, topk_weights (R, k), expert_tokens_meta (El,) route counts."""
        return self._start(a1, topk_weights, topk_ids, num_experts, apply_router_weight_on_input, quant, False,
                           micro_batch)()

    def prepare_no_receive(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                           quant: MoEQuantParams, micro_batch: int = 0) -> Callable[[], PrepareResult]:
        """Exchange the counts, start the token all-to-all and return the receiver that completes it."""
        return self._start(a1, topk_weights, topk_ids, num_experts, apply_router_weight_on_input, quant, True,
                           micro_batch)

    def _start(self, a1, topk_weights, topk_ids, num_experts, apply_on_input, quant: MoEQuantParams,
               async_op: bool, micro_batch: int) -> Callable[[], PrepareResult]:
        moe, W = self.moe, self.world_size
        mb = check_micro_batch(self, micro_batch)
        if num_experts != moe.num_experts:
            raise ValueError(f"num_experts ({num_experts}) must equal moe.num_experts ({moe.num_experts})")
        T, k = topk_ids.shape
        a1 = apply_weight_on_input(a1, topk_weights, apply_on_input)
        xq, scale = quantize_for_dispatch(a1, quant, self.group)

        owner_Tk = self.tables.owner_of(topk_ids)
        ranks_W = torch.arange(W, device=owner_Tk.device)
        to_rank_WT = (owner_Tk.unsqueeze(0) == ranks_W.view(W, 1, 1)).any(dim=2)
        send_rank_S, send_tok_S = to_rank_WT.nonzero(as_tuple=True)  # rank-major, then token order
        layout = self.manager.exchange_counts(to_rank_WT.sum(dim=1))

        fields = [xq] + ([scale] if self.n_scale else []) + [topk_ids.to(torch.int32), topk_weights.float()]
        rows_SB = self.row_format.pack(fields).index_select(0, send_tok_S)
        with phase("dispatch"):
            pending = self.manager.dispatch(self.handle, rows_SB, layout, async_op=async_op,
                                            tag=buffer_tag("tokens", mb))
        per_tensor_scale = scale if (scale is not None and not self.n_scale) else None

        def receive() -> PrepareResult:
            got = self.row_format.unpack(pending.wait())
            local_Rk = self.tables.local_on(got["ids"], self.rank)
            weights_Rk = got["weights"]
            meta = ExpertTokensMetadata(expert_num_tokens=local_expert_counts(local_Rk, moe.num_local_experts))
            return PrepareResult(a1q=got["x"], a1q_scale=got["scale"] if self.n_scale else per_tensor_scale,
                                 expert_tokens_meta=meta, topk_ids=local_Rk, topk_weights=weights_Rk,
                                 handle=_Dispatched(T, mb, layout, send_rank_S, send_tok_S, owner_Tk, local_Rk,
                                                    weights_Rk))

        return receive

    # ---- finalize -----------------------------------------------------------------------------
    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                 weight_and_reduce_impl, handle) -> None:
        """output (T, K); fused_expert_output (R, k, K) or (R*k, K) unreduced route rows, or (R, K)
        when the experts reduced (NoOp); topk_weights / topk_ids (T, k) as given to prepare."""
        st = finalize_handle(self, handle, _Dispatched, output.size(0))
        impl = resolve_weight_and_reduce(weight_and_reduce_impl, TopKWeightAndReduceContiguous())
        route_rows = not isinstance(impl, TopKWeightAndReduceNoOp)
        if self.wire.per_route and route_rows:
            out_TK = self._combine_per_route(st, fused_expert_output, topk_weights, apply_router_weight_on_input)
        else:
            out_TK = self._combine_reduced(st, fused_expert_output, impl, route_rows, apply_router_weight_on_input)
        output.copy_(out_TK.to(output.dtype))

    def _send_back(self, rows_RX: torch.Tensor, layout: RowLayout, tag: str) -> torch.Tensor:
        """Reverse all-to-all of wire rows (any dtype, moved as bytes) -> rows in dispatch send order."""
        dtype, X = rows_RX.dtype, rows_RX.size(1)
        with phase("combine"):
            back = self.manager.combine(self.handle, rows_RX.contiguous().view(torch.uint8), layout,
                                        tag=tag).wait()
        self.last_combine_rows = rows_RX.size(0) * self.wire.rows_per_entry
        return back.view(dtype).reshape(-1, X)

    def _combine_reduced(self, st: _Dispatched, fused, impl, route_rows: bool, apply_on_input: bool) -> torch.Tensor:
        K, R = self.moe.hidden_dim, st.recv_local_Rk.size(0)
        if route_rows:
            sums_RK = torch.empty((R, K), dtype=torch.float32, device=fused.device)
            impl.apply(sums_RK, fused, masked_weights(st.recv_weights_Rk, st.recv_local_Rk), st.recv_local_Rk,
                       apply_on_input)
        else:
            if tuple(fused.shape) != (R, K):
                raise ValueError(f"reduced expert output must be ({R}, {K}), got {tuple(fused.shape)}")
            sums_RK = fused
        back_SK = self.wire.decode(self._send_back(self.wire.encode(sums_RK), st.layout,
                                                   buffer_tag("reduced", st.micro_batch)), K)
        acc_WTK = torch.zeros((self.world_size, st.T, K), dtype=torch.float32, device=back_SK.device)
        acc_WTK[st.send_rank_S, st.send_tok_S] = back_SK
        return acc_WTK.sum(dim=0)

    def _combine_per_route(self, st: _Dispatched, fused, topk_weights, apply_on_input: bool) -> torch.Tensor:
        K, W = self.moe.hidden_dim, self.world_size
        R, k = st.recv_local_Rk.shape
        held_Rk = st.recv_local_Rk >= 0
        rows_XK = fused.reshape(R, k, K)[held_Rk]  # routes in (token, k) order
        # Routes per source rank on this side; routes per destination rank on the token's side.
        src_R = torch.repeat_interleave(torch.arange(W, device=held_Rk.device),
                                        torch.tensor(st.layout.recv_counts, device=held_Rk.device), output_size=R)
        recv_routes = torch.zeros(W, dtype=torch.int64, device=held_Rk.device)
        recv_routes.index_add_(0, src_R, held_Rk.sum(dim=1))
        ranks_W = torch.arange(W, device=st.owner_Tk.device)
        mine_WTk = st.owner_Tk.unsqueeze(0) == ranks_W.view(W, 1, 1)
        counts = torch.cat([mine_WTk.sum(dim=(1, 2)), recv_routes]).tolist()
        route_layout = RowLayout(tuple(counts[:W]), tuple(counts[W:]))
        back_XK = self.wire.decode(self._send_back(self.wire.encode(rows_XK), route_layout,
                                                   buffer_tag("routes", st.micro_batch)), K)
        _, tok, slot = mine_WTk.nonzero(as_tuple=True)  # rank, then token, then k: the order rows come back
        y_TkK = torch.zeros((st.T, k, K), dtype=torch.float32, device=back_XK.device)
        y_TkK[tok, slot] = back_XK
        if not apply_on_input:
            y_TkK = y_TkK * topk_weights.float().unsqueeze(2)
        return y_TkK.sum(dim=1)
