"""FusedMoEModularKernel: one PrepareAndFinalize + one Experts object, composed.

Shape legend: T tokens on this rank, K hidden, N2 = w1 rows (2 * intermediate), k topk,
El local experts, E global experts.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import torch

from moe_modular.checks import check_expert_map, check_routing, check_routing_values
from moe_modular.config import Activation
from moe_modular.interfaces import (
    MICRO_BATCHES,
    ActivationFormat,
    FusedMoEExpertsModular,
    FusedMoEPrepareAndFinalizeModular,
    PrepareResult,
)
from moe_modular.profiler_scope import phase
from moe_modular.quant import MoEQuantParams
from moe_modular.workspace import WorkspaceCache

DEFAULT_CHUNK_SIZE = 32 * 1024


class _Call(NamedTuple):
    """One forward's checked arguments; prepare / start run one micro-batch's rows of them (rows None: all of
    them, without taking views: an eager forward's host time counts)."""

    pf: FusedMoEPrepareAndFinalizeModular
    quant: MoEQuantParams
    hidden_states: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    activation: Activation
    global_num_experts: int
    expert_map: Optional[torch.Tensor]
    apply_router_weight_on_input: bool
    output: torch.Tensor

    def parts(self, micro_batches: int) -> list[Optional[slice]]:
        """The rows of each micro-batch: all (None) for one; else the first ceil(T/parts) rows, then the rest."""
        if micro_batches == 1:
            return [None]
        T = self.hidden_states.size(0)
        size = -(-T // micro_batches)
        return [slice(min(p * size, T), min((p + 1) * size, T)) for p in range(micro_batches)]

    def _args(self, rows: Optional[slice]):
        return (_rows(self.hidden_states, rows), _rows(self.topk_weights, rows), _rows(self.topk_ids, rows),
                self.global_num_experts, self.expert_map, self.apply_router_weight_on_input, self.quant)

    def prepare(self, micro_batch: int, rows: Optional[slice]) -> PrepareResult:
        return self.pf.prepare(*self._args(rows), micro_batch=micro_batch)

    def start(self, micro_batch: int, rows: Optional[slice]) -> Callable[[], PrepareResult]:
        return self.pf.prepare_no_receive(*self._args(rows), micro_batch=micro_batch)


def _rows(t: torch.Tensor, rows: Optional[slice]) -> torch.Tensor:
    return t if rows is None else t[rows]


class FusedMoEModularKernel(torch.nn.Module):
    """prepare (quantize + dispatch) -> experts -> finalize (weight, reduce, combine).

    prepare_finalize / fused_experts: the pair; their activation formats must match.
    shared_experts: optional module run on the (un-dispatched) input; when the PF can start its
      dispatch without waiting (`has_prepare_no_receive`) it runs while the dispatch is in flight.
    workspaces: a WorkspaceCache to share scratch buffers across layers (a private one if None); the
      two-micro-batch forward gives its second micro-batch a private cache of its own.
    chunk_size: Standard-format experts that support chunking see at most this many tokens per
      apply call; larger batches are processed in chunks into one output.
    check_inputs: also check the routing ids' values (each in [0, global_num_experts)) on every forward. That
      costs a device-to-host sync, so it is off by default (the forward stays CUDA-graph capturable) and on in
      the tests and the CLIs. Without it a route whose id is outside [0, E) contributes nothing to its
      token's output, in every experts class and PF; shapes, dtypes, devices and the weights against the
      scheme are checked on every forward either way (moe_modular.checks).
    """

    def __init__(
        self,
        prepare_finalize: FusedMoEPrepareAndFinalizeModular,
        fused_experts: FusedMoEExpertsModular,
        shared_experts: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        workspaces: Optional[WorkspaceCache] = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        check_inputs: bool = False,
    ) -> None:
        super().__init__()
        pf_format = prepare_finalize.activation_format()
        fe_in, _ = fused_experts.activation_formats()
        if pf_format is not fe_in:
            raise ValueError(
                f"{type(prepare_finalize).__name__} produces the {pf_format.value} activation format but "
                f"{type(fused_experts).__name__} takes {fe_in.value}; pair it with experts taking {pf_format.value}"
            )
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size ({chunk_size!r}) must be an int >= 1")
        self.prepare_finalize = prepare_finalize
        self.fused_experts = fused_experts
        self.shared_experts = shared_experts
        self.workspaces = workspaces if workspaces is not None else WorkspaceCache()
        self.second_workspaces = WorkspaceCache(poison=self.workspaces.poison)
        self.chunk_size = chunk_size
        self.check_inputs = bool(check_inputs)

    # ------------------------------------------------------------------------------------
    def forward(
        self,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: Activation = Activation.SILU,
        global_num_experts: int = -1,
        expert_map: Optional[torch.Tensor] = None,
        apply_router_weight_on_input: bool = False,
        inplace: bool = False,
        output: Optional[torch.Tensor] = None,
        micro_batches: int = 1,
    ):
        """hidden_states (T, K) activation dtype; w1 (El, N2, K), w2 (El, K, N2/2) (fp8 when quantized,
        scales in fused_experts.quant); topk_weights (T, k) float32; topk_ids (T, k) int global ids;
        expert_map (E,) int32 global -> local or -1; output: optional (T, K) buffer to write
        (else hidden_states when inplace, else a new tensor). Returns the (T, K) output, or
        (shared_output, output) when shared experts are set.

        micro_batches=2 runs the tokens as two micro-batches whose communication overlaps the other's compute:
        A (the first ceil(T/2) rows) and B (the rest, possibly none); both dispatches start, then A's experts and
        combine run while B's dispatch completes, then B's. Shared experts run once, on all tokens, while the
        dispatches are in flight. Every rank must pass the same micro_batches (each micro-batch is a collective
        step, even an empty one)."""
        if type(micro_batches) is not int or micro_batches not in (1, MICRO_BATCHES):  # noqa: E721 - bool is refused
            raise ValueError(f"micro_batches ({micro_batches!r}) must be 1 or {MICRO_BATCHES}")
        call = self._begin(hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts, expert_map,
                           apply_router_weight_on_input, inplace, output)
        if micro_batches == 1:
            return self._forward_one(call)
        return self._forward_micro_batched(call, micro_batches)

    def _forward_one(self, call: "_Call"):
        """One batch: the dispatch overlaps the shared experts where the PF can start it without waiting."""
        pf, shared_output = self.prepare_finalize, None
        with phase("prepare"):
            if self.shared_experts is not None and pf.has_prepare_no_receive():
                receiver = call.start(0, None)
                shared_output = self._shared(call.hidden_states)
                prepared = receiver()
            else:
                prepared = call.prepare(0, None)
        if self.shared_experts is not None and shared_output is None:
            shared_output = self._shared(call.hidden_states)
        self._experts_and_finalize(call, prepared, call.output, call.topk_weights, call.topk_ids, self.workspaces)
        return call.output if self.shared_experts is None else (shared_output, call.output)

    def _forward_micro_batched(self, call: "_Call", micro_batches: int):
        """Every micro-batch's dispatch starts (and the shared experts run) before the first one's experts; each
        micro-batch has its own workspaces."""
        pf = self.prepare_finalize
        parts = call.parts(micro_batches)
        with phase("prepare"):
            if pf.has_prepare_no_receive():
                receivers = [call.start(mb, rows) for mb, rows in enumerate(parts)]
            else:
                prepared = [call.prepare(mb, rows) for mb, rows in enumerate(parts)]
                receivers = [lambda p=p: p for p in prepared]
            shared_output = self._shared(call.hidden_states)
        for mb, (rows, workspaces) in enumerate(zip(parts, (self.workspaces, self.second_workspaces))):
            with phase("prepare"):
                prepared_mb = receivers[mb]()
            self._experts_and_finalize(call, prepared_mb, call.output[rows], call.topk_weights[rows],
                                       call.topk_ids[rows], workspaces)
        return call.output if self.shared_experts is None else (shared_output, call.output)

    def _shared(self, hidden_states: torch.Tensor) -> Optional[torch.Tensor]:
        if self.shared_experts is None:
            return None
        with phase("shared_experts"):
            return self.shared_experts(hidden_states)

    def _begin(self, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts, expert_map,
               apply_router_weight_on_input, inplace, output) -> "_Call":
        """The checks and argument normalization every forward starts with."""
        if global_num_experts == -1:
            global_num_experts = w1.size(0) if expert_map is None else expert_map.numel()
        self._check_inputs(hidden_states, w1, w2, topk_weights, topk_ids, expert_map, apply_router_weight_on_input,
                           global_num_experts)
        if self.check_inputs:
            check_routing_values(topk_ids, global_num_experts)
        idx_dtype = self.prepare_finalize.topk_indices_dtype()
        if idx_dtype is not None and topk_ids.dtype != idx_dtype:
            topk_ids = topk_ids.to(idx_dtype)
        if output is None:
            output = hidden_states if inplace else torch.empty_like(hidden_states)
        elif output.shape != hidden_states.shape or output.dtype != hidden_states.dtype:
            raise ValueError(
                f"output {tuple(output.shape)} {output.dtype} must match hidden_states "
                f"{tuple(hidden_states.shape)} {hidden_states.dtype}"
            )
        return _Call(self.prepare_finalize, self.fused_experts.quant, hidden_states, w1, w2, topk_weights, topk_ids,
                     activation, global_num_experts, expert_map, apply_router_weight_on_input, output)

    def _experts_and_finalize(self, call: "_Call", prepared: PrepareResult, output: torch.Tensor,
                              topk_weights: torch.Tensor, topk_ids: torch.Tensor, workspaces: WorkspaceCache) -> None:
        """One micro-batch's experts and finalize: output, topk_weights, topk_ids are its rows."""
        fe = self.fused_experts
        with phase("experts"):
            fused_out = self._run_experts(prepared, call.w1, call.w2, topk_weights, topk_ids, call.activation,
                                          call.global_num_experts, call.expert_map,
                                          call.apply_router_weight_on_input, output, workspaces)
        with phase("finalize"):
            call.pf.finalize(output, fused_out, topk_weights, topk_ids, call.apply_router_weight_on_input,
                             fe.finalize_weight_and_reduce_impl(), prepared.handle)

    def _writes_output_directly(self, output: torch.Tensor, out_shape, fe, a1q: torch.Tensor) -> bool:
        """Whether the experts can write the caller's output: finalize would only copy their final (T, K)
        result there, and output does not share memory with the experts' input (inplace)."""
        return (self.prepare_finalize.finalize_passes_through(fe.finalize_weight_and_reduce_impl())
                and tuple(output.shape) == tuple(out_shape) and output.dtype == fe.moe.dtype
                and output.untyped_storage().data_ptr() != a1q.untyped_storage().data_ptr())

    # ------------------------------------------------------------------------------------
    def _check_inputs(self, hidden_states, w1, w2, topk_weights, topk_ids, expert_map, apply_router_weight_on_input,
                      global_num_experts):
        """What costs no device sync: shapes, dtypes, devices and the weights against the scheme (routing id values
        only with check_inputs, check_routing_values)."""
        if hidden_states.dim() != 2:
            raise ValueError(f"hidden_states must be 2-D (T, K), got shape {tuple(hidden_states.shape)}")
        T, K = hidden_states.shape
        moe = self.fused_experts.moe
        if hidden_states.dtype != moe.dtype:
            raise ValueError(f"hidden_states dtype ({hidden_states.dtype}) must be the layer's dtype ({moe.dtype})")
        if w1.dim() != 3 or w2.dim() != 3:
            raise ValueError(f"w1 and w2 must be 3-D, got shapes {tuple(w1.shape)} and {tuple(w2.shape)}")
        if w1.size(2) != K or w2.size(1) != K:
            raise ValueError(
                f"hidden size K ({K}) must match w1.size(2) ({w1.size(2)}) and w2.size(1) ({w2.size(1)})"
            )
        if w1.size(1) != 2 * w2.size(2) or w1.size(0) != w2.size(0):
            raise ValueError(
                f"w1 {tuple(w1.shape)} and w2 {tuple(w2.shape)} must be (El, 2N, K) and (El, K, N)"
            )
        if topk_ids.dim() != 2 or topk_ids.size(0) != T or tuple(topk_weights.shape) != tuple(topk_ids.shape):
            raise ValueError(
                f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be ({T}, topk)"
            )
        check_routing(topk_ids, topk_weights)
        self.fused_experts.quant.check_weights(w1, w2, moe.dtype)
        for name, t in (("w1", w1), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if t.device != hidden_states.device:
                raise ValueError(f"{name} is on {t.device}, hidden_states on {hidden_states.device}: one device")
        if expert_map is not None:
            check_expert_map(expert_map, global_num_experts, w1.size(0), hidden_states.device)
        if apply_router_weight_on_input and topk_ids.size(1) != 1:
            raise ValueError(
                f"apply_router_weight_on_input needs topk == 1, got topk ({topk_ids.size(1)})"
            )
        if expert_map is not None and not self.fused_experts.supports_expert_map():
            raise ValueError(f"{type(self.fused_experts).__name__} does not support expert_map")

    def _run_experts(self, prepared: PrepareResult, w1, w2, topk_weights, topk_ids, activation,
                     global_num_experts, expert_map, apply_router_weight_on_input, output,
                     workspaces: WorkspaceCache) -> torch.Tensor:
        fe = self.fused_experts
        a1q = prepared.a1q
        if prepared.topk_ids is not None:
            # The PF re-routed tokens: its ids are local (-1 for routes held elsewhere).
            topk_ids, topk_weights = prepared.topk_ids, prepared.topk_weights
            expert_map, global_num_experts = None, w1.size(0)
        batched = fe.activation_formats()[0] is ActivationFormat.BatchedExperts
        M = a1q.size(1) if batched else a1q.size(0)
        N2, K = w1.size(1), w2.size(1)
        topk = topk_ids.size(1)
        El = w1.size(0)
        meta = prepared.expert_tokens_meta

        chunk = M if (batched or not fe.supports_chunking()) else min(M, self.chunk_size)
        chunk = max(chunk, 1)
        ws13_shape, ws2_shape, out_shape, ws_dtype = fe.workspace_shapes(chunk, N2, K, topk, global_num_experts,
                                                                        El, meta)
        if chunk != M:  # the output covers every chunk
            out_shape = fe.workspace_shapes(M, N2, K, topk, global_num_experts, El, meta)[2]
        dev = a1q.device
        if self._writes_output_directly(output, out_shape, fe, a1q):
            fused_out = output
        else:
            fused_out = workspaces.get("fused_out", tuple(out_shape), fe.moe.dtype, dev)
        if M == 0:
            return fused_out
        ws13 = workspaces.get("workspace13", tuple(ws13_shape), ws_dtype, dev)
        ws2 = workspaces.get("workspace2", tuple(ws2_shape), ws_dtype, dev)
        scale = prepared.a1q_scale
        for start in range(0, M, chunk):
            end = min(start + chunk, M)
            if batched or (start == 0 and end == M):
                out_c, a_c, s_c, ids_c, w_c = fused_out, a1q, scale, topk_ids, topk_weights
                meta_c = meta
                w13_c, w2_c = ws13, ws2
            else:
                n = end - start
                out_c = fused_out[start:end]
                a_c = a1q[start:end]
                s_c = scale[start:end] if (scale is not None and scale.dim() == 2 and scale.size(0) == M) else scale
                ids_c, w_c = topk_ids[start:end], topk_weights[start:end]
                # Per-expert counts describe the whole batch, not a chunk.
                meta_c = None
                c13, c2, _, _ = fe.workspace_shapes(n, N2, K, topk, global_num_experts, El, None)
                w13_c = ws13.flatten()[: math.prod(c13)].view(c13)
                w2_c = ws2.flatten()[: math.prod(c2)].view(c2)
            fe.apply(out_c, a_c, w1, w2, w_c, ids_c, activation, global_num_experts, expert_map,
                     s_c, fe.quant.a2_scale, w13_c, w2_c, meta_c, apply_router_weight_on_input)
        return fused_out
