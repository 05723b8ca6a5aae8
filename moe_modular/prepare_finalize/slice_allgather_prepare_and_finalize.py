"""SliceAllGatherPrepareAndFinalize: EP when every rank holds the same batch (tensor-parallel
attention + expert-parallel MoE).

Shape legend: M tokens (identical on every rank), S = max(1, ceil(M / W)) rows per slice,
W world size, K hidden, k topk.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch

from all2all.base import all_gather_single
from moe_modular.config import MoEConfig
from moe_modular.interfaces import ActivationFormat, FusedMoEPrepareAndFinalizeModular, PrepareResult
from moe_modular.prepare_finalize.all_to_all_prepare_and_finalize import AllToAllPrepareAndFinalize
from moe_modular.prepare_finalize.common import finalize_handle
from moe_modular.prepare_finalize.ep_common import check_context
from moe_modular.wire_bytes import PhaseBytes, RouteCounts
from moe_modular.quant import MoEQuantParams, QuantConfig


@dataclass(frozen=True)
class _Slice:
    """What finalize needs from the prepare of the same forward (PrepareResult.handle)."""

    T: int  # M, the shared batch
    S: int
    weights_Sk: torch.Tensor  # (S, k) float32, 0 on padding rows
    ids_Sk: torch.Tensor  # (S, k) global ids, -1 on padding rows
    inner: Any  # the inner PF's handle


class SliceAllGatherPrepareAndFinalize(FusedMoEPrepareAndFinalizeModular):
    """Rank r takes rows [r*S, (r+1)*S) of the shared (M, K) batch; rows past M are padding
    with expert id -1 and weight 0, so they cost no expert work (every rank has at least one
    row, even when M < W). The inner Standard-format EP PF (AllToAllPrepareAndFinalize by
    default) dispatches and combines the slice; finalize all-gathers the (S, K) slices into
    (W*S, K) and keeps the first M rows, the same full output on every rank. The all-gather is
    fixed-size: no host sync beyond the inner PF's.

    The experts see what the inner PF delivers (local ids, -1 elsewhere, expert_map=None).
    Quantization placement is the inner PF's.
    """

    def __init__(self, moe: MoEConfig, context, inner: FusedMoEPrepareAndFinalizeModular):
        if inner.activation_format() is not ActivationFormat.Standard:
            raise ValueError(
                f"inner ({type(inner).__name__}) must produce the standard format, "
                f"not {inner.activation_format().value}"
            )
        self.moe = moe
        self.group = context.group
        self.rank, self.world_size = context.rank, context.world_size
        self.inner = inner

    # ---- capabilities -----------------------------------------------------------------------
    @classmethod
    def supports(cls, moe: MoEConfig) -> tuple[bool, str]:
        """Whatever the default inner PF (AllToAllPrepareAndFinalize) supports."""
        return AllToAllPrepareAndFinalize.supports(cls.slice_moe(moe))

    @classmethod
    def quantizes_before_dispatch(cls, quant: QuantConfig) -> bool:
        return AllToAllPrepareAndFinalize.quantizes_before_dispatch(quant)

    @classmethod
    def combine_wires(cls) -> tuple[str, ...]:
        """The default inner PF's (AllToAllPrepareAndFinalize.make(..., combine_wire=...) builds it with one)."""
        return AllToAllPrepareAndFinalize.combine_wires()

    @classmethod
    def wire_bytes(cls, moe: MoEConfig, counts: RouteCounts, wire, experts_reduce: bool) -> PhaseBytes:
        """The default inner PF's exchange of each rank's slice (T rows here), then an all-gather of the (T, K)
        output slices."""
        inner = AllToAllPrepareAndFinalize.wire_bytes(moe, counts, wire, experts_reduce)
        gather = (counts.world_size - 1) * counts.tokens_per_rank * moe.hidden_dim * moe.dtype.itemsize
        return PhaseBytes.of(inner.dispatch, [n + gather for n in inner.combine])

    @classmethod
    def slice_moe(cls, moe: MoEConfig) -> MoEConfig:
        """The inner PF's problem: at most ceil(max_num_tokens / W) tokens per rank."""
        return replace(moe, max_num_tokens=max(1, math.ceil(moe.max_num_tokens / moe.ep_size)))

    @classmethod
    def make(cls, moe: MoEConfig, context=None,
             inner_type: type[FusedMoEPrepareAndFinalizeModular] = AllToAllPrepareAndFinalize,
             ) -> "SliceAllGatherPrepareAndFinalize":
        check_context(cls.__name__, moe, context)
        return cls(moe, context, inner_type.make(cls.slice_moe(moe), context))

    @classmethod
    def requires_distributed(cls) -> bool:
        return True

    @classmethod
    def expects_replicated_input(cls) -> bool:
        """Every rank must pass the same hidden states and routing (and gets the same output)."""
        return True

    @classmethod
    def activation_format(cls) -> ActivationFormat:
        return ActivationFormat.Standard

    def topk_indices_dtype(self) -> Optional[torch.dtype]:
        return self.inner.topk_indices_dtype()

    def max_num_tokens_per_rank(self) -> Optional[int]:
        return self.inner.max_num_tokens_per_rank()

    def num_dispatchers(self) -> int:
        return self.inner.num_dispatchers()

    def output_is_reduced(self) -> bool:
        return True

    def has_prepare_no_receive(self) -> bool:
        return self.inner.has_prepare_no_receive()

    # ---- prepare / finalize -------------------------------------------------------------------
    def _slice(self, a1, topk_weights, topk_ids):
        M, K = a1.shape
        k = topk_ids.size(1)
        S = max(1, math.ceil(M / self.world_size))
        start = min(self.rank * S, M)
        n = min(S, M - start)
        a1_S = a1.new_zeros((S, K))
        a1_S[:n] = a1[start:start + n]
        w_S = torch.zeros((S, k), dtype=topk_weights.dtype, device=a1.device)
        w_S[:n] = topk_weights[start:start + n]
        ids_S = torch.full((S, k), -1, dtype=topk_ids.dtype, device=a1.device)
        ids_S[:n] = topk_ids[start:start + n]
        return a1_S, w_S, ids_S

    @staticmethod
    def _with_slice(prepared: PrepareResult, M: int, w_S: torch.Tensor, ids_S: torch.Tensor) -> PrepareResult:
        """The inner PF's result, its handle wrapped with what finalize needs of the slice."""
        return replace(prepared, handle=_Slice(M, w_S.size(0), w_S, ids_S, prepared.handle))

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                quant: MoEQuantParams, micro_batch: int = 0) -> PrepareResult:
        """a1 (M, K), topk_weights (M, k), topk_ids (M, k) global ids, identical on every rank.
        Returns the inner PF's result for this rank's (S, K) slice."""
        a1_S, w_S, ids_S = self._slice(a1, topk_weights, topk_ids)
        prepared = self.inner.prepare(a1_S, w_S, ids_S, num_experts, expert_map, apply_router_weight_on_input,
                                      quant, micro_batch)
        return self._with_slice(prepared, a1.size(0), w_S, ids_S)

    def prepare_no_receive(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                           quant: MoEQuantParams, micro_batch: int = 0) -> Callable[[], PrepareResult]:
        a1_S, w_S, ids_S = self._slice(a1, topk_weights, topk_ids)
        receive = self.inner.prepare_no_receive(a1_S, w_S, ids_S, num_experts, expert_map,
                                                apply_router_weight_on_input, quant, micro_batch)
        return lambda: self._with_slice(receive(), a1.size(0), w_S, ids_S)

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                 weight_and_reduce_impl, handle) -> None:
        """output (M, K): the full result, written identically on every rank."""
        st = finalize_handle(self, handle, _Slice, output.size(0))
        K = output.size(1)
        slice_SK = torch.empty((st.S, K), dtype=output.dtype, device=output.device)
        self.inner.finalize(slice_SK, fused_expert_output, st.weights_Sk, st.ids_Sk, apply_router_weight_on_input,
                            weight_and_reduce_impl, st.inner)
        gathered = torch.empty((self.world_size * st.S, K), dtype=output.dtype, device=output.device)
        all_gather_single(gathered.view(torch.uint8), slice_SK.view(torch.uint8), self.group)
        output.copy_(gathered[:st.T])
