"""AllGatherReduceScatterPrepareAndFinalize: the gather-family PF over all-gather / reduce-scatter.

Shape legend: T tokens on this rank, Tall tokens of all ranks, K hidden, k topk.
"""
from __future__ import annotations

from typing import Optional

from moe_modular.config import MoEConfig
from moe_modular.prepare_finalize.naive_all2all_prepare_and_finalize import NaiveAll2AllPrepareAndFinalize
from moe_modular.prepare_finalize.ep_common import activation_row_bytes
from moe_modular.wire_bytes import FLOAT32_BYTES, PhaseBytes, RouteCounts


class AllGatherReduceScatterPrepareAndFinalize(NaiveAll2AllPrepareAndFinalize):
    """NaiveAll2AllPrepareAndFinalize's contract and quantization placement, on the
    `allgather_reducescatter` manager: one all-gather of the (padded) token rows in prepare, one
    float32 reduce-scatter of the per-rank partial sums in finalize (instead of W broadcasts and
    an all-reduce). Experts see all ranks' tokens (Tall, K) with LOCAL ids, -1 for routes held
    elsewhere, and are called with expert_map=None."""

    BACKEND = "allgather_reducescatter"

    @classmethod
    def wire_bytes(cls, moe: MoEConfig, counts: RouteCounts, wire, experts_reduce: bool) -> PhaseBytes:
        """All-gather of T rows per rank; reduce-scatter of (W*T, K) float32 partials ((W-1)*T*K per rank)."""
        W, T, K = counts.world_size, counts.tokens_per_rank, moe.hidden_dim
        row = activation_row_bytes(moe, moe.quant.is_quantized and cls.quantizes_before_dispatch(moe.quant))
        return PhaseBytes.of([(W - 1) * T * row] * W, [(W - 1) * T * K * FLOAT32_BYTES] * W)

    @classmethod
    def vllm_all2all_backend(cls) -> Optional[str]:
        return "allgather_reducescatter"
