"""FusedMoEMethodBase: how a FusedMoE layer holds its weights and builds its modular kernel.

Shape legend: El local experts, N2 = 2N, K hidden, T tokens, k topk.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import torch

from moe_modular.config import MoEConfig
from moe_modular.interfaces import FusedMoEExpertsModular, FusedMoEPrepareAndFinalizeModular
from moe_modular.modular_kernel import FusedMoEModularKernel
from moe_modular.quant import MoEQuantParams
from moe_modular.registry import NO_EP_BACKEND, prepare_finalize_type, select_experts_type
from moe_modular.workspace import WorkspaceCache


class FusedMoEMethodBase(ABC):
    """moe: the layer's problem. backend: the all2all backend name used when moe is expert
    parallel (ignored on one rank). experts_type: force an experts class (else the registry picks
    the first that supports moe in the PF's format)."""

    def __init__(self, moe: MoEConfig, backend: str = NO_EP_BACKEND,
                 experts_type: Optional[type[FusedMoEExpertsModular]] = None) -> None:
        self.moe = moe
        self.backend = backend
        self.experts_type = experts_type
        self.kernel: Optional[FusedMoEModularKernel] = None

    # ---- weights ----------------------------------------------------------------------
    @abstractmethod
    def create_weights(self, layer: torch.nn.Module, device: Optional[torch.device]) -> None:
        """Register w13_weight (El, N2, K) and w2_weight (El, K, N) (+ scales) on `layer`."""

    @abstractmethod
    def load_weights(self, layer: torch.nn.Module, w13_EN2K: torch.Tensor, w2_EKN: torch.Tensor, **scales) -> None:
        """Copy this rank's high-precision expert weights into the layer (quantizing if needed)."""

    @abstractmethod
    def quant_params(self, layer: torch.nn.Module) -> MoEQuantParams:
        """The scheme and the layer's scale tensors."""

    # ---- the modular kernel ---------------------------------------------------------------
    def maybe_make_prepare_finalize(self, context=None) -> FusedMoEPrepareAndFinalizeModular:
        """NoEP on one rank; otherwise the PF registered for self.backend, built on `context`."""
        backend = self.backend if self.moe.parallel.use_ep else NO_EP_BACKEND
        cls = prepare_finalize_type(backend)
        ok, reason = cls.supports(self.moe)
        if not ok:
            raise ValueError(f"{cls.__name__} (backend {backend!r}) does not support {self.moe.describe()}: {reason}")
        if cls.requires_distributed() and context is None:
            raise ValueError(f"{cls.__name__} (backend {backend!r}) needs a ParallelContext")
        return cls.make(self.moe, context)

    def select_gemm_impl(self, prepare_finalize: FusedMoEPrepareAndFinalizeModular,
                         layer: torch.nn.Module) -> FusedMoEExpertsModular:
        cls = self.experts_type or select_experts_type(
            prepare_finalize.activation_format(), self.moe, layer.w13_weight.device.type)
        return cls.for_prepare_finalize(self.moe, self.quant_params(layer), prepare_finalize)

    def init_prepare_finalize(self, layer: torch.nn.Module, context=None,
                              workspaces: Optional[WorkspaceCache] = None,
                              shared_experts: Optional[torch.nn.Module] = None) -> FusedMoEModularKernel:
        pf = self.maybe_make_prepare_finalize(context)
        fe = self.select_gemm_impl(pf, layer)
        self.kernel = FusedMoEModularKernel(pf, fe, shared_experts=shared_experts, workspaces=workspaces)
        return self.kernel

    def apply(self, layer: torch.nn.Module, x_TK: torch.Tensor, topk_weights_Tk: torch.Tensor,
              topk_ids_Tk: torch.Tensor, expert_map: Optional[torch.Tensor] = None):
        if self.kernel is None:
            raise RuntimeError(f"{type(self).__name__}.init_prepare_finalize must run before apply")
        return self.kernel(x_TK, layer.w13_weight, layer.w2_weight, topk_weights_Tk, topk_ids_Tk,
                           activation=self.moe.activation, global_num_experts=self.moe.num_experts,
                           expert_map=expert_map)

    @staticmethod
    def _check_weight_shapes(moe: MoEConfig, w13: torch.Tensor, w2: torch.Tensor) -> None:
        El, N, K = moe.num_local_experts, moe.intermediate_dim, moe.hidden_dim
        if tuple(w13.shape) != (El, 2 * N, K) or tuple(w2.shape) != (El, K, N):
            raise ValueError(
                f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} must be ({El}, {2 * N}, {K}) and ({El}, {K}, {N})"
            )
