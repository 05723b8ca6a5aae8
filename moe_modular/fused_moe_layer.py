"""FusedMoE: a torch.nn.Module with a router, expert weights and a method that builds the
modular kernel; usable on its own (one rank) or under expert parallelism (a ParallelContext).

Shape legend: T tokens, K hidden, E global experts, El local experts, k topk.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from moe_modular.config import MoEConfig
from moe_modular.fp8_method import Fp8MoEMethod
from moe_modular.method import FusedMoEMethodBase
from moe_modular.registry import NO_EP_BACKEND
from moe_modular.routing import ScoringFunc, fused_topk, grouped_topk, make_expert_map
from moe_modular.unquantized_method import UnquantizedFusedMoEMethod
from moe_modular.workspace import WorkspaceCache


@dataclass(frozen=True)
class RoutingConfig:
    """How router logits become top-k experts.

    num_expert_group / topk_group: DeepSeek-style grouped routing when set (both or neither).
    use_correction_bias: a learned (E,) bias added to scores for selection only (grouped routing).
    """

    renormalize: bool = True
    num_expert_group: Optional[int] = None
    topk_group: Optional[int] = None
    scoring_func: ScoringFunc = ScoringFunc.SOFTMAX
    routed_scaling_factor: float = 1.0
    use_correction_bias: bool = False

    def __post_init__(self) -> None:
        if (self.num_expert_group is None) != (self.topk_group is None):
            raise ValueError(
                f"RoutingConfig.num_expert_group ({self.num_expert_group}) and topk_group ({self.topk_group}) "
                "must be set together"
            )
        if self.use_correction_bias and self.num_expert_group is None:
            raise ValueError("RoutingConfig.use_correction_bias (True) needs grouped routing (num_expert_group)")

    @property
    def grouped(self) -> bool:
        return self.num_expert_group is not None


class FusedMoE(torch.nn.Module):
    """moe: the problem (moe.parallel gives this rank's experts). method: weights + kernel builder
    (Unquantized or Fp8 from moe.quant when None). context: a ParallelContext under EP.
    workspaces: share one WorkspaceCache across the layers of a model. backend: the all2all
    backend name under EP."""

    def __init__(self, moe: MoEConfig, method: Optional[FusedMoEMethodBase] = None, *,
                 routing: RoutingConfig = RoutingConfig(), context=None,
                 workspaces: Optional[WorkspaceCache] = None, shared_experts: Optional[torch.nn.Module] = None,
                 backend: str = NO_EP_BACKEND, device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.moe = moe
        self.routing = routing
        self.context = context
        self.workspaces = workspaces
        self.shared_experts = shared_experts
        if method is None:
            method_cls = Fp8MoEMethod if moe.quant.is_quantized else UnquantizedFusedMoEMethod
            method = method_cls(moe, backend)
        self.method = method
        self.gate = torch.nn.Linear(moe.hidden_dim, moe.num_experts, bias=False, dtype=moe.dtype, device=device)
        self.gate.weight.requires_grad_(False)  # an inference layer: every weight is frozen
        if routing.use_correction_bias:
            self.e_score_correction_bias = torch.nn.Parameter(
                torch.zeros(moe.num_experts, dtype=torch.float32, device=device), requires_grad=False)
        else:
            self.e_score_correction_bias = None
        expert_map = (make_expert_map(moe.num_experts, moe.ep_size, moe.ep_rank, moe.parallel.placement, device=device)
                      if moe.parallel.use_ep else None)
        self.register_buffer("expert_map", expert_map, persistent=False)
        method.create_weights(self, device)
        self.weights_loaded = False  # create_weights leaves the expert weights uninitialised

    def load_weights(self, w13_EN2K: torch.Tensor, w2_EKN: torch.Tensor, **scales) -> None:
        """This rank's expert weights in high precision, (El, 2N, K) and (El, K, N)."""
        self.method.load_weights(self, w13_EN2K, w2_EKN, **scales)
        self.method.kernel = None  # rebuilt with the new scales on the next forward
        self.weights_loaded = True

    def route(self, hidden_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits -> (topk_weights (T, k) float32, topk_ids (T, k) int32 global ids)."""
        logits = self.gate(hidden_TK)
        r = self.routing
        if r.grouped:
            return grouped_topk(hidden_TK, logits, self.moe.topk, r.renormalize, r.num_expert_group, r.topk_group,
                                scoring_func=r.scoring_func, routed_scaling_factor=r.routed_scaling_factor,
                                e_score_correction_bias=self.e_score_correction_bias)
        return fused_topk(hidden_TK, logits, self.moe.topk, r.renormalize)

    def forward(self, hidden_TK: torch.Tensor):
        """hidden_TK (T, K) moe.dtype -> (T, K), or (shared, routed) with shared experts."""
        if not self.weights_loaded:
            raise RuntimeError("FusedMoE.forward before load_weights: the expert weights are uninitialised memory; "
                               "call layer.load_weights(w13, w2, ...) first")
        moe = self.moe
        if hidden_TK.dim() != 2 or hidden_TK.size(1) != moe.hidden_dim:
            raise ValueError(f"hidden_TK shape {tuple(hidden_TK.shape)} must be (T, {moe.hidden_dim}) (hidden_dim)")
        if hidden_TK.dtype != moe.dtype:
            raise ValueError(f"hidden_TK dtype ({hidden_TK.dtype}) must be the layer's dtype ({moe.dtype})")
        if self.method.kernel is None:
            self.method.init_prepare_finalize(self, self.context, self.workspaces, self.shared_experts)
        topk_weights, topk_ids = self.route(hidden_TK)
        return self.method.apply(self, hidden_TK, topk_weights, topk_ids, self.expert_map)
