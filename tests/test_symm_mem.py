"""Symmetric-memory backend: capacity arithmetic, the shared buffer cache (sharing, aligned growth,
free-before-allocate, release), the received-layout decoding, the refusals (one rank, limits,
no CUDA / NVSHMEM), and the PrepareAndFinalize end to end on 2 gloo ranks with a stand-in for
torch's two symmetric-memory ops (the documented semantics, computed with all_gather_object)."""
from __future__ import annotations

import weakref

import pytest
import torch
import torch.distributed as dist

from all2all import symm_mem as sm
from all2all.base import resolve_backend
from moe_modular.config import ExpertPlacement, MoEConfig, ParallelConfig
from moe_modular.experts.torch_experts import TorchExperts
from moe_modular.modular_kernel import FusedMoEModularKernel
from moe_modular.prepare_finalize.symm_mem_prepare_and_finalize import (
    SymmMemPrepareAndFinalize,
    received_positions,
)
from moe_modular.quant import MoEQuantParams, QuantConfig
from moe_modular.reference import moe_torch
from moe_modular.routing import local_expert_ids, make_expert_map
from moe_modular.testing.common import Config, tolerance
from moe_modular.testing.parallel_utils import parallel_launch
from moe_modular.testing.runner import make_inputs, relative_error

CPU = torch.device("cpu")
W = 2


def _moe(ep=2, E=8, topk=2, K=64):
    return MoEConfig(num_experts=E, topk=topk, hidden_dim=K, intermediate_dim=32, parallel=ParallelConfig(ep, 0))


# ---- refusals and limits ------------------------------------------------------------------------
WORLD_CASES = [
    (1, "do not support a single rank"),  # one rank: the ops are not emulated
    (2, None),                            # smallest
    (16, None),                           # largest the offset op takes
    (17, "at most 16 ranks"),             # one past it
]


@pytest.mark.parametrize("ws,fragment", WORLD_CASES)
def test_world_size_limits(ws, fragment):
    err = sm.world_size_error(ws)
    if fragment is None:
        assert err is None
    else:
        assert err.startswith(f"ep_size ({ws}) must be in [2, 16]") and fragment in err


def test_single_rank_is_refused_before_anything_else():
    ok, reason = SymmMemPrepareAndFinalize.supports(_moe(ep=1))
    assert not ok and reason.startswith("ep_size (1) must be in [2, 16]") and "single rank" in reason
    assert SymmMemPrepareAndFinalize.requires_distributed()


def test_local_expert_limit():
    err = SymmMemPrepareAndFinalize.check_config(_moe(ep=2, E=34))
    assert err.startswith("local experts per rank (17) must be <= 16")
    assert SymmMemPrepareAndFinalize.check_config(_moe(ep=2, E=32)) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_without_cuda_the_reason_is_cuda():
    ok, reason = SymmMemPrepareAndFinalize.supports(_moe())
    assert not ok and "CUDA is not available" in reason
    assert resolve_backend("symm_mem") is sm.SymmMemManager


# ---- capacity arithmetic ------------------------------------------------------------------------
CAPACITY_CASES = [
    (0, 384),      # empty still gets one block
    (1, 384),
    (384, 384),    # exactly one block
    (385, 768),    # one past
    (5000, 5376),  # 14 blocks
]


@pytest.mark.parametrize("rows,expected", CAPACITY_CASES)
def test_aligned_capacity(rows, expected):
    assert sm.aligned_capacity(rows) == expected


TOKEN_CONFIG_CASES = [
    # (max tokens, topk, El, W, major_align) -> (send rows, recv rows)
    ((16, 2, 4, 2, 1), (32, 2 * 16 * 2 + 4)),    # topk < El: every route may land here
    ((16, 8, 4, 2, 1), (128, 2 * 16 * 4 + 4)),   # topk > El: at most El routes of a token land here
    ((10, 3, 5, 4, 8), (30, 4 * 10 * 3 + 5 * 8)),  # alignment adds major_align per local expert
]


