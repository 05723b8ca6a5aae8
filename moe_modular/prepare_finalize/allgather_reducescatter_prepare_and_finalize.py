"""AllGatherReduceScatterPrepareAndFinalize: the gather-family PF over all-gather / reduce-scatter.

Shape legend: T tokens on this rank, Tall tokens of all ranks, K hidden, k topk.
"""
from __future__ import annotations

from typing import Optional

from moe_modular.prepare_finalize.naive_all2all_prepare_and_finalize import NaiveAll2AllPrepareAndFinalize


class AllGatherReduceScatterPrepareAndFinalize(NaiveAll2AllPrepareAndFinalize):
    """NaiveAll2AllPrepareAndFinalize's contract and quantization placement, on the
    `allgather_reducescatter` manager: one all-gather of the (padded) token rows in prepare, one
    float32 reduce-scatter of the per-rank partial sums in finalize (instead of W broadcasts and
    an all-reduce). Experts see all ranks' tokens (Tall, K) with LOCAL ids, -1 for routes held
    elsewhere, and are called with expert_map=None."""

    BACKEND = "allgather_reducescatter"
    COMBINE_PARTIAL_SENDS = 1  # a reduce-scatter sends (W-1) * T * K of the partial sums per rank

    @classmethod
    def vllm_all2all_backend(cls) -> Optional[str]:
        return "allgather_reducescatter"
