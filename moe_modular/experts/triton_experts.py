"""TritonExperts: Standard-format experts in Triton (align, grouped GEMM, act*mul, GEMM, top-k sum).

Shape legend: T tokens, k topk, R = T * k routes, K hidden, N2 = w1 rows, N = N2 / 2,
El local experts, E global experts.

One forward, all on the device with sizes fixed by T (no host sync, no allocation; CUDA-graph
capturable):
  1. moe_align: routes grouped by local expert, padded to BLOCK_M (expert_map -1: no slot); a single
     token skips it (its k routes go to k distinct experts: the GEMMs take one block per route)
  2. GEMM1: h1 (R, N2) = a1q[token of route] @ w1[e].T, dequantized
  3. act_and_mul: intermediate (R, N) = act(gate) * up, re-quantized to fp8 for fp8 schemes
     (unquantized SiLU / GELU, and fp8-block SiLU / GELU where the tiles say act_q: GEMM1 computes
     act(gate) * up in its epilogue, quantizes it in 1 x group groups for fp8-block, and writes the
     intermediate itself; h1 is never stored)
  4. GEMM2: y (R, K) = intermediate @ w2[e].T, dequantized, times the route's top-k weight
  5. moe_sum: output (T, K) = sum of the held routes of each token
Sorted rows (unquantized SiLU / GELU, where the tiles' launch options say a_tma): with launch1.a_tma,
sort_rows first gathers the tokens into sorted-route order (S, K) and GEMM1 loads them block by block
through a tensor descriptor; with launch2.a_tma, GEMM1 writes the intermediate in sorted order (S, N)
and GEMM2 loads it the same way. S = moe_align's sorted capacity (routes plus per-expert padding).
"""
from __future__ import annotations

from typing import Optional

import torch

from moe_modular.config import Activation
from moe_modular.experts.triton_common import check_device, current_device, h1_view, overlapping_view
from moe_modular.experts.triton_experts_base import TritonExpertsBase
from moe_modular.experts.triton_plan import (
    ROUTE_ORDER,
    Sorting,
    StandardPlan,
    WorkspaceLayout,
    fuses_activation,
    sorting,
    standard_layout,
)
from moe_modular.interfaces import ActivationFormat, ExpertTokensMetadata
from moe_modular.kernels.gemm_config import GemmEpilogue, GemmScales, RouteRows, SortedRows
from moe_modular.kernels.host import BoundedCache
from moe_modular.weight_and_reduce import TopKWeightAndReduceNoOp

try:  # the kernels apply launches, imported once (not on every forward); without triton supports() says no
    from moe_modular.kernels.act_and_mul import RowMode, act_and_mul
    from moe_modular.kernels.moe_align import moe_align
    from moe_modular.kernels.moe_gemm import moe_gemm
    from moe_modular.kernels.moe_sum import moe_sum
    from moe_modular.kernels.sort_rows import sort_rows
except ImportError:  # pragma: no cover - triton is a dependency; triton_common.TRITON_IMPORT_ERROR says why
    pass