@pytest.mark.parametrize("args,expected", TOKEN_CONFIG_CASES)
def test_token_config_rows(args, expected):
    T, k, El, ws, align = args
    cfg = sm.SymmMemTokenConfig(T, k, El, 100, 64, align)
    assert (cfg.send_rows(), cfg.recv_rows(ws)) == expected
    assert cfg.send_capacity() % 384 == 0 and cfg.send_capacity() >= expected[0]
    assert cfg.recv_capacity(ws) % 384 == 0 and cfg.recv_capacity(ws) >= expected[1]


def test_token_config_validation():
    with pytest.raises(ValueError, match=r"SymmMemTokenConfig.major_align \(0\)"):
        sm.SymmMemTokenConfig(1, 1, 1, 1, 1, 0)


# ---- the buffer cache ---------------------------------------------------------------------------
def test_buffer_cache_shares_grows_aligned_and_frees_first():
    events = []
    refs: list = []

    class Backend:
        def allocate(self, shape, dtype, device):
            events.append(("alloc", shape, all(r() is None for r in refs)))
            t = torch.zeros(shape, dtype=dtype, device=device)
            refs.append(weakref.ref(t))
            return t

    cache = sm.SymmMemBufferCache(Backend(), "g0", CPU)
    assert cache.reserve("send", (100,), torch.uint8, 10) == 384
    first = cache.get("send", (100,), torch.uint8)
    assert cache.reserve("send", (100,), torch.uint8, 384) == 384  # fits: shared, no allocation
    assert cache.get("send", (100,), torch.uint8) is first and cache.num_allocations == 1
    del first
    assert cache.reserve("send", (100,), torch.uint8, 385) == 768  # grows to the next block
    assert events[-1] == ("alloc", (768, 100), True), "the old buffer must be freed before the new one"
    assert cache.reserve("send", (100,), torch.uint8, 10) == 768  # never shrinks
    # another row shape or name is another buffer
    cache.reserve("send", (64,), torch.uint8, 10)
    cache.reserve("recv", (100,), torch.uint8, 10)
    assert len(cache) == 3 and cache.num_allocations == 4
    with pytest.raises(ValueError, match="holds 768 rows; 769 were asked for"):
        cache.get("send", (100,), torch.uint8, 769)
    with pytest.raises(KeyError, match="was not reserved"):
        cache.get("other", (100,), torch.uint8)
    cache.clear()
    assert len(cache) == 0 and all(r() is None for r in refs)


