"""What the warp-specialized Gluon GEMMs (moe_gemm_ws.py, moe_gemm_ws_fp8.py) share: the persistent tile order,
the row layout of 16-byte vectors, the loader partition, the store of output rows, and on the host the epilogue's
launch arguments."""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, mbarrier, tma

from moe_modular.kernels.act_and_mul import ACT_CODE
from moe_modular.kernels.common import tile_order
from moe_modular.kernels.gemm_config import GemmEpilogue


def ws_epilogue_args(epilogue: GemmEpilogue, stand_in: torch.Tensor) -> tuple[bool, int, torch.Tensor, tuple, int]:
    """(fused, activation code, top-k weights, their (token, route) strides, topk) as the Gluon GEMMs take the
    epilogue: without an activation code 0, without top-k weights `stand_in` (never read), strides 0 and topk 1."""
    fused = epilogue.activation is not None
    code = ACT_CODE[epilogue.activation] if fused else 0
    weights = epilogue.topk_weights_Tk
    if weights is None:
        return fused, code, stand_in, (0, 0), 1
    return fused, code, weights, tuple(weights.stride()), weights.shape[1]


# The tl.dot kernels' tile order, compiled as Gluon (the same Python body).
ws_tile_order = gluon.jit(tile_order.fn)


@gluon.constexpr_function
def rows_layout(block_k, dtype, num_warps):
    """Rows of 16-byte vectors of dtype: a warp covers min(32, row vectors) vectors of a row, warps go down the
    rows."""
    vec = 128 // dtype.primitive_bitwidth
    per_row = min(32, block_k // vec)
    return gl.BlockedLayout([1, vec], [32 // per_row, per_row], [num_warps, 1], [1, 0])


@gluon.jit
def ws_tile_loader(a_desc, a_ptr, stride_am, b_desc, a_bufs, b_bufs, ready, empty, sorted_ids_ptr, block_expert_ptr,
                num_post_padded_ptr, num_routes, N, K, b_rows_per_expert,
                FUSE_ACT: gl.constexpr, A_GATHER: gl.constexpr, A_ROW_DIV: gl.constexpr, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                WIDE: gl.constexpr = False):
    """The loader partition of the warp-specialized grouped GEMMs: walks the program's tiles (ws_tile_order) and
    fills a ring of STAGES shared-memory stages: B's tile through TMA (FUSE_ACT: BLOCK_N gate rows then the
    BLOCK_N up rows N further down; WIDE: 2 * BLOCK_N consecutive rows, a tile of 2 * BLOCK_N output columns), A's
    rows through TMA (sorted) or, A_GATHER, copied by this partition's warps with cp.async in 16-byte vectors
    (entry s of the block reads row s // A_ROW_DIV; padding entries read zeros). ready[s] completes when stage s
    has landed; empty[s] is waited for before the stage is refilled."""
    TILE_N: gl.constexpr = 2 * BLOCK_N if WIDE else BLOCK_N
    TWO_BOXES: gl.constexpr = FUSE_ACT or WIDE
    num_blocks = gl.load(num_post_padded_ptr) // BLOCK_M
    num_pid_n = gl.cdiv(N, TILE_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    second = N if FUSE_ACT else BLOCK_N  # B rows from the first box's to the second's
    b_bytes: gl.constexpr = (2 if TWO_BOXES else 1) * b_desc.block_type.nbytes
    a_bytes: gl.constexpr = BLOCK_M * BLOCK_K * b_desc.dtype.primitive_bitwidth // 8
    nbytes: gl.constexpr = b_bytes if A_GATHER else b_bytes + a_bytes
    VEC: gl.constexpr = 128 // b_desc.dtype.primitive_bitwidth
    gather_layout: gl.constexpr = rows_layout(BLOCK_K, b_desc.dtype, gl.num_warps())
    offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, gather_layout))
    i = 0
    for tile in range(gl.program_id(0), num_blocks * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = ws_tile_order(tile, num_blocks, num_pid_n, GROUP_M)
        expert = gl.load(block_expert_ptr + pid_m)
        b_row = expert * b_rows_per_expert + pid_n * TILE_N
        if A_GATHER:  # the block's A rows: route sid reads row sid // A_ROW_DIV; padding entries read zeros
            offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, gather_layout))
            sid = gl.load(sorted_ids_ptr + offs_m)
            row_start = gl.multiple_of((sid // A_ROW_DIV).to(gl.int64)[:, None] * stride_am, [1, VEC])
            a_rows = a_ptr + row_start + offs_k[None, :]
            row_ok = (sid < num_routes)[:, None]
        for kk in range(k_steps):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
            if A_GATHER:
                async_copy.async_copy_global_to_shared(a_bufs.index(s), a_rows + kk * BLOCK_K, mask=row_ok)
                # ready[s] also waits for this thread's copies; every thread counts itself in before the expect
                # below can complete the phase
                async_copy.mbarrier_arrive(ready.index(s))
                gl.thread_barrier()
            mbarrier.expect(ready.index(s), nbytes)
            if not A_GATHER:
                tma.async_copy_global_to_shared(a_desc, [pid_m * BLOCK_M, kk * BLOCK_K], ready.index(s),
                                                a_bufs.index(s))
            if TWO_BOXES:  # two boxes of BLOCK_N rows in one (2 * BLOCK_N, BLOCK_K) stage
                tma.async_copy_global_to_shared(b_desc, [b_row, kk * BLOCK_K], ready.index(s),
                                                b_bufs.index(s).slice(0, BLOCK_N))
                tma.async_copy_global_to_shared(b_desc, [b_row + second, kk * BLOCK_K], ready.index(s),
                                                b_bufs.index(s).slice(BLOCK_N, BLOCK_N))
            else:
                tma.async_copy_global_to_shared(b_desc, [b_row, kk * BLOCK_K], ready.index(s), b_bufs.index(s))
            i += 1


@gluon.jit
def ws_store_rows(c_ptr, out, offs_m, offs_n, sorted_ids_ptr, num_routes, N, stride_cm, C_SORTED: gl.constexpr):
    """Store out (entries offs_m of the sorted order x columns offs_n, in out's layout) at the route rows, or
    (C_SORTED) at the sorted rows; padding entries and columns past N are not written."""
    sid = gl.load(sorted_ids_ptr + offs_m)
    if C_SORTED:
        out_row = offs_m.to(gl.int64)
    else:
        out_row = sid.to(gl.int64)
    gl.store(c_ptr + out_row[:, None] * stride_cm + offs_n[None, :], out,
             mask=(sid < num_routes)[:, None] & (offs_n[None, :] < N))
