"""CombineWire: how expert results travel back to the token's rank in AllToAllPrepareAndFinalize.

  per_route        one row per (token, expert) route, unweighted, in the experts' output dtype;
                   the token's rank weights and sums them in float32. Rows: T * topk.
  prereduced       the expert rank sums the routes of a token it holds in float32 (weights applied)
                   and sends one bf16 row per (token, destination rank). Rows: <= T * world_size.
  prereduced_hilo  the same float32 sum sent as two bf16 rows, hi = bf16(s) and
                   lo = bf16(s - hi), so hi + lo carries about 16 significant bits.

The default wire depends on the activation dtype (DEFAULT_WIRE_BY_DTYPE) so the combine is never
coarser than the output: prereduced for bf16, prereduced_hilo for fp16 (11 significant bits,
below hi+lo's ~16), per_route for float32 (exact: rows travel in float32).

Every wire sums in a fixed order into dense buffers (no atomics): results are deterministic.
Shape legend: R rows, K hidden.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import torch


@dataclass(frozen=True)
class CombineWire:
    """name: registry key. per_route: rows are unreduced routes (else one reduced sum per token and
    rank). rows_per_entry: wire rows per route (per_route) or per (token, rank) sum."""

    name: str
    per_route: bool
    rows_per_entry: int

    def encode(self, x_RK: torch.Tensor) -> torch.Tensor:
        """(R, K) expert results -> (R, rows_per_entry * K) wire tensor."""
        if self.per_route:
            return x_RK
        xf = x_RK.float()
        hi = xf.to(torch.bfloat16)
        if self.rows_per_entry == 1:
            return hi
        lo = (xf - hi.float()).to(torch.bfloat16)
        return torch.cat([hi, lo], dim=1)

    def decode(self, wire_RX: torch.Tensor, K: int) -> torch.Tensor:
        """Inverse of encode, float32 (R, K)."""
        if self.rows_per_entry == 1:
            return wire_RX.float()
        return wire_RX[:, :K].float() + wire_RX[:, K:].float()


COMBINE_WIRES: Mapping[str, CombineWire] = MappingProxyType({
    "per_route": CombineWire("per_route", per_route=True, rows_per_entry=1),
    "prereduced": CombineWire("prereduced", per_route=False, rows_per_entry=1),
    "prereduced_hilo": CombineWire("prereduced_hilo", per_route=False, rows_per_entry=2),
})


def combine_wire(name: str) -> CombineWire:
    """The wire registered as `name`; an unknown name lists the three."""
    try:
        return COMBINE_WIRES[name]
    except KeyError:
        raise ValueError(f"combine wire ({name!r}) must be one of {list(COMBINE_WIRES)}") from None


DEFAULT_WIRE_BY_DTYPE: Mapping[torch.dtype, str] = MappingProxyType({
    torch.bfloat16: "prereduced",
    torch.float16: "prereduced_hilo",
    torch.float32: "per_route",
})


def default_combine_wire(dtype: torch.dtype) -> CombineWire:
    """The wire used when none is named, for activations of `dtype`."""
    try:
        return COMBINE_WIRES[DEFAULT_WIRE_BY_DTYPE[dtype]]
    except KeyError:
        raise ValueError(f"activation dtype ({dtype}) has no default combine wire; one of {list(DEFAULT_WIRE_BY_DTYPE)}") from None