# ---- decoding the received layout ---------------------------------------------------------------
def test_received_positions_skip_alignment_gaps():
    # El = 2, W = 2, expert-major cells (e0,r0) (e0,r1) (e1,r0) (e1,r1); expert 1 starts at an aligned 8.
    so = torch.tensor([[2, 1, 0, 3], [0, 2, 8, 8]])
    pos, cell = received_positions(so)
    assert pos.tolist() == [0, 1, 2, 8, 9, 10]
    assert (cell // 2).tolist() == [0, 0, 0, 1, 1, 1]  # local expert of each row
    empty_pos, _ = received_positions(torch.zeros(2, 4, dtype=torch.int64))
    assert empty_pos.numel() == 0


# ---- the ops' stand-in and the 2-rank runs ------------------------------------------------------
class GlooSymmMemStandIn:
    """torch's all_to_all_vdev_2d / all_to_all_vdev_2d_offset semantics over gloo. Every tensor the
    ops get must be a whole buffer this backend allocated (as symmetric memory requires)."""

    def __init__(self, group) -> None:
        self.group = group
        self.allocated: list = []

    def allocate(self, shape, dtype, device):
        t = torch.full(shape, -3 if not dtype.is_floating_point and dtype != torch.uint8 else 0xA5, dtype=dtype)
        self.allocated.append(weakref.ref(t))
        return t

    def _check_symmetric(self, *tensors) -> None:
        live = [r() for r in self.allocated if r() is not None]
        for t in tensors:
            assert any(t.data_ptr() == a.data_ptr() and t.shape == a.shape for a in live), \
                "op arguments must be whole symmetric buffers"

    def _gather(self, obj):
        out = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def all_to_all_2d(self, input, out, in_splits, out_splits_offsets, group_name, major_align):
        self._check_symmetric(input, out, in_splits, out_splits_offsets)
        assert input.dtype == out.dtype and input.stride(0) == out.stride(0) and major_align >= 1
        ws, me = dist.get_world_size(self.group), dist.get_rank(self.group)
        ne = in_splits.numel() // ws
        splits_all = self._gather(in_splits)
        inputs_all = self._gather(input)
        pos = 0
        for e in range(ne):
            start = pos
            for src in range(ws):
                cell = me * ne + e
                n = int(splits_all[src][cell])
                off = int(splits_all[src][:cell].sum())
                out[pos:pos + n] = inputs_all[src][off:off + n]
                out_splits_offsets[0, e * ws + src] = n
                out_splits_offsets[1, e * ws + src] = pos
                pos += n
            total = pos - start
            pos = start + max(-(-total // major_align) * major_align, major_align)

    def all_to_all_2d_offset(self, input, out, in_splits_offsets, out_splits_offsets, group_name):
        self._check_symmetric(input, out, in_splits_offsets, out_splits_offsets)
        assert input.dtype == out.dtype and input.stride(0) == out.stride(0)
        ws, me = dist.get_world_size(self.group), dist.get_rank(self.group)
        ne = in_splits_offsets.size(1) // ws
        so_all = self._gather(in_splits_offsets)
        inputs_all = self._gather(input)
        pos = 0
        for r in range(ws):
            for e in range(ne):
                n, off = int(so_all[r][0, e * ws + me]), int(so_all[r][1, e * ws + me])
                out[pos:pos + n] = inputs_all[r][off:off + n]
                out_splits_offsets[0, r * ne + e] = n
                out_splits_offsets[1, r * ne + e] = pos
                pos += n


# Each case: (scheme, dtype, K, E, topk, M, placement) and the edge it covers.
PF_CASES = [
    (QuantConfig(), torch.bfloat16, 64, 8, 2, 5, ExpertPlacement.LINEAR),          # plain bf16
    (QuantConfig(), torch.float32, 48, 6, 3, 4, ExpertPlacement.ROUND_ROBIN),      # fp32, round robin, El=3
    (QuantConfig.fp8_block((128, 128)), torch.bfloat16, 160, 8, 2, 3, ExpertPlacement.LINEAR),  # group scales travel
    (QuantConfig.fp8_per_tensor(), torch.bfloat16, 64, 8, 2, 6, ExpertPlacement.LINEAR),  # global per-tensor amax
    (QuantConfig.fp8_per_token(), torch.float16, 64, 8, 2, 2, ExpertPlacement.LINEAR),  # per-token scales travel
    (QuantConfig(), torch.bfloat16, 32, 4, 4, 3, ExpertPlacement.LINEAR),         # topk = E
    (QuantConfig(), torch.bfloat16, 32, 8, 1, 1, ExpertPlacement.LINEAR),         # M=1, topk=1
]


def _pf_worker(pgi, cases) -> None:
    backend = GlooSymmMemStandIn(pgi.group)
    manager = sm.SymmMemManager(pgi.group, CPU, backend=backend)
    failures = []
    for i, (quant_cfg, dtype, K, E, topk, M, placement) in enumerate(cases):
        cfg = Config(Ms=(M,), K=K, N=32, E=E, topks=(topk,), dtype=dtype, quant=quant_cfg,
                     prepare_finalize_type=SymmMemPrepareAndFinalize, fused_experts_type=TorchExperts,
                     world_size=W, placement=placement)
        moe = cfg.moe_config(topk, pgi.rank)
        inp = make_inputs(cfg, M, topk, 777 + i, CPU)
        rows = slice(pgi.rank * M, (pgi.rank + 1) * M)
        held = local_expert_ids(E, W, pgi.rank, placement)
        q = inp.quant
        pick = (lambda t: None if t is None else t[held])
        quant = MoEQuantParams(q.config, pick(q.w1_scale), pick(q.w2_scale), q.a1_scale, q.a2_scale)
        pf = SymmMemPrepareAndFinalize(moe, manager)
        kernel = FusedMoEModularKernel(pf, TorchExperts.for_prepare_finalize(moe, quant, pf))
        out = torch.full_like(inp.x[rows], float("nan"))
        kernel(inp.x[rows], inp.w1[held], inp.w2[held], inp.topk_weights[rows], inp.topk_ids[rows],
               global_num_experts=E, expert_map=make_expert_map(E, W, pgi.rank, placement), output=out)
        ref = moe_torch(inp.x, inp.w1, inp.w2, inp.topk_weights, inp.topk_ids, cfg.activation, inp.quant)[rows]
        err, tol = relative_error(out, ref), tolerance(dtype, quant_cfg)
        if not err <= tol:
            failures.append(f"case {i} {quant_cfg.name} {dtype} K={K} E={E} topk={topk} M={M}: {err:.3g} > {tol:.3g}")
    # Layers share the buffers: one set of named buffers per row shape, grown to the largest layer, and one
    # dispatch layout per slot.
    names = {key[1] for key in manager.buffers._buffers}
    layouts = {f"dispatch_out_splits_offsets.{slot}" for slot in range(sm.LAYOUT_SLOTS)}
    assert names == {"dispatch_send", "dispatch_recv", "dispatch_in_splits", "combine_in", "combine_out",
                     "combine_out_splits_offsets"} | layouts, names
    for key, buf in manager.buffers._buffers.items():
        if key[1] in ("dispatch_send", "dispatch_recv", "combine_in", "combine_out"):
            assert buf.size(0) % sm.CAPACITY_ALIGN_ROWS == 0
    sm.destroy_symm_mem_buffers(manager)
    assert len(manager.buffers) == 0
    manager.destroy()
    assert not failures, "\n".join(failures)


def test_symm_mem_prepare_finalize_against_oracle():
    parallel_launch(W, _pf_worker, PF_CASES, timeout_s=240)


def _manager_worker(pgi) -> None:
    backend = GlooSymmMemStandIn(pgi.group)
    manager = sm.SymmMemManager(pgi.group, CPU, backend=backend)
    # Round trip at the manager level with per-expert alignment (El = 3, major_align = 4).
    cfg = sm.SymmMemTokenConfig(max_num_tokens=5, topk=2, num_local_experts=3, dispatch_row_bytes=8,
                                combine_row_bytes=8, major_align=4)
    h = manager.token_handle(cfg)
    assert manager.token_handle(cfg) is h
    g = torch.Generator().manual_seed(pgi.rank)
    splits = torch.randint(0, 3, (W * 3,), generator=g)
    S = int(splits.sum())
    rows = torch.randint(0, 255, (S, 8), generator=g, dtype=torch.uint8)
    recv, so = manager.dispatch_2d(h, rows, splits)
    offsets = so[1].view(3, W)
    assert all(int(offsets[e, 0]) % 4 == 0 for e in range(3)), "each local expert starts aligned"
    pos, _ = received_positions(so)
    cin = manager.combine_input(h)
    cin.index_copy_(0, pos, recv.index_select(0, pos))
    back = manager.combine_2d(h, S)
    assert torch.equal(back, rows), "combine returns every row to its sender in send order"
    # A later, larger layer grows the shared buffers; the earlier handle sees the grown ones.
    big = manager.token_handle(sm.SymmMemTokenConfig(400, 2, 3, 8, 8, 4))
    assert manager.buffers.capacity("dispatch_send", (8,), torch.uint8) == big.send_capacity == 1152
    assert manager.buffers.get("dispatch_send", (8,), torch.uint8, h.send_capacity).size(0) == 1152
    # One rank is refused, not emulated.
    solo = dist.new_group([0])
    if pgi.rank == 0:
        try:
            sm.SymmMemManager(solo, CPU, backend=GlooSymmMemStandIn(solo))
        except ValueError as exc:
            assert "do not support a single rank" in str(exc)
        else:
            raise AssertionError("a one-rank group must be refused")
    manager.destroy()
    manager.destroy()  # idempotent
    assert len(manager.buffers) == 0


def test_symm_mem_manager_round_trip_alignment_and_growth():
    parallel_launch(W, _manager_worker, timeout_s=120)
