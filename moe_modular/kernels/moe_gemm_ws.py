"""Warp-specialized grouped expert GEMM for Hopper, in Gluon (standard format, 16-bit operands).

The same product as moe_gemm's Triton kernel for one case, the standard format (block b of BLOCK_M entries
of sorted_ids_S belongs to expert block_expert_Mb[b]): A rows in sorted order (a_sorted; rows of padding
entries hold anything) or gathered by the kernel (entry s reads row s // a_row_div), B (El, No, Ko)
unscaled bf16 / fp16, optionally the gate | up halves of w1 with SiLU / GELU applied in the epilogue, the
top-k weight multiplied into route rows, C written at the route (or, c_sorted, the sorted) rows.

Schedule: one program per SM walks the tiles of the filled blocks (their count read on the device) in the
grouped order of moe_gemm. Each program is three partitions:
- a loader (ws_common.ws_tile_loader, shared with the fp8 kernel) streams A and B tiles into a ring of STAGES
  shared-memory buffers (`ready[s]` completes when stage s has landed, `empty[s]` when the MMAs that read it
  are done) and runs ahead into the next tile while this one finishes: one warp issuing TMA copies, or
  GATHER_WARPS warps that also copy the block's A rows with cp.async (each thread's copies counted into
  `ready[s]`);
- the default partition (the launch's warps, one or two warpgroups) runs the wgmma chain, then the
  activation and the top-k weight in registers, and puts the tile, rounded, into shared memory
  (`c_ready` / `c_empty` hand it over);
- a store partition (STORER_WARPS warps) writes that tile to the output rows in whole row segments
  while the default partition already runs the next tile's MMAs.
Every step of this schedule was measured side by side against the one before it (docs/perf_notes/2026-12-04-warp-specialized-grouped-gemm.md).
"""
from __future__ import annotations

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

from moe_modular.kernels.common import ACT_SILU
from moe_modular.kernels.gemm_config import GemmEpilogue, GemmTile, SortedRows
from moe_modular.kernels.ws_common import ws_epilogue_args, ws_store_rows, ws_tile_loader, ws_tile_order


# Shared memory a program may fill with its stage ring (Hopper: 227 KiB per block; the rest stays for the
# barriers and the compiler's scratch).
WS_SMEM_BYTES = 216 * 1024
# Registers of the loader warp (it only issues TMA copies).
LOADER_REGS: gl.constexpr = gl.constexpr(40)
# The loader when it gathers A's rows itself (cp.async, a 16-byte vector per copy): its warps and registers.
GATHER_WARPS: gl.constexpr = gl.constexpr(2)
GATHER_REGS: gl.constexpr = gl.constexpr(88)
# The store partition: its warps, registers, and the output rows it moves per step (bounds its registers).
STORER_WARPS: gl.constexpr = gl.constexpr(2)
STORER_REGS: gl.constexpr = gl.constexpr(96)
STORE_ROWS: gl.constexpr = gl.constexpr(32)


