"""Warp-specialized, persistent fp8 grouped expert GEMM for Hopper, in Gluon (standard format).

The same product as moe_gemm's Triton kernel for fp8 e4m3 operands in two scale layouts:
- BLOCK: A in 1 x 128 groups (a float32 scale per row and K group), B in 128 x 128 blocks;
- ROW: a float32 scale per A row, B per output channel (El, No, 1).
Rows come in the standard sorted layout (block b of BLOCK_M entries of sorted_ids_S belongs to expert
block_expert_Mb[b]): A rows sorted (through TMA) or gathered by the loader (entry s reads row s // a_row_div).
Epilogues: act(gate) * up of the gate | up halves of w1, optionally quantized to fp8 in 1 x 128 groups
(c_scale gets the scales); the top-k weight of the route; C written at the route (or sorted) rows.

Schedule: one program per SM walks the tiles of the filled blocks (their count read on the device). A tile is
128 rows by one half of 128 columns, or two halves: the gate and up halves of w1 (with the activation), or
(`wide`, without one) 256 consecutive output columns, whose B tile of 256 x 128 per K step halves the A bytes
loaded per flop. Each program runs three partitions:
- a loader (ws_common.ws_tile_loader: one warp issuing TMA copies, or GATHER_WARPS warps that also copy A's rows
  with cp.async) fills a ring of STAGES shared-memory stages (`ready[s]` completes when stage s has landed, `empty[s]` when both
  consumers are done with it) and runs ahead into the next tile;
- two consumer warpgroups, each owning 64 rows of the tile, synchronised only through the ring's mbarriers.
  BLOCK: every K step is a fresh wgmma (K = 128, one scale group) that the warpgroup waits for and then adds
  into its float32 sum times a_scale[row] * b_scale[block]; while one warpgroup scales, the other's wgmma
  keeps the tensor cores busy. ROW: one wgmma chain per half, one step in flight, scaled once at the end.
  Each warpgroup runs its own epilogue and stores its rows.
The consumers' scale loads for step k + 1 are issued before step k's wgmma is waited for.
"""
from __future__ import annotations

import enum

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from moe_modular.kernels.common import ACT_SILU, FP8_MAX_C, FP8_WS_TILE, MIN_AMAX_C
from moe_modular.kernels.gemm_config import GemmEpilogue, GemmScales, SortedRows
from moe_modular.kernels.ws_common import rows_layout, ws_epilogue_args, ws_store_rows, ws_tile_loader, ws_tile_order

