"""DeepEPLLPrepareAndFinalize: BatchedExperts-format expert parallelism over DeepEP's low-latency kernels.

Shape legend: T tokens on this rank, K hidden, Kl the low-latency kernel hidden size (K rounded
up to one DeepEP is built for), k topk, El local experts, W ranks, Tm tokens per rank the buffer holds
(moe.max_num_tokens rounded up so that W * Tm is a multiple of 4), B = Tm * W slots per local expert,
G = ceil(K / 128) fp8 scale groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from all2all.deepep import (
    LL_MAX_TOPK,
    LL_MIN_EXPERTS,
    LL_SCALE_GROUP,
    DeepEPLLBufferConfig,
    DeepEPLowLatencyManager,
    ll_dispatch_has_use_fp8,
    ll_dispatch_tokens,
    ll_hidden_size,
    ll_rank_count_error,
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
from moe_modular.prepare_finalize.ep_common import ExpertPlacementTables, quantize_for_dispatch
from moe_modular.prepare_finalize.ep_prepare_and_finalize import EPPrepareAndFinalize
from moe_modular.wire_bytes import PhaseBytes, RouteCounts, token_row_bytes
from moe_modular.profiler_scope import phase
from moe_modular.quant import ActivationQuant, MoEQuantParams, QuantConfig
from moe_modular.weight_and_reduce import (
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNaiveBatched,
)

LL_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class _Dispatched:
    """What finalize needs from the prepare of the same forward (PrepareResult.handle)."""

    T: int
    handle: Any  # DeepEP's low-latency handle
    ids_Tk: torch.Tensor  # (T, k) int64 DeepEP expert ids used for the dispatch (and the combine)


class DeepEPLLPrepareAndFinalize(EPPrepareAndFinalize):
    """Tokens land in (El, B, K) per-expert slots (DeepEP low-latency kernels, one QP per local expert).

    prepare: fp8 1 x 128 group schemes dispatch in fp8, quantized by DeepEP, with (El, B, G) float32
    scales; every other scheme dispatches bf16 (needs a deep_ep whose low_latency_dispatch takes
    use_fp8) and is quantized after arrival (a dynamic per-tensor scale is the amax over all ranks'
    received tokens). K is padded to Kl with zeros and cut back on arrival; K above the largest
    kernel size is refused. prepare_no_receive issues the sends and returns DeepEP's receive hook
    wrapped as the receiver.
    finalize: DeepEP's combine applies the top-k weights (ones when they were applied on the input)
    and reduces; the experts must leave weighting to the PF (Delegate or NaiveBatched impl).
    """

    BACKEND = DeepEPLowLatencyManager.backend_name

    def __init__(self, moe: MoEConfig, manager: DeepEPLowLatencyManager) -> None:
        super().__init__(moe, manager)
        self.kernel_hidden = ll_hidden_size(moe.hidden_dim)
        self.fp8_dispatch = self.dispatches_fp8(moe.quant)
        if not self.fp8_dispatch and not manager.dispatch_accepts("use_fp8"):
            raise ValueError(f"{type(self).__name__}: {_NO_BF16_DISPATCH} (scheme {moe.quant.name})")
        self.dispatch_tokens = ll_dispatch_tokens(moe.max_num_tokens, manager.world_size)
        self.handle = manager.get_handle(
            DeepEPLLBufferConfig(self.dispatch_tokens, self.kernel_hidden, moe.num_experts))
        self.linear_E = linear_expert_table(ExpertPlacementTables.build(moe, manager.device))

    # ---- capabilities -----------------------------------------------------------------------
    @classmethod
    def dispatches_fp8(cls, quant: QuantConfig) -> bool:
        """True for fp8 1 x 128 group scales, the layout DeepEP's fp8 dispatch produces."""
        return quant.is_quantized and quant.activation is ActivationQuant.GROUP and quant.group_size == LL_SCALE_GROUP

    @classmethod
    def quantizes_before_dispatch(cls, quant: QuantConfig) -> bool:
        """DeepEP's dispatch kernel quantizes (1 x 128 groups) as it sends: see dispatches_fp8."""
        return cls.dispatches_fp8(quant)

    @classmethod
    def check_config(cls, moe: MoEConfig) -> Optional[str]:
        """None when DeepEP's low-latency kernels can serve `moe`, else why not (no backend needed)."""
        error = ll_rank_count_error(moe.ep_size)
        if error is not None:
            return error
        if moe.dtype != LL_DTYPE:
            return f"dtype ({moe.dtype}) must be {LL_DTYPE}: DeepEP's low-latency kernels take bf16 only"
        if moe.topk > LL_MAX_TOPK:
            return f"topk ({moe.topk}) must be <= {LL_MAX_TOPK} for DeepEP's low-latency kernels"
        if moe.num_experts < LL_MIN_EXPERTS:
            return (f"num_experts ({moe.num_experts}) must be >= {LL_MIN_EXPERTS} for DeepEP's low-latency dispatch "
                    f"kernel")
        try:
            ll_hidden_size(moe.hidden_dim)
        except ValueError as exc:
            return str(exc)
        return None

    @classmethod
    def supports(cls, moe: MoEConfig) -> tuple[bool, str]:
        ok, reason = deepep_supports(moe, cls.check_config)
        if ok and not cls.dispatches_fp8(moe.quant) and not ll_dispatch_has_use_fp8():
            return False, f"{_NO_BF16_DISPATCH} (scheme {moe.quant.name})"
        return ok, reason

    @classmethod
    def wire_bytes(cls, moe: MoEConfig, counts: RouteCounts, wire, experts_reduce: bool) -> PhaseBytes:
        """One message per route at the kernel hidden Kl: fp8 with Kl/128 scales for 1x128 group schemes,
        else bf16; one bf16 Kl row per route back."""
        Kl = ll_hidden_size(moe.hidden_dim)
        fp8 = cls.dispatches_fp8(moe.quant)
        row = token_row_bytes(Kl, fp8, LL_DTYPE, Kl // LL_SCALE_GROUP if fp8 else 0)
        return PhaseBytes.of([n * row for n in counts.sent(counts.routes)],
                             [n * Kl * LL_DTYPE.itemsize for n in counts.returned(counts.routes)])

    @classmethod
    def vllm_all2all_backend(cls) -> Optional[str]:
        return "deepep_low_latency"

    @classmethod
    def activation_format(cls) -> ActivationFormat:
        return ActivationFormat.BatchedExperts

    def topk_indices_dtype(self) -> Optional[torch.dtype]:
        return torch.int64

    def max_num_tokens_per_rank(self) -> Optional[int]:
        """Tm: the slots each rank has per local expert in the receive buffer (B = Tm * W)."""
        return self.dispatch_tokens

    def has_prepare_no_receive(self) -> bool:
        return True

    # ---- prepare ------------------------------------------------------------------------------
    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                quant: MoEQuantParams, micro_batch: int = 0) -> PrepareResult:
        """a1 (T, K) bf16, T <= moe.max_num_tokens; topk_ids (T, k) int64 global ids; the placement
        comes from moe.parallel (expert_map is not consulted). Returns a1q (El, B, K) fp8 or bf16,
        a1q_scale (El, B, G) / (El, B, 1) / (1,) / None and expert_num_tokens (El,) int32."""
        return self._start(a1, topk_ids, topk_weights, num_experts, apply_router_weight_on_input, quant, False,
                           micro_batch)()

    def prepare_no_receive(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                           quant: MoEQuantParams, micro_batch: int = 0) -> Callable[[], PrepareResult]:
        """Issue the sends; the returned receiver runs DeepEP's receive hook and builds the result."""
        return self._start(a1, topk_ids, topk_weights, num_experts, apply_router_weight_on_input, quant, True,
                           micro_batch)

    def _start(self, a1, topk_ids, topk_weights, num_experts, apply_on_input, quant: MoEQuantParams,
               use_hook: bool, micro_batch: int) -> Callable[[], PrepareResult]:
        # DeepEP alternates between two low-latency buffers on every call, so two micro-batches in flight
        # need no buffers of their own.
        check_micro_batch(self, micro_batch)
        moe = self.moe
        if num_experts != moe.num_experts:
            raise ValueError(f"num_experts ({num_experts}) must equal moe.num_experts ({moe.num_experts})")
        T, K = a1.shape
        if K != moe.hidden_dim:
            raise ValueError(f"a1 hidden size ({K}) must equal moe.hidden_dim ({moe.hidden_dim})")
        if T > moe.max_num_tokens:
            raise ValueError(f"tokens ({T}) must be <= max_num_tokens ({moe.max_num_tokens}), the low-latency "
                             f"buffer's capacity per rank")
        a1 = apply_weight_on_input(a1, topk_weights, apply_on_input)
        x_TKl = pad_hidden(a1.to(LL_DTYPE), self.kernel_hidden)
        ids_Tk = to_linear_ids(self.linear_E, topk_ids)
        kwargs: dict[str, Any] = {}
        if self.manager.dispatch_accepts("use_fp8"):
            kwargs["use_fp8"] = self.fp8_dispatch
        with phase("dispatch"):
            recv_x, recv_count_El, deep_ep_handle, _, hook = self.handle.deep_ep_buffer.low_latency_dispatch(
                x_TKl, ids_Tk, self.dispatch_tokens, num_experts, async_finish=False, return_recv_hook=use_hook,
                **kwargs)

        def receive() -> PrepareResult:
            if use_hook:
                hook()
            if isinstance(recv_x, tuple):
                xq_ElBKl, scale_ElBGl = recv_x
                G = -(-K // LL_SCALE_GROUP)
                a1q = xq_ElBKl[..., :K].contiguous()
                a1q_scale = scale_ElBGl[..., :G].contiguous()
            else:
                a1q, a1q_scale = self._quantize_received(recv_x[..., :K], recv_count_El, quant)
            meta = ExpertTokensMetadata(expert_num_tokens=recv_count_El.to(torch.int32))
            return PrepareResult(a1q=a1q, a1q_scale=a1q_scale, expert_tokens_meta=meta,
                                 handle=_Dispatched(T, deep_ep_handle, ids_Tk))

        return receive

    def _quantize_received(self, x_ElBK: torch.Tensor, count_El: torch.Tensor, quant: MoEQuantParams):
        """Quantize bf16 slots after arrival; slots past each expert's count are zeroed first, so they
        neither hold stale values nor enter a per-tensor amax."""
        if not quant.config.is_quantized:
            return x_ElBK.contiguous(), None
        El, B, K = x_ElBK.shape
        valid_ElB = torch.arange(B, device=x_ElBK.device).unsqueeze(0) < count_El.to(x_ElBK.device).unsqueeze(1)
        rows = torch.where(valid_ElB.unsqueeze(2), x_ElBK, torch.zeros((), dtype=x_ElBK.dtype, device=x_ElBK.device))
        xq, scale = quantize_for_dispatch(rows.reshape(El * B, K), quant, self.group)
        if scale is not None and scale.dim() == 2:
            scale = scale.reshape(El, B, scale.size(1))
        return xq.reshape(El, B, K), scale

    # ---- finalize -----------------------------------------------------------------------------
    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                 weight_and_reduce_impl, handle) -> None:
        """output (T, K) bf16; fused_expert_output (El, B, K) unweighted slot outputs; topk_weights (T, k)
        float32 as given to prepare (ones are sent instead when they were applied on the input)."""
        st = finalize_handle(self, handle, _Dispatched, output.size(0))
        if not isinstance(weight_and_reduce_impl, _PF_REDUCES):
            allowed = [c.__name__ for c in _PF_REDUCES]
            raise ValueError(
                f"{type(self).__name__} weights and reduces inside DeepEP's combine; the experts' finalize impl "
                f"({type(weight_and_reduce_impl).__name__}) must be one of {allowed}")
        moe = self.moe
        El, B = moe.num_local_experts, self.dispatch_tokens * self.world_size
        K = moe.hidden_dim
        if tuple(fused_expert_output.shape) != (El, B, K):
            raise ValueError(f"fused_expert_output must be ({El}, {B}, {K}), got {tuple(fused_expert_output.shape)}")
        y_ElBKl = pad_hidden(fused_expert_output.to(LL_DTYPE), self.kernel_hidden)
        weights_Tk = torch.ones_like(topk_weights, dtype=torch.float32) if apply_router_weight_on_input \
            else topk_weights.float().contiguous()
        with phase("combine"):
            combined_TKl, _, _ = self.handle.deep_ep_buffer.low_latency_combine(
                y_ElBKl, st.ids_Tk, weights_Tk, st.handle, async_finish=False, return_recv_hook=False)
        output.copy_(combined_TKl[:, :K])


_PF_REDUCES = (TopKWeightAndReduceDelegate, TopKWeightAndReduceNaiveBatched)
_NO_BF16_DISPATCH = ("the installed deep_ep's low_latency_dispatch always casts to fp8 (it takes no use_fp8 "
                     "argument), so only fp8 1 x 128 group schemes can use it")