class TritonExperts(TritonExpertsBase):
    """bf16 / fp16 / fp32, unquantized or fp8 (per-tensor static or dynamic, per-token with
    per-channel weights, 1xBk group with BnxBk block weights); SiLU, GELU and swiglu-oai; expert
    maps. Applies the top-k weights in the second GEMM and reduces the routes itself, so it
    writes the final (T, K) and the PF has nothing left to reduce (TopKWeightAndReduceNoOp).

    Extra keywords (tile_table, tile_config, fuse_activation): TritonExpertsBase.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._plans = BoundedCache()
        # views over the last workspaces, by (address, size, device, shape, dtype): a view holds its storage, so
        # no other tensor can have the same address while an entry lives
        self._views = BoundedCache(limit=4)

    @classmethod
    def activation_formats(cls) -> tuple[ActivationFormat, ActivationFormat]:
        return ActivationFormat.Standard, ActivationFormat.Standard

    def supports_chunking(self) -> bool:
        return True

    def _plan(self, M: int, El: int, N2: int, K: int, topk: int, activation: Activation,
              device: torch.device) -> StandardPlan:
        """The host-side choices of one problem size (memoized: apply asks on every forward)."""
        return self._plans.get_or_make((M, El, N2, K, topk, activation, device),
                                       lambda: self._make_plan(M, El, N2, K, topk, activation, device))

    def _make_plan(self, M: int, El: int, N2: int, K: int, topk: int, activation: Activation,
                   device: torch.device) -> StandardPlan:
        q = self.moe.quant
        cfg = self.tiles(M, El, N2 // 2, K, topk, device)
        order = sorting(self.fuse_activation, q, cfg, activation)
        fused = fuses_activation(self.fuse_activation, q, activation, cfg)
        sized_fused = fuses_activation(self.fuse_activation, q, self.moe.activation, cfg)
        ws13_numel, layout = self._layout(M, N2, K, topk, El, order, sized_fused)
        _, unsorted_layout = self._layout(M, N2, K, topk, El, ROUTE_ORDER, sized_fused)
        return StandardPlan(cfg, order, fused, sized_fused, self.tiles.fused_gemm1(cfg.gemm1) if fused else cfg.gemm1,
                            ws13_numel, layout, unsorted_layout)

    def _layout(self, M: int, N2: int, K: int, topk: int, El: int, order: Sorting,
                fused: bool) -> tuple[int, WorkspaceLayout]:
        return self._layouts.get_or_make((M, N2, K, topk, El, order, fused),
                                         lambda: standard_layout(self.moe, M, N2, K, topk, El, order, fused))

    def workspace_shapes(self, M, N2, K, topk, global_num_experts, local_num_experts, expert_tokens_meta):
        """workspace13 holds h1 (R, N2) (float32 for fp8 schemes; not stored when the first GEMM applies
        the activation) or the sorted tokens (S, K), then y (R, K); workspace2 the intermediate ((R, N),
        or (S, N) sorted), its scales and the alignment buffers. Output (M, K), already weighted and
        reduced. Sized for the tiles of the current device (the one apply will run on)."""
        plan = self._plan(M, local_num_experts, N2, K, topk, self.moe.activation, current_device())
        return (plan.ws13_numel,), (plan.layout.numel(self.moe.dtype),), (M, K), self.moe.dtype

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceNoOp()

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
        """output (T, K) activation dtype; hidden_states (T, K) fp8 (scale a1q_scale: (1,) / (T, 1) /
        (T, G)) or the activation dtype; w1 (El, N2, K), w2 (El, K, N); topk_weights (T, k) float32;
        topk_ids (T, k) int: global ids mapped by expert_map (E,) int32, or local ids (-1 or any id
        outside [0, El) = not held here) when expert_map is None; a2_scale (1,) for static schemes."""
        check_device(hidden_states)
        T, K = hidden_states.shape
        topk = topk_ids.shape[1]
        El, N2, _ = w1.shape
        R = T * topk
        if T == 0:
            return
        activation = Activation.parse(activation)
        q, modes = self.quant, self.modes
        group = q.config.block_shape if q.config.is_block else (1, 1)
        plan = self._plan(T, El, N2, K, topk, activation, hidden_states.device)
        cfg, order, fused, layout = plan.cfg, plan.order, plan.fused, plan.layout
        if order.any and (workspace13.numel() < plan.ws13_numel or workspace2.numel() < layout.numel(workspace2.dtype)):
            # sized for another device's tiles (workspace_shapes plans for the current device): route order
            order, layout = ROUTE_ORDER, plan.unsorted_layout
        view_key = (workspace13.data_ptr(), workspace13.numel(), workspace13.device, R, K, output.dtype)
        y = self._views.get_or_make(view_key, lambda: overlapping_view(workspace13, (R, K), output.dtype))
        buf = layout.carve(workspace2)
        if not topk_ids.is_contiguous():
            topk_ids = topk_ids.contiguous()

        if T == 1 and not order.any:  # one token: its k routes hit k distinct experts, a block each
            rows1 = RouteRows(topk_ids, R, topk, expert_map)
            rows2 = RouteRows(topk_ids, R, 1, expert_map)
        else:
            sorted_ids, block_expert, num_post_padded = moe_align(topk_ids, cfg.block_m, El, expert_map, buffers=buf)
            rows1 = SortedRows(sorted_ids, block_expert, num_post_padded, R, topk, order.sort_in, order.sort_mid)
            rows2 = SortedRows(sorted_ids, block_expert, num_post_padded, R, 1, order.sort_mid)
        inter_scale = buf.get("intermediate_scale", a2_scale)
        scales1 = GemmScales(a1q_scale, modes.a1, q.w1_scale, modes.w, group)
        if fused:
            a1 = hidden_states
            if order.sort_in:  # workspace13's y is written only after GEMM1 is done with the sorted tokens
                a1 = sort_rows(hidden_states, sorted_ids, num_post_padded, topk,
                               overlapping_view(workspace13, (sorted_ids.numel(), K), hidden_states.dtype))
            # fp8 block (act_q): the intermediate leaves quantized, one scale per row and group
            epilogue1 = (GemmEpilogue(activation, c_scale=inter_scale, c_group=group[1]) if q.config.is_quantized
                         else GemmEpilogue(activation))
            moe_gemm(a1, w1, buf["intermediate"], plan.gemm1, rows1, scales=scales1, epilogue=epilogue1,
                     launch=cfg.launch1)
        else:
            h1 = h1_view(workspace13, (R, N2), self.moe, plan.sized_fused, activation)
            moe_gemm(hidden_states, w1, h1, plan.gemm1, rows1, scales=scales1, launch=cfg.launch1)
            act_and_mul(h1, activation, buf["intermediate"], quant=modes.intermediate, scale=inter_scale,
                        amax_El=buf.get("amax"), group_size=group[1] if q.config.is_block else 128,
                        row_mode=RowMode.ROUTES, topk_ids_Tk=topk_ids, expert_map_E=expert_map,
                        num_local_experts=El)
        moe_gemm(buf["intermediate"], w2, y, cfg.gemm2, rows2,
                 scales=GemmScales(inter_scale, modes.a2, q.w2_scale, modes.w, group),
                 epilogue=GemmEpilogue(topk_weights_Tk=None if apply_router_weight_on_input else topk_weights),
                 launch=cfg.launch2)
        # with the second GEMM's pdl the top-k sum, too, starts while the second GEMM finishes
        moe_sum(y, topk_ids, output, El, expert_map, pdl=bool(cfg.launch2.pdl))
