"""What a PrepareAndFinalize sends between ranks: the counts of one routing and the bytes per phase.

Each EP PF answers `wire_bytes(moe, counts, wire, experts_reduce)` (a classmethod of the PF interface) with
the bytes every rank sends to the other ranks in its dispatch and its combine; tools/benchmark_ep.py divides
them by the measured time. Bytes a rank keeps for itself are not counted.

Shape legend: W ranks, T tokens per rank, K hidden, k topk, El local experts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from moe_modular.fp8_format import FP8_DTYPE

FLOAT32_BYTES = 4


@dataclass(frozen=True)
class RouteCounts:
    """Who sends what to whom under one routing. W ranks with T tokens each.

    pairs[s][d]: tokens of rank s with at least one expert on rank d (token-level dispatch sends each
    such token once). routes[s][d]: (token, expert) routes of rank s whose expert is on rank d.
    """

    world_size: int
    tokens_per_rank: int
    pairs: tuple[tuple[int, ...], ...]
    routes: tuple[tuple[int, ...], ...]

    @classmethod
    def from_owners(cls, owner_WTk: torch.Tensor) -> "RouteCounts":
        """owner_WTk (W, T, k) int: the rank holding each route's expert (-1: no expert)."""
        W, T, _ = owner_WTk.shape
        pairs, routes = [], []
        for s in range(W):
            hit_WTk = owner_WTk[s].unsqueeze(0) == torch.arange(W).view(W, 1, 1)
            pairs.append(tuple(int(v) for v in hit_WTk.any(dim=2).sum(dim=1).tolist()))
            routes.append(tuple(int(v) for v in hit_WTk.sum(dim=(1, 2)).tolist()))
        return cls(W, T, tuple(pairs), tuple(routes))

    def sent(self, table: tuple[tuple[int, ...], ...]) -> list[int]:
        """Per rank s: sum over the other ranks d of table[s][d] (what s sends away)."""
        return [sum(n for d, n in enumerate(table[s]) if d != s) for s in range(self.world_size)]

    def returned(self, table: tuple[tuple[int, ...], ...]) -> list[int]:
        """Per rank s: sum over the other ranks d of table[d][s] (what s sends back to the senders)."""
        return [sum(table[d][s] for d in range(self.world_size) if d != s) for s in range(self.world_size)]


@dataclass(frozen=True)
class PhaseBytes:
    """Bytes each rank sends to other ranks in the dispatch and in the combine, (W,) each."""

    dispatch: tuple[int, ...]
    combine: tuple[int, ...]

    @classmethod
    def of(cls, dispatch: Sequence[int], combine: Sequence[int]) -> "PhaseBytes":
        return cls(tuple(int(v) for v in dispatch), tuple(int(v) for v in combine))


def token_row_bytes(hidden: int, fp8: bool, dtype: torch.dtype, scale_elems: int) -> int:
    """One dispatched token: hidden elements (1 byte in fp8, else dtype's size) + float32 scales."""
    return hidden * (FP8_DTYPE.itemsize if fp8 else dtype.itemsize) + scale_elems * FLOAT32_BYTES