# The tile: 128 rows (two consumer warpgroups of 64), 128 output columns (one weight scale block, one
# activation group of the re-quantized output), K steps of 128 (one activation scale group).
FP8_WS_BLOCK_M, FP8_WS_BLOCK_N, FP8_WS_BLOCK_K = FP8_WS_TILE  # what moe_gemm.fp8_ws_scales selects the kernel for
WG_ROWS: gl.constexpr = gl.constexpr(64)
# Shared memory of a block on Hopper (227 KiB), less what the barriers and the compiler's own use take; the
# stage ring gets what the two epilogues' layout conversions (a 64 x 128 output tile each) leave.
FP8_WS_SMEM_BYTES = 226 * 1024
# Registers per thread: a warpgroup slot of the register file each for the two consumers and the loader (padded to
# a warpgroup) share 504; the first consumer (the launch's own warps) gets what the others leave, so the second
# asks for an even split. The loader: one warp issuing TMA copies, or GATHER_WARPS warps that also copy A's rows.
REG_BUDGET = 504
LOADER_REGS: gl.constexpr = gl.constexpr(40)
GATHER_WARPS: gl.constexpr = gl.constexpr(4)
GATHER_REGS: gl.constexpr = gl.constexpr(56)
CONSUMER_REGS: gl.constexpr = gl.constexpr((REG_BUDGET - LOADER_REGS.value) // 2 // 8 * 8)
GATHER_CONSUMER_REGS: gl.constexpr = gl.constexpr((REG_BUDGET - GATHER_REGS.value) // 2 // 8 * 8)


class Fp8Scales(enum.Enum):
    """Scale layouts the kernel takes (moe_gemm's AScale / BScale pairs)."""

    BLOCK = 0  # A GROUP (rows, G) x B BLOCK (El, ceil(No / 128), ceil(Ko / 128))
    ROW = 1  # A ROW (rows, 1) x B CHANNEL (El, No, 1)


_BLOCK: gl.constexpr = gl.constexpr(Fp8Scales.BLOCK.value)


@gluon.jit
def _ws_scale_of(amax):
    """The fp8 scale of an amax, as kernels/common.scale_of (and quant.py) computes it."""
    a = gl.maximum(amax, MIN_AMAX_C)
    return gl.div_rn(a, gl.full_like(a, FP8_MAX_C))


@gluon.jit
def _ws_to_fp8(h, scale, out_dtype: gl.constexpr):
    """h / scale rounded to fp8 as act_and_mul.to_fp8: a correctly rounded division, saturated; not finite: NaN."""
    q = gl.div_rn(h, gl.zeros_like(h) + scale)
    q = gl.minimum(gl.maximum(q, -FP8_MAX_C), FP8_MAX_C)
    return gl.where(gl.abs(h) < float("inf"), q, float("nan")).to(out_dtype)


@gluon.jit
def _ws_finite_abs(h):
    """|h| where finite, else 0 (act_and_mul.finite_abs)."""
    a = gl.abs(h)
    return gl.where(a < float("inf"), a, 0.0)


@gluon.constexpr_function
def _acc_layout(block_n):
    """The wgmma accumulator of one warpgroup's 64 rows x block_n columns (fp8: instruction K 32)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, block_n, 32])


@gluon.jit
def _fp8_consumer(a_bufs, b_bufs, ready, empty, c_ptr, c_scale_ptr, a_scale_ptr, b_scale_ptr, topk_weights_ptr,
                  sorted_ids_ptr, block_expert_ptr, num_post_padded_ptr, num_routes, N, K, topk, stride_cm,
                  stride_csm, stride_asm, stride_bse, stride_bsn, stride_wt, stride_wk,
                  ROW0: gl.constexpr, SCALES: gl.constexpr, FUSE_ACT: gl.constexpr, ACTIVATION: gl.constexpr,
                  OUT_GROUP: gl.constexpr, MUL_WEIGHT: gl.constexpr, C_SORTED: gl.constexpr, A_GATHER: gl.constexpr,
                  A_ROW_DIV: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                  GROUP_M: gl.constexpr, STAGES: gl.constexpr, WIDE: gl.constexpr):
    """One warpgroup: rows [ROW0, ROW0 + 64) of every tile, from the wgmma chain to the stored output. A tile
    is one half of BLOCK_N columns, or two: FUSE_ACT's gate and up halves, or WIDE's 2 * BLOCK_N columns
    (`acc` and `acc_up` hold the two)."""
    acc_layout: gl.constexpr = _acc_layout(BLOCK_N)
    row_slice: gl.constexpr = gl.SliceLayout(1, acc_layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    TWO: gl.constexpr = FUSE_ACT or WIDE
    TILE_N: gl.constexpr = 2 * BLOCK_N if WIDE else BLOCK_N
    num_blocks = gl.load(num_post_padded_ptr) // BLOCK_M
    num_pid_n = gl.cdiv(N, TILE_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    # the second half's weight scale blocks: FUSE_ACT's up half starts N / BLOCK_N blocks down (N % BLOCK_N == 0);
    # WIDE's is the next block, past N in the last column tile when N % (2 * BLOCK_N) <= BLOCK_N
    up_blocks = N // BLOCK_N if FUSE_ACT else 1
    tmp = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, acc_layout)  # a K step's product (its value is not read)
    i = 0
    for tile in range(gl.program_id(0), num_blocks * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = ws_tile_order(tile, num_blocks, num_pid_n, GROUP_M)
        expert = gl.load(block_expert_ptr + pid_m).to(gl.int64)
        offs_m = pid_m * BLOCK_M + ROW0 + gl.arange(0, WG_ROWS, layout=row_slice)
        sid = gl.load(sorted_ids_ptr + offs_m)
        row_ok = sid < num_routes
        if A_GATHER:
            a_row = (sid // A_ROW_DIV).to(gl.int64)
        else:
            a_row = offs_m.to(gl.int64)
        as_ptrs = a_scale_ptr + a_row * stride_asm
        col0 = pid_n * TILE_N  # the tile's first output column
        up_ok = col0 + BLOCK_N < N  # WIDE: whether the second half has columns
        acc = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, acc_layout)
        if TWO:
            acc_up = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, acc_layout)
        if SCALES == _BLOCK:
            bs_gate = b_scale_ptr + expert * stride_bse + pid_n * (TILE_N // BLOCK_N) * stride_bsn
            bs_up = bs_gate + up_blocks * stride_bsn
            if WIDE:
                b_s_up = gl.load(bs_up, mask=up_ok, other=0.0)
            elif FUSE_ACT:
                b_s_up = gl.load(bs_up)
            a_s = gl.load(as_ptrs, mask=row_ok, other=0.0)
            b_s = gl.load(bs_gate)
            for kk in range(k_steps):
                s = i % STAGES
                mbarrier.wait(ready.index(s), (i // STAGES) & 1)
                if A_GATHER:  # A was written by cp.async (generic proxy); wgmma reads through the async one
                    fence_async_shared()
                a = a_bufs.index(s).slice(ROW0, WG_ROWS)
                tok = warpgroup_mma(a, b_bufs.index(s).slice(0, BLOCK_N).permute((1, 0)), tmp, use_acc=False,
                                    is_async=True)
                # the next step's scales load while this step's wgmma runs
                more = kk + 1 < k_steps
                a_s_next = gl.load(as_ptrs + (kk + 1), mask=row_ok & more, other=0.0)
                b_s_next = gl.load(bs_gate + (kk + 1), mask=more, other=0.0)
                tmp = warpgroup_mma_wait(num_outstanding=0, deps=(tok, ))
                acc += tmp * (a_s * b_s)[:, None]
                if TWO:
                    tok = warpgroup_mma(a, b_bufs.index(s).slice(BLOCK_N, BLOCK_N).permute((1, 0)), tmp,
                                        use_acc=False, is_async=True)
                    if WIDE:
                        b_s_up_next = gl.load(bs_up + (kk + 1), mask=more & up_ok, other=0.0)
                    else:
                        b_s_up_next = gl.load(bs_up + (kk + 1), mask=more, other=0.0)
                    tmp = warpgroup_mma_wait(num_outstanding=0, deps=(tok, ))
                    acc_up += tmp * (a_s * b_s_up)[:, None]
                    b_s_up = b_s_up_next
                mbarrier.arrive(empty.index(s))
                a_s = a_s_next
                b_s = b_s_next
                i += 1
        else:  # ROW: one chain over K per half with one step (one wgmma group per half) in flight, scaled at the end
            for kk in range(k_steps):
                s = i % STAGES
                mbarrier.wait(ready.index(s), (i // STAGES) & 1)
                if A_GATHER:
                    fence_async_shared()
                a = a_bufs.index(s).slice(ROW0, WG_ROWS)
                acc = warpgroup_mma(a, b_bufs.index(s).slice(0, BLOCK_N).permute((1, 0)), acc, is_async=True)
                if TWO:
                    acc_up = warpgroup_mma(a, b_bufs.index(s).slice(BLOCK_N, BLOCK_N).permute((1, 0)), acc_up,
                                           is_async=True)
                    # this step's wgmmas may still run; the previous step's are done, so its stage is free
                    acc, acc_up = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc_up))
                else:
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=kk > 0)
                i += 1
            if TWO:
                acc, acc_up = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_up))
            else:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES))
            a_s = gl.load(as_ptrs, mask=row_ok, other=0.0)
            offs_n = col0 + gl.arange(0, BLOCK_N, layout=cols_layout)
            b_s = gl.load(b_scale_ptr + expert * stride_bse + offs_n * stride_bsn, mask=offs_n < N, other=0.0)
            acc = acc * a_s[:, None] * b_s[None, :]
            if TWO:
                offs_n += BLOCK_N
                b_s = gl.load(b_scale_ptr + expert * stride_bse + offs_n * stride_bsn, mask=offs_n < N, other=0.0)
                acc_up = acc_up * a_s[:, None] * b_s[None, :]

        if FUSE_ACT:  # act(gate) * up, as act_and_mul.gated_act
            if ACTIVATION == ACT_SILU:
                acc = acc / (1.0 + gl.exp(-acc)) * acc_up
            else:
                acc = 0.5 * acc * (1.0 + gl.erf(acc * 0.7071067811865476)) * acc_up
        tile_rows = pid_m * BLOCK_M + ROW0
        _fp8_store(acc, col0, offs_m, tile_rows, sid, row_ok, c_ptr, c_scale_ptr, topk_weights_ptr, sorted_ids_ptr,
                   num_routes, N, topk, stride_cm, stride_csm, stride_wt, stride_wk, OUT_GROUP, MUL_WEIGHT, C_SORTED,
                   BLOCK_N)
        if WIDE:
            if up_ok:
                _fp8_store(acc_up, col0 + BLOCK_N, offs_m, tile_rows, sid, row_ok, c_ptr, c_scale_ptr, topk_weights_ptr,
                           sorted_ids_ptr, num_routes, N, topk, stride_cm, stride_csm, stride_wt, stride_wk,
                           OUT_GROUP, MUL_WEIGHT, C_SORTED, BLOCK_N)


@gluon.jit
def _fp8_store(acc, col0, offs_m, tile_rows, sid, row_ok, c_ptr, c_scale_ptr, topk_weights_ptr, sorted_ids_ptr,
               num_routes, N, topk, stride_cm, stride_csm, stride_wt, stride_wk, OUT_GROUP: gl.constexpr,
               MUL_WEIGHT: gl.constexpr, C_SORTED: gl.constexpr, BLOCK_N: gl.constexpr):
    """A consumer's epilogue for one half: columns [col0, col0 + BLOCK_N) of its 64 rows (sorted entries offs_m,
    from tile_rows on; sid their routes; both in the accumulator's row layout), quantized in one 1 x BLOCK_N group
    per row (OUT_GROUP) or times the route's top-k weight (MUL_WEIGHT), then stored."""
    if C_SORTED:
        out_row = offs_m.to(gl.int64)
    else:
        out_row = sid.to(gl.int64)
    if OUT_GROUP > 0:  # one scale per row: the half's BLOCK_N columns are one group
        g_scale = _ws_scale_of(gl.max(_ws_finite_abs(acc), axis=1))
        acc = _ws_to_fp8(acc, g_scale[:, None], c_ptr.dtype.element_ty)
        gl.store(c_scale_ptr + out_row * stride_csm + col0 // BLOCK_N, g_scale, mask=row_ok)
    if MUL_WEIGHT:
        w = gl.load(topk_weights_ptr + (sid // topk) * stride_wt + (sid % topk) * stride_wk, mask=row_ok,
                    other=0.0)
        acc = acc * w.to(gl.float32)[:, None]
    # whole row segments: 16-byte vectors, a warp across a row
    store_layout: gl.constexpr = rows_layout(BLOCK_N, c_ptr.dtype.element_ty, 4)
    out = gl.convert_layout(acc.to(c_ptr.dtype.element_ty), store_layout)
    st_m = tile_rows + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, store_layout))
    st_n = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, store_layout))
    ws_store_rows(c_ptr, out, st_m, st_n, sorted_ids_ptr, num_routes, N, stride_cm, C_SORTED)


