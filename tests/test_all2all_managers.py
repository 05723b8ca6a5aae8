"""All2All managers on gloo: the gather and exchange semantics with uneven and zero row counts,
async completion, fp8 rows as bytes, handle caching and idempotent destroy, the registry.

Shape legend: W world size, R rows, B row width.
"""
from __future__ import annotations

import zlib

import pytest
import torch

from all2all.base import (
    ALL2ALL_BACKENDS,
    All2AllHandleConfig,
    RowLayout,
    available_backend_names,
    resolve_backend,
)
from all2all.rows import RowField, RowFormat
from moe_modular.parallel_context import ParallelContext
from moe_modular.quant import FP8_DTYPE
from moe_modular.testing.parallel_utils import parallel_launch

OWN_BACKENDS = ("naive", "allgather_reducescatter", "nccl_all_to_all", "nccl_low_latency")
GATHER_FAMILY = ("naive", "allgather_reducescatter")
LAUNCH_TIMEOUT_S = 180.0


def _rows(seed: int, R: int, B: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(R, B, generator=g)


# Row counts per rank for the gather family, as data: each list covers an edge.
GATHER_COUNTS = [
    lambda W: [3] * W,  # equal counts
    lambda W: [r % 3 for r in range(W)],  # rank 0 has no rows, uneven
    lambda W: [0] * W,  # nobody has rows
    lambda W: [1] + [0] * (W - 1),  # a single row on one rank
]


def _check_gather_family(pgi, context: ParallelContext, name: str, seed: int, B: int = 5) -> None:
    W, rank = pgi.world_size, pgi.rank
    mgr = context.all2all(name)
    handle = mgr.get_handle(All2AllHandleConfig(8, B * 4, 4, 2))
    for ci, counts_fn in enumerate(GATHER_COUNTS):
        counts = counts_fn(W)
        per_rank = [_rows(seed + 100 * ci + r, counts[r], B) for r in range(W)]
        layout = mgr.gather_counts(counts[rank])
        assert layout.recv_counts == tuple(counts), (name, layout, counts)
        for async_op in (False, True):
            got = mgr.dispatch(handle, per_rank[rank], layout, async_op=async_op).wait()
            assert torch.equal(got, torch.cat(per_rank)), f"{name} dispatch counts={counts} async={async_op}"
            # combine: rank r contributes partials_r (Tall, B); every rank gets the sum of its own rows.
            partials = [_rows(seed + 1000 + 100 * ci + r, sum(counts), B) for r in range(W)]
            mine = mgr.combine(handle, partials[rank].clone(), layout, async_op=async_op).wait()
            start = sum(counts[:rank])
            expect = sum(p[start:start + counts[rank]].double() for p in partials).float()
            assert mine.shape == (counts[rank], B)
            torch.testing.assert_close(mine, expect, rtol=1e-6, atol=1e-6,
                                       msg=f"{name} combine counts={counts} async={async_op}")


def _send_matrix(W: int, seed: int) -> list[list[int]]:
    """C[s][d] rows rank s sends to rank d: random in [0, 3], so some pairs send nothing."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4, (W, W), generator=g).tolist()


def _check_exchange(pgi, context: ParallelContext, seed: int, B: int = 3) -> None:
    W, rank = pgi.world_size, pgi.rank
    mgr = context.all2all("nccl_all_to_all")
    handle = mgr.get_handle(All2AllHandleConfig(8, B * 4, 4, 2))
    for trial, C in enumerate([_send_matrix(W, seed + t) for t in range(3)] + [[[0] * W for _ in range(W)]]):
        # rows rank s sends to d, row i: value s*10000 + d*100 + i in every column
        def block(s, d):
            return (torch.arange(C[s][d], dtype=torch.float32) + s * 10000 + d * 100).unsqueeze(1).repeat(1, B)

        send = torch.cat([block(rank, d) for d in range(W)])
        layout = mgr.exchange_counts(torch.tensor(C[rank]))
        assert layout.send_counts == tuple(C[rank]) and layout.recv_counts == tuple(C[s][rank] for s in range(W))
        got = mgr.dispatch(handle, send, layout, async_op=bool(trial % 2)).wait()
        assert torch.equal(got, torch.cat([block(s, rank) for s in range(W)])), f"dispatch C={C}"
        back = mgr.combine(handle, got * 2, layout, async_op=not trial % 2).wait()
        assert torch.equal(back, send * 2), f"combine C={C}"


def _check_low_latency(pgi, context: ParallelContext, seed: int) -> None:
    W, rank = pgi.world_size, pgi.rank
    mgr = context.all2all("nccl_low_latency")
    S, B = 3, 2
    handle = mgr.get_handle(All2AllHandleConfig(S, B, 4, 1))
    layout = mgr.static_layout(S)
    send = torch.stack([torch.full((S, B), rank * 10 + d, dtype=torch.int32) for d in range(W)]).view(W * S, B)
    got = mgr.dispatch(handle, send, layout, async_op=True).wait()
    expect = torch.stack([torch.full((S, B), s * 10 + rank, dtype=torch.int32) for s in range(W)]).view(W * S, B)
    assert torch.equal(got, expect)
    assert torch.equal(mgr.combine(handle, got.clone(), layout).wait(), send)
    with pytest.raises(ValueError, match="equal slot counts"):
        mgr.dispatch(handle, send[:1], RowLayout((1,) + (0,) * (W - 1), (1,) + (0,) * (W - 1)))


def _check_fp8_rows(pgi, context: ParallelContext, seed: int) -> None:
    """fp8 + float32 + int32 fields packed as bytes survive an exchange on gloo."""
    W, rank = pgi.world_size, pgi.rank
    fmt = RowFormat((RowField("x", FP8_DTYPE, 5), RowField("scale", torch.float32, 2), RowField("ids", torch.int32, 3)))
    g = torch.Generator().manual_seed(seed + rank)
    R = 2 * W
    x = (torch.randn(R, 5, generator=g) * 10).to(FP8_DTYPE)
    scale = torch.rand(R, 2, generator=g)
    ids = torch.randint(-1, 50, (R, 3), generator=g, dtype=torch.int32)
    mgr = context.all2all("nccl_all_to_all")
    handle = mgr.get_handle(All2AllHandleConfig(R, fmt.row_bytes, 4, 3))
    layout = mgr.exchange_counts(torch.full((W,), 2))
    got = mgr.dispatch(handle, fmt.pack([x, scale, ids]), layout).wait()
    back = fmt.unpack(mgr.combine(handle, got, layout).wait())
    assert back["x"].dtype == FP8_DTYPE
    assert torch.equal(back["x"].view(torch.uint8), x.view(torch.uint8))
    assert torch.equal(back["scale"], scale) and torch.equal(back["ids"], ids)


def _check_handles_and_destroy(pgi, context: ParallelContext) -> None:
    mgr = context.all2all("nccl_all_to_all")
    assert context.all2all("nccl_all_to_all") is mgr, "the context must share one manager per backend"
    cfg = All2AllHandleConfig(16, 64, 8, 2)
    h = mgr.get_handle(cfg)
    assert mgr.get_handle(All2AllHandleConfig(16, 64, 8, 2)) is h, "equal configs must share a handle"
    assert mgr.get_handle(All2AllHandleConfig(16, 64, 8, 4)) is not h
    n = mgr.num_handles
    context.destroy()
    context.destroy()  # idempotent
    mgr.destroy()  # idempotent
    assert mgr.destroyed and mgr.num_handles == 0 and n >= 2
    with pytest.raises(RuntimeError, match="was destroyed"):
        mgr.get_handle(cfg)
    with pytest.raises(RuntimeError, match="ParallelContext was destroyed"):
        context.all2all("naive")


def _worker(pgi, seed: int) -> None:
    context = ParallelContext.from_group(pgi.group, pgi.device)
    for name in GATHER_FAMILY:
        _check_gather_family(pgi, context, name, seed)
    _check_exchange(pgi, context, seed)
    _check_low_latency(pgi, context, seed)
    _check_fp8_rows(pgi, context, seed)
    _check_handles_and_destroy(pgi, context)


@pytest.mark.parametrize("world_size", [2, 4])
def test_managers(world_size, request):
    parallel_launch(world_size, _worker, zlib.crc32(request.node.name.encode()), timeout_s=LAUNCH_TIMEOUT_S)


# ---- registry and rows (no process group) -------------------------------------------------------

def test_registry_names_and_unknown_name():
    assert set(OWN_BACKENDS) <= set(available_backend_names())
    assert {"deepep_high_throughput", "deepep_low_latency", "symm_mem"} <= set(ALL2ALL_BACKENDS)
    for name in OWN_BACKENDS:
        assert resolve_backend(name).backend_name == name
    with pytest.raises(ValueError) as exc:
        resolve_backend("nvshmem")
    assert "all2all backend ('nvshmem') must be one of" in str(exc.value)
    for name in ALL2ALL_BACKENDS:
        assert repr(name) in str(exc.value)


def test_row_format_roundtrip_and_errors():
    fmt = RowFormat((RowField("x", torch.bfloat16, 4), RowField("w", torch.float32, 2)))
    assert fmt.row_bytes == 4 * 2 + 2 * 4
    x, w = torch.randn(3, 4).bfloat16(), torch.randn(3, 2)
    back = fmt.unpack(fmt.pack([x, w]))
    assert torch.equal(back["x"], x) and torch.equal(back["w"], w)
    empty = fmt.unpack(fmt.pack([x[:0], w[:0]]))
    assert empty["x"].shape == (0, 4)
    with pytest.raises(ValueError, match=r"field 'w' must be \(3, 2\) torch.float32"):
        fmt.pack([x, w.double()])
    with pytest.raises(ValueError, match="must be distinct"):
        RowFormat((RowField("x", torch.float32, 1), RowField("x", torch.float32, 1)))
