"""NcclLowLatencyManager: fixed-size slot exchange (static shapes, no host sync, graph-capturable).

Every rank sends exactly S rows to every rank (S fixed by the caller, e.g. local experts x max
tokens per rank); unused slots travel too. Nothing depends on data, so the step can be captured
in a CUDA graph.

Shape legend: W world size, S slots per rank pair, B row width.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from all2all.base import All2AllHandle, All2AllManager, PendingCollective, RowLayout, check_rows


class NcclLowLatencyManager(All2AllManager):
    """Exchange family with equal splits.

    dispatch(rows (W*S, B), static_layout(S)): slot block r goes to rank r -> (W*S, B), block s
      from rank s. combine: the same exchange in reverse (it is its own inverse).
    """

    backend_name = "nccl_low_latency"

    def static_layout(self, slots_per_rank: int) -> RowLayout:
        """The layout of a step that moves `slots_per_rank` rows between every pair of ranks (no communication)."""
        if not isinstance(slots_per_rank, int) or slots_per_rank < 1:
            raise ValueError(f"slots_per_rank ({slots_per_rank!r}) must be an int >= 1")
        counts = (slots_per_rank,) * self.world_size
        return RowLayout(counts, counts)

    def _exchange(self, handle: All2AllHandle, name: str, rows_RB: torch.Tensor, layout: RowLayout,
                  async_op: bool) -> PendingCollective[torch.Tensor]:
        self._check_alive()
        if len(set(layout.send_counts + layout.recv_counts)) != 1:
            raise ValueError(
                f"NcclLowLatencyManager needs equal slot counts for every rank, got {layout}; use static_layout()"
            )
        check_rows(rows_RB, layout.num_send, f"NcclLowLatencyManager {name}")
        out = handle.buffer(name, tuple(rows_RB.shape), rows_RB.dtype)
        work = dist.all_to_all_single(out, rows_RB.contiguous(), group=self.group, async_op=async_op)
        return PendingCollective([work] if async_op else [], lambda: out)

    def dispatch(self, handle: All2AllHandle, rows_RB: torch.Tensor, layout: RowLayout,
                 async_op: bool = False, tag: str = "rows") -> PendingCollective[torch.Tensor]:
        return self._exchange(handle, f"ll_dispatch:{tag}", rows_RB, layout, async_op)

    def combine(self, handle: All2AllHandle, rows_RB: torch.Tensor, layout: RowLayout,
                async_op: bool = False, tag: str = "rows") -> PendingCollective[torch.Tensor]:
        return self._exchange(handle, f"ll_combine:{tag}", rows_RB, layout, async_op)
