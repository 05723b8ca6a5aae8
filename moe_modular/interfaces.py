"""The modular-kernel interfaces (names follow vLLM's fused-MoE modular kernel).

Shape legend:
  T  tokens on this rank (M)        K  hidden size            N  intermediate size     N2 = 2N w1 rows
  k  topk                           E  global experts         El local experts
  B  max tokens per expert in the batched format
Dtypes: activations bf16/fp16/fp32 (or fp8 e4m3 once quantized), topk_weights float32,
topk_ids int32 (or int64 where the PF asks for it), scales float32.
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from moe_modular.config import Activation, MoEConfig
from moe_modular.quant import MoEQuantParams, QuantConfig

if TYPE_CHECKING:
    from moe_modular.wire_bytes import PhaseBytes, RouteCounts


class ActivationFormat(enum.Enum):
    """How tokens are laid out between prepare and finalize."""

    Standard = "standard"  # contiguous (T, K) + topk ids/weights (T, k)
    BatchedExperts = "batched"  # (El, B, K) + expert_num_tokens (El,)


@dataclass(frozen=True)
class ExpertTokensMetadata:
    """Per-local-expert token counts.

    expert_num_tokens: (El,) int32 on the device.
    expert_num_tokens_cpu: the same on the host, where the PF knows it without a sync.
    """

    expert_num_tokens: torch.Tensor
    expert_num_tokens_cpu: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class PrepareResult:
    """What prepare hands to the experts.

    a1q: Standard (T', K) or BatchedExperts (El, B, K); fp8 when quantized, else the activation dtype.
    a1q_scale: the activation scale in the scheme's layout (quant.py), or None.
    expert_tokens_meta: token counts per local expert (always set for BatchedExperts).
    topk_ids / topk_weights: (T', k) for the received tokens when the PF re-routes them
      (EP standard PFs), else None (the experts use the caller's).
    handle: what this forward's finalize needs from its prepare (the combine handle, a frozen value of
      the PF's own type; None for PFs that need nothing). The caller hands it to finalize, so one PF
      instance can have several micro-batches between prepare and finalize.
    """

    a1q: torch.Tensor
    a1q_scale: Optional[torch.Tensor] = None
    expert_tokens_meta: Optional[ExpertTokensMetadata] = None
    topk_ids: Optional[torch.Tensor] = None
    topk_weights: Optional[torch.Tensor] = None
    handle: Any = None


# Micro-batches one PF instance can have between prepare and finalize at once (each gets its own
# communication buffers; prepare's micro_batch picks them).
MICRO_BATCHES = 2


def check_supported(cls: type, moe: MoEConfig) -> None:
    """Raise ValueError naming the class, the problem and the class's own reason unless
    `cls.supports(moe)` says yes (for make() and constructors)."""
    ok, reason = cls.supports(moe)
    if not ok:
        raise ValueError(f"{cls.__name__} cannot serve {moe.describe()}: {reason}")


class TopKWeightAndReduce(ABC):
    """Multiply expert outputs by their top-k weights and sum the routes of each token."""

    @abstractmethod
    def apply(
        self,
        output: Optional[torch.Tensor],
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
    ) -> torch.Tensor:
        """Reduce fused_expert_output into output (T, K) (allocated when None) and return it."""

    def __repr__(self) -> str:
        return type(self).__name__


class FusedMoEPrepareAndFinalizeModular(ABC):
    """Quantize + dispatch (prepare), then weight-and-reduce + combine (finalize)."""

    @classmethod
    @abstractmethod
    def supports(cls, moe: MoEConfig) -> tuple[bool, str]:
        """(True, "") when this class can serve `moe`, else (False, the reason)."""

    @classmethod
    @abstractmethod
    def make(cls, moe: MoEConfig, context: "Optional[object]" = None) -> "FusedMoEPrepareAndFinalizeModular":
        """Build an instance for `moe`; `context` is the ParallelContext for EP classes."""

    @classmethod
    def requires_distributed(cls) -> bool:
        """True when make() needs a ParallelContext (an initialized process group)."""
        return False

    @abstractmethod
    def prepare(
        self,
        a1: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        num_experts: int,
        expert_map: Optional[torch.Tensor],
        apply_router_weight_on_input: bool,
        quant: MoEQuantParams,
        micro_batch: int = 0,
    ) -> PrepareResult:
        """a1 (T, K) activations, topk_weights (T, k) float32, topk_ids (T, k) int; num_experts is E;
        expert_map (E,) int32 global -> local id or -1; micro_batch in [0, MICRO_BATCHES): which
        communication buffers this forward uses (two micro-batches in flight need different ones).
        The result's `handle` goes to finalize."""

    @classmethod
    def expects_replicated_input(cls) -> bool:
        """True when every rank must be given the same tokens (the PF slices them itself); default False."""
        return False

    @classmethod
    def quantizes_before_dispatch(cls, quant: QuantConfig) -> bool:
        """True when, under `quant`, this PF quantizes before it dispatches (the tokens travel in fp8 where the
        scheme is fp8); default False, which is also the answer of a PF that does not dispatch."""
        return False

    @classmethod
    def wire_bytes(cls, moe: MoEConfig, counts: "RouteCounts", wire: Any,
                   experts_reduce: bool) -> "Optional[PhaseBytes]":
        """The bytes every rank sends to the other ranks in this PF's dispatch and combine under `counts`
        (moe_modular/wire_bytes.py); `wire`: the CombineWire, for a PF with several (combine_wires()), or None
        for its default; experts_reduce: the experts sum each token's routes themselves. None (the default):
        not modelled, which is also the answer of a PF that moves nothing between ranks."""
        return None

    @classmethod
    def combine_wires(cls) -> tuple[str, ...]:
        """The names make(moe, context, combine_wire=...) accepts; () (the default): one way to combine."""
        return ()

    @classmethod
    def vllm_all2all_backend(cls) -> Optional[str]:
        """The vLLM --all2all-backend name this PF serves under the vLLM plugin; None (the default): none."""
        return None

    def has_prepare_no_receive(self) -> bool:
        return False

    def prepare_no_receive(
        self,
        a1: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        num_experts: int,
        expert_map: Optional[torch.Tensor],
        apply_router_weight_on_input: bool,
        quant: MoEQuantParams,
        micro_batch: int = 0,
    ) -> Callable[[], PrepareResult]:
        """Start the dispatch and return a receiver that completes it (for overlap)."""
        raise NotImplementedError(f"{type(self).__name__} has no prepare_no_receive")

    @abstractmethod
    def finalize(
        self,
        output: torch.Tensor,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
        weight_and_reduce_impl: TopKWeightAndReduce,
        handle: Any,
    ) -> None:
        """Write the final (T, K) result of this rank's tokens into `output`; `handle` is the
        PrepareResult.handle of the prepare of the same tokens."""

    def finalize_passes_through(self, weight_and_reduce_impl: TopKWeightAndReduce) -> bool:
        """True when finalize, with this impl, only copies a (T, K) fused output that is already final
        into `output`; the modular kernel then has the experts write `output` itself (no copy)."""
        return False

    @classmethod
    @abstractmethod
    def activation_format(cls) -> ActivationFormat:
        """The format prepare produces (a classmethod: the combinations matrix reads it from the class)."""

    @abstractmethod
    def topk_indices_dtype(self) -> Optional[torch.dtype]: ...

    @abstractmethod
    def max_num_tokens_per_rank(self) -> Optional[int]: ...

    @abstractmethod
    def num_dispatchers(self) -> int: ...

    def output_is_reduced(self) -> bool:
        """True when finalize leaves the same reduced output on every rank."""
        return False


class FusedMoEExpertsModular(ABC):
    """The expert computation: permute, GEMM w1, activation, GEMM w2, unpermute (+ optional reduce).

    Constructed as cls(moe, quant, max_num_tokens=..., num_dispatchers=...); see `for_prepare_finalize`.
    """

    def __init__(
        self,
        moe: MoEConfig,
        quant: MoEQuantParams,
        max_num_tokens: Optional[int] = None,
        num_dispatchers: int = 1,
    ) -> None:
        if quant.config != moe.quant:
            raise ValueError(
                f"quant.config ({quant.config.name}) must equal moe.quant ({moe.quant.name})"
            )
        check_supported(type(self), moe)
        self.moe = moe
        self.quant = quant
        self.max_num_tokens = max_num_tokens if max_num_tokens is not None else moe.max_num_tokens
        self.num_dispatchers = num_dispatchers

    @classmethod
    def for_prepare_finalize(
        cls, moe: MoEConfig, quant: MoEQuantParams, prepare_finalize: FusedMoEPrepareAndFinalizeModular
    ) -> "FusedMoEExpertsModular":
        return cls(
            moe,
            quant,
            max_num_tokens=prepare_finalize.max_num_tokens_per_rank(),
            num_dispatchers=prepare_finalize.num_dispatchers(),
        )

    @classmethod
    @abstractmethod
    def supports(cls, moe: MoEConfig) -> tuple[bool, str]:
        """(True, "") when this class can serve `moe`, else (False, the reason)."""

    @classmethod
    @abstractmethod
    def activation_formats(cls) -> tuple[ActivationFormat, ActivationFormat]:
        """(input format, output format)."""

    @abstractmethod
    def supports_expert_map(self) -> bool: ...

    @abstractmethod
    def supports_chunking(self) -> bool: ...

    @abstractmethod
    def workspace_shapes(
        self,
        M: int,
        N2: int,
        K: int,
        topk: int,
        global_num_experts: int,
        local_num_experts: int,
        expert_tokens_meta: Optional[ExpertTokensMetadata],
    ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], torch.dtype]:
        """(workspace13 shape, workspace2 shape, output shape, workspace dtype).

        M: tokens in a1q (Standard) or B (BatchedExperts); N2: w1.size(1) (2N, N the intermediate size);
        K: hidden size. The output shape is what `apply` writes and finalize reads."""

    @abstractmethod
    def finalize_weight_and_reduce_impl(self) -> TopKWeightAndReduce: ...

    @abstractmethod
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
        """Compute the experts into `output` (shape from workspace_shapes).

        hidden_states: a1q from prepare; w1 (El, N2, K), w2 (El, K, N2/2) in the weight dtype
        (fp8 when quantized, scales in self.quant); topk_weights (T, k) float32, topk_ids (T, k)."""
