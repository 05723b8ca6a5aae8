"""The registry of the package's PrepareAndFinalize and Experts classes, and the choices derived from it:
which PrepareAndFinalize serves an all2all backend, and which experts serve an activation format (in order of
preference, fastest first). Every choice is confirmed by the class's own supports(); a refusal lists every
candidate's reason. The combinations matrix (moe_modular/testing/mk_objects.py) runs every class listed
here: adding a type is one entry in PREPARE_FINALIZE_TYPES or EXPERTS_TYPES."""
from __future__ import annotations

from types import MappingProxyType

from moe_modular.config import MoEConfig
from moe_modular.experts.batched_triton_experts import BatchedTritonExperts
from moe_modular.experts.grouped_mm_experts import GroupedMMExperts
from moe_modular.experts.naive_batched_experts import NaiveBatchedExperts
from moe_modular.experts.torch_experts import TorchExperts
from moe_modular.experts.triton_experts import TritonExperts
from moe_modular.interfaces import ActivationFormat, FusedMoEExpertsModular, FusedMoEPrepareAndFinalizeModular
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

NO_EP_BACKEND = "none"

# Every PrepareAndFinalize class of the package. Those with a BACKEND drive that all2all backend
# (all2all.base.ALL2ALL_BACKENDS); BatchedPrepareAndFinalize (single device, batched format) and
# SliceAllGatherPrepareAndFinalize (a collective-only PF over the EP group) are chosen by name only.
PREPARE_FINALIZE_TYPES: tuple[type[FusedMoEPrepareAndFinalizeModular], ...] = (
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
)
# Every Experts class of the package.
EXPERTS_TYPES: tuple[type[FusedMoEExpertsModular], ...] = (
    TorchExperts,
    NaiveBatchedExperts,
    TritonExperts,
    BatchedTritonExperts,
    GroupedMMExperts,
)

# all2all backend name (all2all.base.ALL2ALL_BACKENDS) -> the PF that drives it.
PREPARE_FINALIZE_BY_BACKEND: "MappingProxyType[str, type[FusedMoEPrepareAndFinalizeModular]]" = MappingProxyType({
    NO_EP_BACKEND: MoEPrepareAndFinalizeNoEP,
    **{cls.BACKEND: cls for cls in PREPARE_FINALIZE_TYPES if getattr(cls, "BACKEND", None)},
})

# Keyed by (format, device type). On the CPU the torch experts come first: Triton runs there only
# through its interpreter, which is for tests.
EXPERTS_BY_FORMAT: "MappingProxyType[tuple[ActivationFormat, str], tuple[type[FusedMoEExpertsModular], ...]]" = (
    MappingProxyType({
        (ActivationFormat.Standard, "cuda"): (TritonExperts, TorchExperts),
        (ActivationFormat.BatchedExperts, "cuda"): (BatchedTritonExperts, NaiveBatchedExperts),
        (ActivationFormat.Standard, "cpu"): (TorchExperts,),
        (ActivationFormat.BatchedExperts, "cpu"): (NaiveBatchedExperts,),
    }))


def prepare_finalize_type(backend: str) -> type[FusedMoEPrepareAndFinalizeModular]:
    try:
        return PREPARE_FINALIZE_BY_BACKEND[backend]
    except KeyError:
        raise ValueError(
            f"all2all backend ({backend!r}) has no PrepareAndFinalize; valid: {sorted(PREPARE_FINALIZE_BY_BACKEND)}"
        ) from None


def select_experts_type(fmt: ActivationFormat, moe: MoEConfig, device_type: str = "cpu") -> type[FusedMoEExpertsModular]:
    """The first experts class for (`fmt`, `device_type`) that supports `moe`."""
    key = (fmt, device_type)
    if key not in EXPERTS_BY_FORMAT:
        devices = sorted({d for _, d in EXPERTS_BY_FORMAT})
        raise ValueError(f"device type ({device_type!r}) has no experts; valid: {devices}")
    reasons = []
    for cls in EXPERTS_BY_FORMAT[key]:
        ok, reason = cls.supports(moe)
        if ok:
            return cls
        reasons.append(f"{cls.__name__}: {reason}")
    raise ValueError(f"no experts class supports {moe.describe()} in the {fmt.value} format: " + "; ".join(reasons))