@gluon.jit
def _moe_gemm_ws_fp8_kernel(a_desc, a_ptr, stride_am, b_desc, c_ptr, c_scale_ptr, a_scale_ptr, b_scale_ptr,
                            topk_weights_ptr, sorted_ids_ptr, block_expert_ptr, num_post_padded_ptr, num_routes, N,
                            K, topk, b_rows_per_expert, stride_cm, stride_csm, stride_asm, stride_bse, stride_bsn,
                            stride_wt, stride_wk,
                            SCALES: gl.constexpr, FUSE_ACT: gl.constexpr, ACTIVATION: gl.constexpr,
                            OUT_GROUP: gl.constexpr, MUL_WEIGHT: gl.constexpr, C_SORTED: gl.constexpr,
                            A_GATHER: gl.constexpr, A_ROW_DIV: gl.constexpr, BLOCK_M: gl.constexpr,
                            BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                            STAGES: gl.constexpr, A_LAYOUT: gl.constexpr, WIDE: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], A_LAYOUT)
    B_ROWS: gl.constexpr = 2 * BLOCK_N if FUSE_ACT or WIDE else BLOCK_N
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, B_ROWS, BLOCK_K], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # both consumer warpgroups release each stage
    fence_async_shared()
    LOADER_WARPS: gl.constexpr = GATHER_WARPS if A_GATHER else 1
    LOADER_NUM_REGS: gl.constexpr = GATHER_REGS if A_GATHER else LOADER_REGS
    CONSUMER_NUM_REGS: gl.constexpr = GATHER_CONSUMER_REGS if A_GATHER else CONSUMER_REGS
    gl.warp_specialize([
        (_fp8_consumer, (a_bufs, b_bufs, ready, empty, c_ptr, c_scale_ptr, a_scale_ptr, b_scale_ptr, topk_weights_ptr,
                         sorted_ids_ptr, block_expert_ptr, num_post_padded_ptr, num_routes, N, K, topk, stride_cm,
                         stride_csm, stride_asm, stride_bse, stride_bsn, stride_wt, stride_wk, 0, SCALES, FUSE_ACT,
                         ACTIVATION, OUT_GROUP, MUL_WEIGHT, C_SORTED, A_GATHER, A_ROW_DIV, BLOCK_M, BLOCK_N, BLOCK_K,
                         GROUP_M, STAGES, WIDE)),
        (_fp8_consumer, (a_bufs, b_bufs, ready, empty, c_ptr, c_scale_ptr, a_scale_ptr, b_scale_ptr, topk_weights_ptr,
                         sorted_ids_ptr, block_expert_ptr, num_post_padded_ptr, num_routes, N, K, topk, stride_cm,
                         stride_csm, stride_asm, stride_bse, stride_bsn, stride_wt, stride_wk, WG_ROWS, SCALES,
                         FUSE_ACT, ACTIVATION, OUT_GROUP, MUL_WEIGHT, C_SORTED, A_GATHER, A_ROW_DIV, BLOCK_M, BLOCK_N,
                         BLOCK_K, GROUP_M, STAGES, WIDE)),
        (ws_tile_loader, (a_desc, a_ptr, stride_am, b_desc, a_bufs, b_bufs, ready, empty, sorted_ids_ptr,
                       block_expert_ptr, num_post_padded_ptr, num_routes, N, K, b_rows_per_expert, FUSE_ACT,
                       A_GATHER, A_ROW_DIV, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, WIDE)),
    ], [4, LOADER_WARPS], [CONSUMER_NUM_REGS, LOADER_NUM_REGS])


