"""VllmLayerPlan: what the vLLM plugin decided for one fused-MoE layer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from moe_modular.config import MoEConfig
from moe_modular.interfaces import FusedMoEExpertsModular, FusedMoEPrepareAndFinalizeModular


@dataclass(frozen=True)
class VllmLayerPlan:
    """Either a supported pair or the reason there is none.

    moe: the layer as moe-modular sees it (None when refused).
    backend: the moe-modular all2all backend name ("none" for the single-rank PF).
    prepare_finalize_type / experts_type: the pair the kernel is built from.
    reason: why the layer stays on vLLM's own kernel ("" when supported).
    """

    moe: Optional[MoEConfig] = None
    backend: str = ""
    prepare_finalize_type: Optional[type[FusedMoEPrepareAndFinalizeModular]] = None
    experts_type: Optional[type[FusedMoEExpertsModular]] = None
    reason: str = ""

    def __post_init__(self) -> None:
        complete = self.moe is not None and self.prepare_finalize_type is not None and self.experts_type is not None
        if complete == bool(self.reason):
            raise ValueError(
                f"VllmLayerPlan needs either moe + prepare_finalize_type + experts_type or a reason, got "
                f"moe={self.moe is not None}, prepare_finalize_type={self.prepare_finalize_type}, "
                f"experts_type={self.experts_type}, reason={self.reason!r}"
            )

    @property
    def supported(self) -> bool:
        return not self.reason

    @classmethod
    def refuse(cls, reason: str) -> "VllmLayerPlan":
        return cls(reason=reason)

    def describe(self) -> str:
        if not self.supported:
            return f"vLLM's own kernel ({self.reason})"
        return (f"{self.prepare_finalize_type.__name__} + {self.experts_type.__name__} "
                f"(backend {self.backend!r}, {self.moe.describe()})")
