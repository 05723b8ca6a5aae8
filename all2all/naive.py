"""NaiveAll2AllManager: the simple reference (gather family), broadcasts and one all-reduce.

Shape legend: W world size, T_r rows of rank r, Tall = sum_r T_r, B row width.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from all2all.base import All2AllHandle, All2AllManager, PendingCollective, RowLayout, check_rows


class NaiveAll2AllManager(All2AllManager):
    """Gather family.

    dispatch(rows (T_self, B), layout): every rank broadcasts its rows in turn; returns
      (Tall, B), the ranks' rows concatenated in rank order. layout from gather_counts().
    combine(rows (Tall, B) float, layout): all-reduce (sum) over ranks, in place on `rows`;
      returns this rank's (T_self, B) slice.
    """

    backend_name = "naive"

    def dispatch(self, handle: All2AllHandle, rows_RB: torch.Tensor, layout: RowLayout,
                 async_op: bool = False, tag: str = "rows") -> PendingCollective[torch.Tensor]:
        self._check_alive()
        check_rows(rows_RB, layout.send_counts[self.rank], "NaiveAll2AllManager.dispatch")
        total = layout.num_recv
        out = handle.buffer(f"naive_dispatch:{tag}", (total, rows_RB.size(1)), rows_RB.dtype)
        works, off = [], 0
        for r, n in enumerate(layout.recv_counts):
            part = out[off:off + n]
            if r == self.rank:
                part.copy_(rows_RB)
            if n:
                src = dist.get_global_rank(self.group, r) if self.group is not None else r
                works.append(dist.broadcast(part, src=src, group=self.group, async_op=async_op))
            off += n
        return PendingCollective(works if async_op else [], lambda: out)

    def combine(self, handle: All2AllHandle, rows_RB: torch.Tensor, layout: RowLayout,
                async_op: bool = False, tag: str = "rows") -> PendingCollective[torch.Tensor]:
        self._check_alive()
        check_rows(rows_RB, layout.num_recv, "NaiveAll2AllManager.combine")
        start = sum(layout.recv_counts[: self.rank])
        mine = layout.recv_counts[self.rank]
        work = dist.all_reduce(rows_RB, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)
        return PendingCollective([work] if async_op else [], lambda: rows_RB[start:start + mine])
