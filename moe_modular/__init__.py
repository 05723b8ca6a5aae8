"""moe-modular: a modular fused mixture-of-experts backend.

The public API, imported on first use (so that `import moe_modular.reference`, say, loads only what it needs):
configs, the quantization scheme and its scales, the modular kernel and its two interfaces, the layer, and the
workspace cache. PrepareAndFinalize and Experts classes live in moe_modular.prepare_finalize /
moe_modular.experts (moe_modular.registry lists them).
"""
import importlib

_EXPORTS = {
    "Activation": "moe_modular.config",
    "ExpertPlacement": "moe_modular.config",
    "MoEConfig": "moe_modular.config",
    "ParallelConfig": "moe_modular.config",
    "FusedMoE": "moe_modular.fused_moe_layer",
    "RoutingConfig": "moe_modular.fused_moe_layer",
    "ActivationFormat": "moe_modular.interfaces",
    "FusedMoEExpertsModular": "moe_modular.interfaces",
    "FusedMoEPrepareAndFinalizeModular": "moe_modular.interfaces",
    "PrepareResult": "moe_modular.interfaces",
    "FusedMoEModularKernel": "moe_modular.modular_kernel",
    "MoEQuantParams": "moe_modular.quant",
    "QuantConfig": "moe_modular.quant",
    "WorkspaceCache": "moe_modular.workspace",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'moe_modular' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__():
    return sorted(list(globals()) + __all__)
