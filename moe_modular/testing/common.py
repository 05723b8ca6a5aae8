"""Config: one cell of the combinations matrix (a PF type x an experts type x a scheme), its
shapes, and the predicates that decide whether it can run. Every answer comes from the classes."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from moe_modular.config import Activation, ExpertPlacement, MoEConfig, ParallelConfig, dtype_name
from moe_modular.interfaces import ActivationFormat, FusedMoEExpertsModular, FusedMoEPrepareAndFinalizeModular
from moe_modular.quant import QuantConfig, QuantDtype

# Tolerance on ||out - ref|| / ||ref|| against the float32 oracle, from the narrowest number
# format on the path. 16-bit: 2 x machine epsilon (inputs, intermediate and output are rounded
# once each). fp8: the oracle models the quantization itself, so what remains is intermediate values
# whose fp8 rounding flips between the kernel and the oracle: almost none with exact float32
# accumulation (1.6e-3 - 2.4e-3 on the H200, mostly the bf16 output), about 1% with Hopper's
# reduced-precision fp8 accumulation in 64-row tiles (1.0e-2 - 1.2e-2 at K = 2048 there); a quarter
# of e4m3's epsilon, 3.1e-2, holds both. fp32: accumulation order only.
_TOLERANCE_BY_DTYPE = {
    torch.float32: 1e-4,
    torch.float16: 2 * torch.finfo(torch.float16).eps,
    torch.bfloat16: 2 * torch.finfo(torch.bfloat16).eps,
}
_FP8_TOLERANCE = torch.finfo(torch.float8_e4m3fn).eps / 4


def tolerance(dtype: torch.dtype, quant: QuantConfig) -> float:
    if quant.quant_dtype is QuantDtype.FP8_E4M3:
        return _FP8_TOLERANCE
    return _TOLERANCE_BY_DTYPE[dtype]


@dataclass(frozen=True)
class Config:
    """One matrix cell and its problem sizes (per rank: Ms tokens on every rank)."""

    Ms: tuple[int, ...]
    K: int
    N: int
    E: int
    topks: tuple[int, ...]
    dtype: torch.dtype
    quant: QuantConfig
    prepare_finalize_type: type[FusedMoEPrepareAndFinalizeModular]
    fused_experts_type: type[FusedMoEExpertsModular]
    world_size: int = 1
    placement: ExpertPlacement = ExpertPlacement.LINEAR
    activation: Activation = Activation.SILU

    # ---- the problem ------------------------------------------------------------------
    def moe_config(self, topk: int, rank: int = 0) -> MoEConfig:
        return MoEConfig(
            num_experts=self.E,
            topk=topk,
            hidden_dim=self.K,
            intermediate_dim=self.N,
            dtype=self.dtype,
            quant=self.quant,
            parallel=ParallelConfig(ep_size=self.world_size, ep_rank=rank, placement=self.placement),
            activation=self.activation,
            max_num_tokens=max(max(self.Ms), 1),
        )

    def describe(self) -> str:
        return (f"{self.prepare_finalize_type.__name__} x {self.fused_experts_type.__name__} "
                f"{dtype_name(self.dtype)}/{self.quant.name} ws={self.world_size}")

    # ---- predicates ---------------------------------------------------------------------
    def is_batched_prepare_finalize(self) -> bool:
        return self.prepare_finalize_type.activation_format() is ActivationFormat.BatchedExperts

    def is_batched_fused_experts(self) -> bool:
        return self.fused_experts_type.activation_formats()[0] is ActivationFormat.BatchedExperts

    def is_standard_fused_experts(self) -> bool:
        return self.fused_experts_type.activation_formats()[0] is ActivationFormat.Standard

    def _fe_supports(self, dtype: torch.dtype, quant: QuantConfig) -> bool:
        probe = replace(self, dtype=dtype, quant=quant)
        return self.fused_experts_type.supports(probe.moe_config(min(self.topks)))[0]

    def is_fe_16bit_supported(self) -> bool:
        return any(self._fe_supports(d, QuantConfig()) for d in (torch.bfloat16, torch.float16))

    def is_fe_fp8_supported(self) -> bool:
        return self._fe_supports(torch.bfloat16, QuantConfig.fp8_per_tensor())

    def is_fe_block_fp8_supported(self) -> bool:
        return self._fe_supports(torch.bfloat16, QuantConfig.fp8_block((128, 128)))

    def is_valid(self) -> tuple[bool, str]:
        """(True, "") when the pair composes and both classes support every topk of this cell."""
        if self.is_batched_prepare_finalize() != self.is_batched_fused_experts():
            pf_fmt = self.prepare_finalize_type.activation_format().value
            fe_fmt = self.fused_experts_type.activation_formats()[0].value
            return False, f"format mismatch: prepare/finalize gives {pf_fmt}, experts take {fe_fmt}"
        for topk in self.topks:
            try:
                moe = self.moe_config(topk)
            except ValueError as exc:
                return False, str(exc)
            for kind, cls in (("prepare/finalize", self.prepare_finalize_type), ("experts", self.fused_experts_type)):
                ok, reason = cls.supports(moe)
                if not ok:
                    return False, f"{kind} {cls.__name__}: {reason}"
        return True, ""
