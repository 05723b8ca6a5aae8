"""NcclAllToAllManager: token-level exchange with all_to_all_single and per-step split sizes.

Shape legend: S rows sent (sum of send_counts), R rows received (sum of recv_counts), B row width.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from all2all.base import All2AllHandle, All2AllManager, PendingCollective, RowLayout, check_rows


class NcclAllToAllManager(All2AllManager):
    """Exchange family (runs on NCCL and gloo alike).

    dispatch(rows (S, B), layout): rows grouped by destination rank (layout.send_counts, in rank
      order) -> (R, B) rows grouped by source rank. The layout comes from exchange_counts(), the
      one host sync of a step.
    combine(rows (R, B), layout): the same layout, reversed: rows grouped by the rank they came
      from go back -> (S, B) in the original send order.
    """

    backend_name = "nccl_all_to_all"

    def _exchange(self, handle: All2AllHandle, name: str, rows_RB: torch.Tensor, send_counts, recv_counts,
                  async_op: bool) -> PendingCollective[torch.Tensor]:
        out = handle.buffer(name, (sum(recv_counts), rows_RB.size(1)), rows_RB.dtype)
        work = dist.all_to_all_single(out, rows_RB.contiguous(), output_split_sizes=list(recv_counts),
                                      input_split_sizes=list(send_counts), group=self.group, async_op=async_op)
        return PendingCollective([work] if async_op else [], lambda: out)

    def dispatch(self, handle: All2AllHandle, rows_RB: torch.Tensor, layout: RowLayout,
                 async_op: bool = False, tag: str = "rows") -> PendingCollective[torch.Tensor]:
        self._check_alive()
        check_rows(rows_RB, layout.num_send, "NcclAllToAllManager.dispatch")
        return self._exchange(handle, f"a2a_dispatch:{tag}", rows_RB, layout.send_counts, layout.recv_counts, async_op)

    def combine(self, handle: All2AllHandle, rows_RB: torch.Tensor, layout: RowLayout,
                async_op: bool = False, tag: str = "rows") -> PendingCollective[torch.Tensor]:
        self._check_alive()
        check_rows(rows_RB, layout.num_recv, "NcclAllToAllManager.combine")
        return self._exchange(handle, f"a2a_combine:{tag}", rows_RB, layout.recv_counts, layout.send_counts, async_op)
