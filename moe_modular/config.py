"""Frozen configuration objects: MoEConfig (the problem) and ParallelConfig (the EP layout)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
import torch

from moe_modular.quant import QuantConfig

SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Activation(enum.Enum):
    """Gated activation applied between the two GEMMs; w1 holds [gate; up] stacked (2N rows).

    SILU / GELU: out = act(gate) * up with gate = x[:, :N], up = x[:, N:].
    SWIGLU_OAI: gpt-oss style, gate/up interleaved (gate = x[:, 0::2], up = x[:, 1::2]),
      gate clamped above at limit, up clamped to [-limit, limit], out = (up + 1) * gate * sigmoid(alpha * gate).
    """

    SILU = "silu"
    GELU = "gelu"
    SWIGLU_OAI = "swigluoai"

    @classmethod
    def parse(cls, name: "str | Activation") -> "Activation":
        if isinstance(name, cls):
            return name
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"activation ({name!r}) must be one of {[a.value for a in cls]}") from None


class ExpertPlacement(enum.Enum):
    """How global experts are spread over EP ranks."""

    LINEAR = "linear"  # rank r owns experts [r*E/ep, (r+1)*E/ep)
    ROUND_ROBIN = "round_robin"  # rank r owns experts r, r+ep, r+2*ep, ...


@dataclass(frozen=True)
class ParallelConfig:
    """Expert-parallel layout of one process: ep_size ranks, this one is ep_rank."""

    ep_size: int = 1
    ep_rank: int = 0
    placement: ExpertPlacement = ExpertPlacement.LINEAR

    def __post_init__(self) -> None:
        if not isinstance(self.ep_size, int) or self.ep_size < 1:
            raise ValueError(f"ParallelConfig.ep_size ({self.ep_size!r}) must be an int >= 1")
        if not isinstance(self.ep_rank, int) or not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ParallelConfig.ep_rank ({self.ep_rank!r}) must be in [0, ep_size={self.ep_size})")
        if not isinstance(self.placement, ExpertPlacement):
            raise TypeError(
                f"ParallelConfig.placement ({self.placement!r}) must be one of {[p.value for p in ExpertPlacement]}"
            )

    @property
    def use_ep(self) -> bool:
        return self.ep_size > 1


@dataclass(frozen=True)
class MoEConfig:
    """The MoE problem one layer solves.

    num_experts: global expert count E.  topk: experts per token.
    hidden_dim: K (model hidden size).   intermediate_dim: N (w1 is (E, 2N, K), w2 is (E, K, N)).
    dtype: activation dtype (bf16 / fp16 / fp32).
    max_num_tokens: the most tokens one rank passes to a forward (sizes batched buffers and chunks).
    """

    num_experts: int
    topk: int
    hidden_dim: int
    intermediate_dim: int
    dtype: torch.dtype = torch.bfloat16
    quant: QuantConfig = field(default_factory=QuantConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    activation: Activation = Activation.SILU
    max_num_tokens: int = 256

    def __post_init__(self) -> None:
        if isinstance(self.activation, str):  # the activation's name is accepted as well as the enum
            object.__setattr__(self, "activation", Activation.parse(self.activation))
        for name in ("num_experts", "topk", "hidden_dim", "intermediate_dim", "max_num_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"MoEConfig.{name} ({v!r}) must be an int >= 1")
        if self.topk > self.num_experts:
            raise ValueError(f"MoEConfig.topk ({self.topk}) must be <= num_experts ({self.num_experts})")
        if self.dtype not in SUPPORTED_DTYPES.values():
            raise ValueError(f"MoEConfig.dtype ({self.dtype}) must be one of {list(SUPPORTED_DTYPES)}")
        if not isinstance(self.quant, QuantConfig):
            raise TypeError(f"MoEConfig.quant ({self.quant!r}) must be a QuantConfig")
        if not isinstance(self.parallel, ParallelConfig):
            raise TypeError(f"MoEConfig.parallel ({self.parallel!r}) must be a ParallelConfig")
        if not isinstance(self.activation, Activation):
            raise TypeError(f"MoEConfig.activation ({self.activation!r}) must be an Activation or one of the names "
                            f"{[a.value for a in Activation]}")
        if self.num_experts % self.parallel.ep_size != 0:
            raise ValueError(
                f"num_experts ({self.num_experts}) must be divisible by ep_size ({self.parallel.ep_size})"
            )

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.parallel.ep_size

    @property
    def ep_size(self) -> int:
        return self.parallel.ep_size

    @property
    def ep_rank(self) -> int:
        return self.parallel.ep_rank

    def describe(self) -> str:
        return (
            f"E={self.num_experts} topk={self.topk} K={self.hidden_dim} N={self.intermediate_dim} "
            f"dtype={dtype_name(self.dtype)} quant={self.quant.name} ep={self.ep_size}"
        )
