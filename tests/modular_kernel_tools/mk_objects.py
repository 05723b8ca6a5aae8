"""The combinations matrix's registries. Adding a type is one line here; capabilities
(formats, dtypes, schemes, world sizes) are read from the classes' own `supports()`."""
from __future__ import annotations

import torch

from moe_modular.experts.batched_triton_experts import BatchedTritonExperts
from moe_modular.experts.grouped_mm_experts import GroupedMMExperts
from moe_modular.experts.naive_batched_experts import NaiveBatchedExperts
from moe_modular.experts.torch_experts import TorchExperts
from moe_modular.experts.triton_experts import TritonExperts
from moe_modular.interfaces import FusedMoEExpertsModular, FusedMoEPrepareAndFinalizeModular
from moe_modular.prepare_finalize.all_to_all_prepare_and_finalize import AllToAllPrepareAndFinalize
from moe_modular.prepare_finalize.allgather_reducescatter_prepare_and_finalize import (
    AllGatherReduceScatterPrepareAndFinalize,
)
from moe_modular.prepare_finalize.batched import BatchedPrepareAndFinalize
from moe_modular.prepare_finalize.deepep_ht_prepare_and_finalize import DeepEPHTPrepareAndFinalize
from moe_modular.prepare_finalize.deepep_ll_prepare_and_finalize import DeepEPLLPrepareAndFinalize
from moe_modular.prepare_finalize.low_latency_all2all_prepare_and_finalize import LowLatencyAll2AllPrepareAndFinalize
from moe_modular.prepare_finalize.naive_all2all_prepare_and_finalize import NaiveAll2AllPrepareAndFinalize
from moe_modular.prepare_finalize.no_ep import MoEPrepareAndFinalizeNoEP
from moe_modular.prepare_finalize.slice_allgather_prepare_and_finalize import SliceAllGatherPrepareAndFinalize
from moe_modular.prepare_finalize.symm_mem_prepare_and_finalize import SymmMemPrepareAndFinalize
from moe_modular.quant import QuantConfig

MK_ALL_PREPARE_FINALIZE_TYPES: list[type[FusedMoEPrepareAndFinalizeModular]] = [
    MoEPrepareAndFinalizeNoEP,
    BatchedPrepareAndFinalize,
    NaiveAll2AllPrepareAndFinalize,
    AllGatherReduceScatterPrepareAndFinalize,
    AllToAllPrepareAndFinalize,
    LowLatencyAll2AllPrepareAndFinalize,
    SliceAllGatherPrepareAndFinalize,
    DeepEPHTPrepareAndFinalize,
    DeepEPLLPrepareAndFinalize,
    SymmMemPrepareAndFinalize,
]

MK_FUSED_EXPERT_TYPES: list[type[FusedMoEExpertsModular]] = [
    TorchExperts,
    NaiveBatchedExperts,
    TritonExperts,
    BatchedTritonExperts,
    GroupedMMExperts,
]

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
