"""AllGatherReduceScatterManager: gather family over all-gather and reduce-scatter.

Ranks may hold different row counts; both collectives run on rows padded to P = max_r T_r
(gloo and NCCL have no variable-size reduce-scatter; padding emulates it).

Shape legend: W world size, T_r rows of rank r, Tall = sum_r T_r, P = max_r T_r, B row width.
"""
from __future__ import annotations

import torch

from all2all.base import (
    All2AllHandle,
    All2AllManager,
    PendingCollective,
    RowLayout,
    all_gather_single,
    check_rows,
    reduce_scatter_single,
)


def _padded_index(counts: tuple[int, ...], P: int, device: torch.device) -> torch.Tensor:
    """Positions of the Tall real rows inside the (W*P) padded layout, in rank order."""
    idx = [torch.arange(n, dtype=torch.int64) + r * P for r, n in enumerate(counts)]
    return torch.cat(idx).to(device) if idx else torch.empty(0, dtype=torch.int64, device=device)


class AllGatherReduceScatterManager(All2AllManager):
    """Gather family.

    dispatch(rows (T_self, B), layout): all-gather of rows padded to P; returns (Tall, B), the
      ranks' rows concatenated in rank order. layout from gather_counts().
    combine(rows (Tall, B) float, layout): reduce-scatter (sum) of the rows padded back to
      (W*P, B); returns this rank's (T_self, B) sums.
    """

    backend_name = "allgather_reducescatter"

    def dispatch(self, handle: All2AllHandle, rows_RB: torch.Tensor, layout: RowLayout,
                 async_op: bool = False, tag: str = "rows") -> PendingCollective[torch.Tensor]:
        self._check_alive()
        check_rows(rows_RB, layout.send_counts[self.rank], "AllGatherReduceScatterManager.dispatch")
        counts, W, B = layout.recv_counts, self.world_size, rows_RB.size(1)
        P = max(counts)
        if P == 0:
            return PendingCollective.done(rows_RB.new_empty((0, B)))
        send = handle.buffer(f"agrs_send:{tag}", (P, B), rows_RB.dtype)
        send[: rows_RB.size(0)].copy_(rows_RB)
        send[rows_RB.size(0):].zero_()
        gathered = handle.buffer(f"agrs_gathered:{tag}", (W * P, B), rows_RB.dtype)
        work = all_gather_single(gathered, send, self.group, async_op=async_op)
        index = _padded_index(counts, P, rows_RB.device)
        return PendingCollective([work] if async_op else [], lambda: gathered.index_select(0, index))

    def combine(self, handle: All2AllHandle, rows_RB: torch.Tensor, layout: RowLayout,
                async_op: bool = False, tag: str = "rows") -> PendingCollective[torch.Tensor]:
        self._check_alive()
        check_rows(rows_RB, layout.num_recv, "AllGatherReduceScatterManager.combine")
        counts, W, B = layout.recv_counts, self.world_size, rows_RB.size(1)
        P = max(counts)
        if P == 0:
            return PendingCollective.done(rows_RB.new_empty((0, B)))
        padded = handle.buffer(f"agrs_padded:{tag}", (W * P, B), rows_RB.dtype)
        padded.zero_()
        padded.index_copy_(0, _padded_index(counts, P, rows_RB.device), rows_RB)
        out = handle.buffer(f"agrs_scattered:{tag}", (P, B), rows_RB.dtype)
        work = reduce_scatter_single(out, padded, self.group, async_op=async_op)
        mine = counts[self.rank]
        return PendingCollective([work] if async_op else [], lambda: out[:mine])
