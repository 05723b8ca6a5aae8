"""moe-modular: a modular fused mixture-of-experts backend.

The public API: configs, the quantization scheme and its scales, the modular kernel and its two
interfaces, the layer, and the workspace cache. PrepareAndFinalize and Experts classes live in
moe_modular.prepare_finalize / moe_modular.experts (moe_modular.registry lists them by name).
"""
from moe_modular.config import Activation, ExpertPlacement, MoEConfig, ParallelConfig
from moe_modular.fused_moe_layer import FusedMoE, RoutingConfig
from moe_modular.interfaces import (
    ActivationFormat,
    FusedMoEExpertsModular,
    FusedMoEPrepareAndFinalizeModular,
    PrepareResult,
)
from moe_modular.modular_kernel import FusedMoEModularKernel
from moe_modular.quant import MoEQuantParams, QuantConfig
from moe_modular.workspace import WorkspaceCache

__all__ = [
    "Activation",
    "ActivationFormat",
    "ExpertPlacement",
    "FusedMoE",
    "FusedMoEExpertsModular",
    "FusedMoEModularKernel",
    "FusedMoEPrepareAndFinalizeModular",
    "MoEConfig",
    "MoEQuantParams",
    "ParallelConfig",
    "PrepareResult",
    "QuantConfig",
    "RoutingConfig",
    "WorkspaceCache",
]