@gluon.constexpr_function
def _mma_warps(block_m, num_warps):
    """warps_per_cta of the accumulator: warps down the rows (16 rows each) first, the rest across columns."""
    along_m = min(num_warps, max(4, block_m // 16))
    return [along_m, num_warps // along_m]


@gluon.constexpr_function
def _mma_layout(block_m, block_n, num_warps):
    """The wgmma accumulator layout of a (block_m, block_n) tile: the instruction's N is the columns one warp
    column covers, at most 256."""
    warps = _mma_warps(block_m, num_warps)
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps,
                                     instr_shape=[16, min(256, block_n // warps[1]), 16])


@gluon.constexpr_function
def _store_layout(block_n, num_warps):
    """Rows of 16-byte vectors: a warp covers min(32, block_n / 8) vectors of a row, warps go down the rows."""
    per_row = min(32, block_n // 8)
    return gl.BlockedLayout([1, 8], [32 // per_row, per_row], [num_warps, 1], [1, 0])


@gluon.jit
def _ws_mma_epilogue(a_bufs, b_bufs, ready, empty, c_smem, c_ready, c_empty, c_ptr, topk_weights_ptr,
                     sorted_ids_ptr, num_post_padded_ptr, num_routes, N, K, topk, stride_cm, stride_wt, stride_wk,
                     FUSE_ACT: gl.constexpr, ACTIVATION: gl.constexpr, MUL_WEIGHT: gl.constexpr,
                     C_SORTED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                     GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr,
                     A_GATHER: gl.constexpr):
    # Fused: one MMA over the gate and up tiles side by side (each A tile read once per K step), the gate
    # columns then the up columns.
    ACC_N: gl.constexpr = 2 * BLOCK_N if FUSE_ACT else BLOCK_N
    acc_layout: gl.constexpr = _mma_layout(BLOCK_M, ACC_N, NUM_WARPS)
    out_layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, NUM_WARPS)
    rows_layout: gl.constexpr = gl.SliceLayout(1, out_layout)
    num_blocks = gl.load(num_post_padded_ptr) // BLOCK_M
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    i = 0
    t = 0
    for tile in range(gl.program_id(0), num_blocks * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = ws_tile_order(tile, num_blocks, num_pid_n, GROUP_M)
        acc = gl.zeros([BLOCK_M, ACC_N], gl.float32, acc_layout)
        for kk in range(k_steps):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            if A_GATHER:  # the A tile was written by cp.async (generic proxy); wgmma reads through the async one
                fence_async_shared()
            acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
            # this step's MMA may still run; the previous step's is done, so its stage is free
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=kk > 0)
            i += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES))

        if FUSE_ACT:  # act(gate) * up, as act_and_mul.gated_act; each thread holds its gate and up columns
            acc, acc_up = gl.split(gl.permute(gl.reshape(acc, [BLOCK_M, 2, BLOCK_N]), (0, 2, 1)))
            acc = gl.convert_layout(acc, out_layout)
            acc_up = gl.convert_layout(acc_up, out_layout)
            if ACTIVATION == ACT_SILU:
                acc = acc / (1.0 + gl.exp(-acc)) * acc_up
            else:
                acc = 0.5 * acc * (1.0 + gl.erf(acc * 0.7071067811865476)) * acc_up
        if MUL_WEIGHT:
            sid = gl.load(sorted_ids_ptr + pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=rows_layout))
            w = gl.load(topk_weights_ptr + (sid // topk) * stride_wt + (sid % topk) * stride_wk,
                        mask=sid < num_routes, other=0.0)
            acc = acc * w.to(gl.float32)[:, None]
        # hand the tile to the store partition (once it has taken the previous one) and go on to the next
        mbarrier.wait(c_empty, (t & 1) ^ 1)
        c_smem.store(acc.to(c_ptr.dtype.element_ty))
        mbarrier.arrive(c_ready)
        t += 1


@gluon.jit
def _ws_storer(c_smem, c_ready, c_empty, c_ptr, sorted_ids_ptr, num_post_padded_ptr, num_routes, N, stride_cm,
               C_SORTED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """Store each output tile staged in c_smem, STORE_ROWS rows at a time: each warp writes whole row segments
    to the route (or sorted) rows of the block; padding rows are not written."""
    layout: gl.constexpr = _store_layout(BLOCK_N, STORER_WARPS)
    num_blocks = gl.load(num_post_padded_ptr) // BLOCK_M
    num_pid_n = gl.cdiv(N, BLOCK_N)
    t = 0
    for tile in range(gl.program_id(0), num_blocks * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = ws_tile_order(tile, num_blocks, num_pid_n, GROUP_M)
        offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        mbarrier.wait(c_ready, t & 1)
        for r in gl.static_range(0, BLOCK_M, STORE_ROWS):
            out = c_smem.slice(r, STORE_ROWS).load(layout)
            offs_m = pid_m * BLOCK_M + r + gl.arange(0, STORE_ROWS, layout=gl.SliceLayout(1, layout))
            ws_store_rows(c_ptr, out, offs_m, offs_n, sorted_ids_ptr, num_routes, N, stride_cm, C_SORTED)
        mbarrier.arrive(c_empty)
        t += 1


@gluon.jit
def _moe_gemm_ws_kernel(a_desc, a_ptr, stride_am, b_desc, c_ptr, topk_weights_ptr, sorted_ids_ptr, block_expert_ptr,
                        num_post_padded_ptr, num_routes, N, K, topk, b_rows_per_expert, stride_cm, stride_wt,
                        stride_wk,
                        FUSE_ACT: gl.constexpr, ACTIVATION: gl.constexpr, MUL_WEIGHT: gl.constexpr,
                        C_SORTED: gl.constexpr, A_GATHER: gl.constexpr, A_ROW_DIV: gl.constexpr,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                        STAGES: gl.constexpr, NUM_WARPS: gl.constexpr, A_LAYOUT: gl.constexpr,
                        C_LAYOUT: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], A_LAYOUT)
    B_ROWS: gl.constexpr = 2 * BLOCK_N if FUSE_ACT else BLOCK_N
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, B_ROWS, BLOCK_K], b_desc.layout)
    c_smem = gl.allocate_shared_memory(c_ptr.dtype.element_ty, [BLOCK_M, BLOCK_N], C_LAYOUT)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    c_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    c_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    mbarrier.init(c_ready, count=1)
    mbarrier.init(c_empty, count=1)
    fence_async_shared()
    # the loader: one warp issuing TMA copies, or GATHER_WARPS warps that also copy A's rows
    LOADER_WARPS: gl.constexpr = GATHER_WARPS if A_GATHER else 1
    LOADER_NUM_REGS: gl.constexpr = GATHER_REGS if A_GATHER else LOADER_REGS
    gl.warp_specialize([
        (_ws_mma_epilogue, (a_bufs, b_bufs, ready, empty, c_smem, c_ready, c_empty, c_ptr, topk_weights_ptr,
                            sorted_ids_ptr, num_post_padded_ptr, num_routes, N, K, topk, stride_cm, stride_wt,
                            stride_wk, FUSE_ACT, ACTIVATION, MUL_WEIGHT, C_SORTED, BLOCK_M, BLOCK_N, BLOCK_K,
                            GROUP_M, STAGES, NUM_WARPS, A_GATHER)),
        (ws_tile_loader, (a_desc, a_ptr, stride_am, b_desc, a_bufs, b_bufs, ready, empty, sorted_ids_ptr,
                      block_expert_ptr, num_post_padded_ptr, num_routes, N, K, b_rows_per_expert, FUSE_ACT,
                      A_GATHER, A_ROW_DIV, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES)),
        (_ws_storer, (c_smem, c_ready, c_empty, c_ptr, sorted_ids_ptr, num_post_padded_ptr, num_routes, N,
                      stride_cm, C_SORTED, BLOCK_M, BLOCK_N, GROUP_M)),
    ], [LOADER_WARPS, STORER_WARPS], [LOADER_NUM_REGS, STORER_REGS])


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def ws_stages(tile, fused: bool, item: int) -> int:
    """Stages of the ring: tile.num_stages, or fewer where that many would not fit WS_SMEM_BYTES next to the
    staged output tile."""
    per_stage = (tile.BLOCK_M + tile.BLOCK_N * (2 if fused else 1)) * tile.BLOCK_K * item
    left = WS_SMEM_BYTES - tile.BLOCK_M * tile.BLOCK_N * item
    return max(1, min(tile.num_stages, left // per_stage))


def ws_descriptors(a: torch.Tensor, b_ENK: torch.Tensor, tile, a_sorted: bool):
    """(A, B) descriptors: A (S, Ko) sorted rows in BLOCK_M x BLOCK_K boxes (None unless a_sorted: the loader
    gathers A's rows itself), B (El, No, Ko) as (El * No, Ko) rows in BLOCK_N x BLOCK_K boxes (a box past an
    expert's rows reads the next expert's, whose columns are never stored; past the last expert TMA reads
    zeros)."""
    dt = _GL_DTYPES[a.dtype]
    b_layout = gl.NVMMASharedLayout.get_default_for([tile.BLOCK_N, tile.BLOCK_K], dt)
    b2 = b_ENK.view(-1, b_ENK.shape[-1])
    b_desc = TensorDescriptor(b2, list(b2.shape), list(b2.stride()), [tile.BLOCK_N, tile.BLOCK_K], b_layout)
    if not a_sorted:
        return None, b_desc
    a_box = [tile.BLOCK_M, tile.BLOCK_K]
    return TensorDescriptor(a, list(a.shape), list(a.stride()), a_box, a_smem_layout(tile, a.dtype)), b_desc


def a_smem_layout(tile, dtype: torch.dtype):
    """Shared layout of the A stages (the wgmma operand layout; TMA and cp.async write it alike)."""
    return gl.NVMMASharedLayout.get_default_for([tile.BLOCK_M, tile.BLOCK_K], _GL_DTYPES[dtype])


def moe_gemm_ws(a: torch.Tensor, b_ENK: torch.Tensor, c: torch.Tensor, tile: GemmTile, rows: SortedRows,
                epilogue: GemmEpilogue, *, tiles: int, sms: int) -> torch.Tensor:
    """Launch the warp-specialized GEMM (moe_gemm checks the case with ws_applies and routes here); returns c.

    a (S, Ko) in sorted order (rows.a_sorted, through TMA), or rows the loader gathers itself: entry s of
    rows.sorted_ids_S reads row s // rows.a_row_div; b_ENK (El, No, Ko) contiguous (with epilogue.activation,
    the gate then the up rows: c gets No / 2 columns and tile.BLOCK_N counts c's columns); c (R, No') route
    rows or, rows.c_sorted, (S, No') sorted rows; epilogue.topk_weights_Tk (T, k) multiplies route rows.
    tiles: the most tiles there can be (blocks of block_expert_Mb times column blocks); min(tiles, sms)
    programs."""
    fused, activation_code, tw, sw, topk = ws_epilogue_args(epilogue, c)
    a_sorted = rows.a_sorted
    _, No, Ko = b_ENK.shape
    N = No // 2 if fused else No
    a_desc, b_desc = ws_descriptors(a, b_ENK, tile, a_sorted)
    _moe_gemm_ws_kernel[(min(tiles, sms),)](
        a_desc if a_sorted else b_desc, a, a.stride(0), b_desc, c, tw, rows.sorted_ids_S, rows.block_expert_Mb,
        rows.num_post_padded, rows.num_routes, N, Ko, topk, No, c.stride(0), *sw,
        FUSE_ACT=fused, ACTIVATION=activation_code, MUL_WEIGHT=epilogue.topk_weights_Tk is not None,
        C_SORTED=rows.c_sorted, A_GATHER=not a_sorted, A_ROW_DIV=rows.a_row_div, BLOCK_M=tile.BLOCK_M,
        BLOCK_N=tile.BLOCK_N, BLOCK_K=tile.BLOCK_K, GROUP_M=tile.GROUP_M, STAGES=ws_stages(tile, fused, a.element_size()),
        NUM_WARPS=tile.num_warps, A_LAYOUT=a_smem_layout(tile, a.dtype),
        C_LAYOUT=gl.NVMMASharedLayout.get_default_for([tile.BLOCK_M, tile.BLOCK_N], _GL_DTYPES[c.dtype]),
        num_warps=tile.num_warps,
    )
    return c