def fp8_ws_stages(halves: int, c_item: int) -> int:
    """Stages of the ring (1-byte A and B tiles; B of 1 or 2 halves of FP8_WS_BLOCK_N rows) that fit
    FP8_WS_SMEM_BYTES next to the two consumers' output tiles (one half each) of c_item-byte elements."""
    per_stage = (FP8_WS_BLOCK_M + FP8_WS_BLOCK_N * halves) * FP8_WS_BLOCK_K
    scratch = 2 * int(WG_ROWS) * FP8_WS_BLOCK_N * c_item
    return (FP8_WS_SMEM_BYTES - scratch) // per_stage


def _a_layout():
    return gl.NVMMASharedLayout.get_default_for([FP8_WS_BLOCK_M, FP8_WS_BLOCK_K], gl.float8e4nv)


def fp8_ws_descriptors(a: torch.Tensor, b_ENK: torch.Tensor, a_sorted: bool):
    """(A, B) descriptors: A (S, Ko) sorted rows in 128 x 128 boxes (None unless a_sorted), B (El, No, Ko) as
    (El * No, Ko) rows in 128 x 128 boxes (a box past an expert's rows reads the next expert's, whose columns are
    never stored; past the last expert TMA reads zeros)."""
    box = [FP8_WS_BLOCK_N, FP8_WS_BLOCK_K]
    b2 = b_ENK.view(-1, b_ENK.shape[-1])
    b_desc = TensorDescriptor(b2, list(b2.shape), list(b2.stride()), box,
                              gl.NVMMASharedLayout.get_default_for(box, gl.float8e4nv))
    if not a_sorted:
        return None, b_desc
    return TensorDescriptor(a, list(a.shape), list(a.stride()), [FP8_WS_BLOCK_M, FP8_WS_BLOCK_K], _a_layout()), b_desc


