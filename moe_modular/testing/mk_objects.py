"""The combinations matrix's registries: the package's classes (moe_modular.registry, where adding a type is
one line) and the schemes the matrix runs; capabilities (formats, dtypes, schemes, world sizes) are read from
the classes' own `supports()`."""
from __future__ import annotations

import torch

from moe_modular import registry
from moe_modular.interfaces import FusedMoEExpertsModular, FusedMoEPrepareAndFinalizeModular
from moe_modular.quant import QuantConfig

# The package's registry (moe_modular/registry.py): the matrix runs every class registered there.
MK_ALL_PREPARE_FINALIZE_TYPES: list[type[FusedMoEPrepareAndFinalizeModular]] = list(registry.PREPARE_FINALIZE_TYPES)
MK_FUSED_EXPERT_TYPES: list[type[FusedMoEExpertsModular]] = list(registry.EXPERTS_TYPES)

# (activation dtype, scheme) pairs the matrix runs: every 16/32-bit dtype unquantized, and each
# fp8 scheme with bf16 activations.
MK_QUANT_CONFIGS: list[tuple[torch.dtype, QuantConfig]] = [
    (torch.bfloat16, QuantConfig.unquantized()),
    (torch.float16, QuantConfig.unquantized()),
    (torch.float32, QuantConfig.unquantized()),
    (torch.bfloat16, QuantConfig.fp8_per_tensor()),
    (torch.bfloat16, QuantConfig.fp8_per_tensor(static=True)),
    (torch.bfloat16, QuantConfig.fp8_per_token()),
    (torch.bfloat16, QuantConfig.fp8_block((128, 128))),
]


def _by_name(types: list[type]) -> dict[str, type]:
    return {t.__name__: t for t in types}


PREPARE_FINALIZE_BY_NAME: dict[str, type[FusedMoEPrepareAndFinalizeModular]] = _by_name(MK_ALL_PREPARE_FINALIZE_TYPES)
FUSED_EXPERTS_BY_NAME: dict[str, type[FusedMoEExpertsModular]] = _by_name(MK_FUSED_EXPERT_TYPES)


def lookup(registry: dict[str, type], name: str, field: str) -> type:
    """The registered type called `name`, or a ValueError listing the valid names."""
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"{field} ({name!r}) is not registered; valid: {', '.join(sorted(registry))}") from None
