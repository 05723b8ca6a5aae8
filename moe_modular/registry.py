"""Constant registries: which PrepareAndFinalize serves an all2all backend, and which experts
serve an activation format (in order of preference, fastest first). Every choice is confirmed
by the class's own supports(); a refusal lists every candidate's reason."""
from __future__ import annotations

from types import MappingProxyType

from moe_modular.config import MoEConfig
from moe_modular.experts.naive_batched_experts import NaiveBatchedExperts
from moe_modular.experts.torch_experts import TorchExperts
from moe_modular.interfaces import ActivationFormat, FusedMoEExpertsModular, FusedMoEPrepareAndFinalizeModular
from moe_modular.prepare_finalize.no_ep import MoEPrepareAndFinalizeNoEP

NO_EP_BACKEND = "none"

PREPARE_FINALIZE_BY_BACKEND: "MappingProxyType[str, type[FusedMoEPrepareAndFinalizeModular]]" = MappingProxyType({
    NO_EP_BACKEND: MoEPrepareAndFinalizeNoEP,
})

EXPERTS_BY_FORMAT: "MappingProxyType[ActivationFormat, tuple[type[FusedMoEExpertsModular], ...]]" = MappingProxyType({
    ActivationFormat.Standard: (TorchExperts,),
    ActivationFormat.BatchedExperts: (NaiveBatchedExperts,),
})


def prepare_finalize_type(backend: str) -> type[FusedMoEPrepareAndFinalizeModular]:
    try:
        return PREPARE_FINALIZE_BY_BACKEND[backend]
    except KeyError:
        raise ValueError(
            f"all2all backend ({backend!r}) has no PrepareAndFinalize; valid: {sorted(PREPARE_FINALIZE_BY_BACKEND)}"
        ) from None


def select_experts_type(fmt: ActivationFormat, moe: MoEConfig) -> type[FusedMoEExpertsModular]:
    """The first experts class for `fmt` that supports `moe`."""
    reasons = []
    for cls in EXPERTS_BY_FORMAT[fmt]:
        ok, reason = cls.supports(moe)
        if ok:
            return cls
        reasons.append(f"{cls.__name__}: {reason}")
    raise ValueError(f"no experts class supports {moe.describe()} in the {fmt.value} format: " + "; ".join(reasons))