def moe_gemm_ws_fp8(a: torch.Tensor, b_ENK: torch.Tensor, c: torch.Tensor, kind: Fp8Scales, scales: GemmScales,
                    rows: SortedRows, epilogue: GemmEpilogue, *, tiles: int, sms: int, group_m: int = 8,
                    wide: bool = False) -> torch.Tensor:
    """Launch the fp8 warp-specialized GEMM (moe_gemm checks the case with fp8_ws_scales and routes here).

    a (rows, Ko) fp8 e4m3: sorted rows (rows.a_sorted, through TMA) or rows the loader gathers (entry s of
    rows.sorted_ids_S reads row s // rows.a_row_div); scales.a float32 (rows, ceil(Ko / 128)) for BLOCK, (rows, 1)
    for ROW, indexed like a's rows; b_ENK (El, No, Ko) fp8 e4m3 contiguous (with epilogue.activation: the gate then
    the up rows, c gets No / 2 columns); scales.b float32 (El, ceil(No / 128), ceil(Ko / 128)) for BLOCK,
    (El, No, 1) for ROW. c (R, No') route rows or, rows.c_sorted, (S, No') sorted rows: bf16 / fp16 / float32, or
    fp8 e4m3 with epilogue.c_scale (rows, ceil(No' / 128)) float32 (with an activation: the output quantized in
    1 x 128 groups). epilogue.topk_weights_Tk (T, k) multiplies route rows. wide (no activation): tiles of 256
    output columns, two halves of 128. tiles: the most tiles there can be; min(tiles, sms) programs."""
    fused, activation_code, tw, sw, topk = ws_epilogue_args(epilogue, c)
    if wide and fused:
        raise ValueError("moe_gemm_ws_fp8: wide=True tiles the output of a GEMM without an activation; "
                         f"epilogue.activation is {epilogue.activation}")
    a_scale, b_scale, c_scale = scales.a, scales.b, epilogue.c_scale
    a_sorted = rows.a_sorted
    _, No, Ko = b_ENK.shape
    N = No // 2 if fused else No
    a_desc, b_desc = fp8_ws_descriptors(a, b_ENK, a_sorted)
    quantized = c_scale is not None
    _moe_gemm_ws_fp8_kernel[(min(tiles, sms),)](
        a_desc if a_sorted else b_desc, a, a.stride(0), b_desc, c, c_scale if quantized else c, a_scale, b_scale, tw,
        rows.sorted_ids_S, rows.block_expert_Mb, rows.num_post_padded, rows.num_routes, N, Ko, topk, No, c.stride(0),
        c_scale.stride(0) if quantized else 0, a_scale.stride(0), b_scale.stride(0), b_scale.stride(1), *sw,
        SCALES=kind.value, FUSE_ACT=fused, ACTIVATION=activation_code,
        OUT_GROUP=FP8_WS_BLOCK_N if quantized else 0, MUL_WEIGHT=epilogue.topk_weights_Tk is not None, C_SORTED=rows.c_sorted,
        A_GATHER=not a_sorted, A_ROW_DIV=rows.a_row_div, BLOCK_M=FP8_WS_BLOCK_M, BLOCK_N=FP8_WS_BLOCK_N,
        BLOCK_K=FP8_WS_BLOCK_K, GROUP_M=group_m, STAGES=fp8_ws_stages(2 if fused or wide else 1, c.element_size()),
        A_LAYOUT=_a_layout(), WIDE=wide, num_warps=4,
    )
    return c
