"""Grouped expert GEMM: C[row] = dequant(A[row]) @ dequant(B[expert]).T (* top-k weight), in Triton.

Shape legend:
  R routes (T * k)   T tokens   k topk   El local experts   Bt slots per expert (batched format)
  Ko reduction size (K for the first GEMM, N for the second)   No output columns
  S sorted-id capacity   Mb blocks of BLOCK_M rows   G = ceil(Ko / group_k) activation groups

Three row layouts (gemm_config.py) share one kernel:
  SortedRows (the standard format): rows come from sorted_ids_S (moe_align): block b of BLOCK_M entries
    belongs to local expert block_expert_Mb[b]; entry s < R reads A row s // a_row_div and writes C row s;
    s == R pads. Sorted A / C (a_sorted, c_sorted): the entry at position p of sorted_ids_S reads A row p /
    writes C row p instead, so a block's rows are contiguous (a first GEMM writing the intermediate in sorted
    order lets the second GEMM load it through a tensor descriptor); rows of padding entries are neither read
    as data nor written (their contents are unspecified).
  RouteRows: block r is route r alone, its expert read from the topk ids (through the expert map); no
    alignment, for a single token (k distinct experts).
  BatchedRows: A (El, Bt, Ko), C (El, Bt, No); expert e computes its first expert_num_tokens[e] rows.

Scales (float32, multiplied to dequantize; quant.py gives the layouts):
  A: NONE | TENSOR (1,) | EXPERT (El,) | ROW one per A row | GROUP one per A row and group_k columns
  B: NONE | TENSOR (El,) | CHANNEL (El, No, 1) | BLOCK (El, ceil(No/group_n), ceil(Ko/group_k))
GROUP goes with BLOCK and needs BLOCK_K to divide group_k, so each K tile has a single scale.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moe_modular.config import Activation
from moe_modular.kernels.act_and_mul import ACT_CODE, gated_act
from moe_modular.kernels.common import (
    FP8_WS_GROUP,
    FP8_WS_TILE,
    FP8_WS_WARPS,
    finite_abs,
    local_expert_of_route,
    scale_of,
    tile_order,
    to_fp8,
)
from moe_modular.kernels.host import cdiv, gluon_kernels_enabled, gpu_has_tma, pdl_launch
from moe_modular.kernels.gemm_config import (
    DEFAULT_LAUNCH,
    GEMM_FUSABLE_ACTIVATIONS,
    NO_SCALES,
    PLAIN_EPILOGUE,
    ROW_LAYOUTS,
    AScale,
    BatchedRows,
    BScale,
    GemmEpilogue,
    GemmScales,
    GemmTile,
    LaunchOptions,
    RouteRows,
    RowLayout,
    SortedRows,
)
from moe_modular.kernels.launcher import launch as launch_kernel

if TYPE_CHECKING:
    from triton.tools.tensor_descriptor import TensorDescriptor

# Scale-mode codes as the kernel sees them (compile-time constants).
A_NONE: tl.constexpr = tl.constexpr(0)
A_TENSOR: tl.constexpr = tl.constexpr(1)
A_EXPERT: tl.constexpr = tl.constexpr(2)
A_ROW: tl.constexpr = tl.constexpr(3)
A_GROUP: tl.constexpr = tl.constexpr(4)
B_NONE: tl.constexpr = tl.constexpr(0)
B_TENSOR: tl.constexpr = tl.constexpr(1)
B_CHANNEL: tl.constexpr = tl.constexpr(2)
B_BLOCK: tl.constexpr = tl.constexpr(3)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, topk_weights_ptr,
    sorted_ids_ptr, block_expert_ptr, num_post_padded_ptr, expert_num_tokens_ptr, expert_map_ptr,
    num_routes, slots, N, K, topk, num_local_experts, num_map_entries,
    stride_ae, stride_am, stride_ak,
    stride_be, stride_bn, stride_bk,
    stride_ce, stride_cm, stride_cn,
    stride_ase, stride_asm, stride_ask,
    stride_bse, stride_bsn, stride_bsk,
    stride_wt, stride_wk,
    c_scale_ptr, stride_csm, stride_csn,
    num_pid_m,
    A_ROW_DIV: tl.constexpr, BATCHED: tl.constexpr,
    A_SCALE: tl.constexpr, B_SCALE: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    MUL_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FUSE_ACT: tl.constexpr, ACTIVATION: tl.constexpr, B_TMA: tl.constexpr,
    A_SORTED: tl.constexpr, C_SORTED: tl.constexpr, A_TMA: tl.constexpr,
    PER_ROUTE: tl.constexpr, HAS_MAP: tl.constexpr, OUT_GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr, GDC: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # launched as a programmatic dependent: wait for the previous kernel's end before reading anything
        gdc_wait()
    if GDC:  # a GPU with grid dependency control: the next kernel may be placed once every program got here
        gdc_launch_dependents()
    num_pid_n = tl.cdiv(N, BLOCK_N)
    count = 0
    if PERSISTENT > 0:  # standard format: each program walks the tiles of the filled blocks, a grid's width apart
        num_blocks = tl.load(num_post_padded_ptr) // BLOCK_M
        for tile in tl.range(tl.program_id(0), num_blocks * num_pid_n, tl.num_programs(0),
                             flatten=PERSISTENT == 2):
            pid_m, pid_n = tile_order(tile, num_blocks, num_pid_n, GROUP_M)
            expert = tl.load(block_expert_ptr + pid_m)  # >= 0 for every block before num_post_padded
            _gemm_tile(
                a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, topk_weights_ptr, sorted_ids_ptr,
                c_scale_ptr, pid_m, pid_n, expert, count, num_routes, N, K, topk,
                stride_ae, stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_ce, stride_cm, stride_cn,
                stride_ase, stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk, stride_wt, stride_wk,
                stride_csm, stride_csn,
                A_ROW_DIV, BATCHED, A_SCALE, B_SCALE, GROUP_N, GROUP_K, MUL_WEIGHT, EVEN_K, DOT_PRECISION,
                FUSE_ACT, ACTIVATION, B_TMA, A_SORTED, C_SORTED, A_TMA, PER_ROUTE, OUT_GROUP,
                BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        pid_m, pid_n = tile_order(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
        if BATCHED:
            expert = tl.program_id(1)
            count = tl.load(expert_num_tokens_ptr + expert)
            if pid_m * BLOCK_M >= count:
                return
        else:
            if PER_ROUTE:  # block pid_m is route pid_m alone; block_expert_ptr holds the (T * k) topk ids
                expert, held = local_expert_of_route(block_expert_ptr, expert_map_ptr, pid_m, num_routes,
                                                      num_local_experts, num_map_entries, HAS_MAP)
                if not held:
                    return
            else:
                if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
                    return
                expert = tl.load(block_expert_ptr + pid_m)
                if expert < 0:
                    return
        _gemm_tile(
            a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, topk_weights_ptr, sorted_ids_ptr,
            c_scale_ptr, pid_m, pid_n, expert, count, num_routes, N, K, topk,
            stride_ae, stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_ce, stride_cm, stride_cn,
            stride_ase, stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk, stride_wt, stride_wk,
            stride_csm, stride_csn,
            A_ROW_DIV, BATCHED, A_SCALE, B_SCALE, GROUP_N, GROUP_K, MUL_WEIGHT, EVEN_K, DOT_PRECISION,
            FUSE_ACT, ACTIVATION, B_TMA, A_SORTED, C_SORTED, A_TMA, PER_ROUTE, OUT_GROUP,
            BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _gemm_tile(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, topk_weights_ptr, sorted_ids_ptr,
    c_scale_ptr, pid_m, pid_n, expert, count, num_routes, N, K, topk,
    stride_ae, stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_ce, stride_cm, stride_cn,
    stride_ase, stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk, stride_wt, stride_wk,
    stride_csm, stride_csn,
    A_ROW_DIV: tl.constexpr, BATCHED: tl.constexpr, A_SCALE: tl.constexpr, B_SCALE: tl.constexpr,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, MUL_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FUSE_ACT: tl.constexpr, ACTIVATION: tl.constexpr, B_TMA: tl.constexpr,
    A_SORTED: tl.constexpr, C_SORTED: tl.constexpr, A_TMA: tl.constexpr, PER_ROUTE: tl.constexpr,
    OUT_GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Row block pid_m times column block pid_n of expert `expert`'s weights, epilogue and store."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if BATCHED:
        row_mask = offs_m < count
        a_row = offs_m.to(tl.int64)
        c_row = offs_m.to(tl.int64)
        out_row = c_row
        a_e = expert.to(tl.int64)
    else:
        if PER_ROUTE:
            sid = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_routes)
        else:
            sid = tl.load(sorted_ids_ptr + offs_m)
        row_mask = sid < num_routes
        if A_SORTED:
            a_row = offs_m.to(tl.int64)
        else:
            a_row = (sid // A_ROW_DIV).to(tl.int64)
        c_row = sid.to(tl.int64)  # the route: its top-k weight
        if C_SORTED:
            out_row = offs_m.to(tl.int64)
        else:
            out_row = c_row
        a_e = 0
    e64 = expert.to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_bn = offs_n % N  # wrap instead of masking the B loads; the columns past N are not stored
    offs_k = tl.arange(0, BLOCK_K)
    if not A_TMA:
        a_ptrs = a_ptr + a_e * stride_ae + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak
    if not B_TMA:
        b_ptrs = b_ptr + e64 * stride_be + offs_bn[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    as_row = a_scale_ptr + a_e * stride_ase + a_row * stride_asm
    bs_col = b_scale_ptr + e64 * stride_bse + (offs_bn // GROUP_N) * stride_bsn
    if FUSE_ACT:  # the up rows' weight scales (block scales of rows N + n)
        bs_col_up = b_scale_ptr + e64 * stride_bse + ((N + offs_bn) // GROUP_N) * stride_bsn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FUSE_ACT:  # B rows [N, 2N) are the up half: a second accumulator, act(gate) * up at the end
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up_off = N * stride_bn
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        if A_TMA:  # boxes of A's contiguous block rows; columns past Ko read 0, masked rows are not stored
            if BATCHED:
                a = a_ptr.load([expert, pid_m * BLOCK_M, kt * BLOCK_K]).reshape(BLOCK_M, BLOCK_K)
            else:
                a = a_ptr.load([pid_m * BLOCK_M, kt * BLOCK_K])
        elif EVEN_K:
            a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=row_mask[:, None] & (offs_k[None, :] < K - kt * BLOCK_K), other=0.0)
        if B_TMA:  # (1, BLOCK_N, BLOCK_K) boxes of b (El, No, Ko): rows past No and columns past Ko read 0
            b = b_ptr.load([expert, pid_n * BLOCK_N, kt * BLOCK_K]).reshape(BLOCK_N, BLOCK_K).T
            if FUSE_ACT:
                b_up = b_ptr.load([expert, N + pid_n * BLOCK_N, kt * BLOCK_K]).reshape(BLOCK_N, BLOCK_K).T
        elif EVEN_K:
            b = tl.load(b_ptrs)
            if FUSE_ACT:
                b_up = tl.load(b_ptrs + up_off)
        else:
            k_left = K - kt * BLOCK_K
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            if FUSE_ACT:
                b_up = tl.load(b_ptrs + up_off, mask=offs_k[:, None] < k_left, other=0.0)
        if A_SCALE == A_GROUP:
            kg = (kt * BLOCK_K) // GROUP_K
            a_s = tl.load(as_row + kg * stride_ask, mask=row_mask, other=0.0)
            b_s = tl.load(bs_col + kg * stride_bsk)
            acc += tl.dot(a, b) * (a_s[:, None] * b_s[None, :])
            if FUSE_ACT:
                b_s_up = tl.load(bs_col_up + kg * stride_bsk)
                acc_up += tl.dot(a, b_up) * (a_s[:, None] * b_s_up[None, :])
        else:
            # fp8 on Hopper: 64-row and larger tiles use wgmma, whose fp8 accumulation is reduced-precision
            # across the K loop (Triton's default there, as in vLLM's kernels); promoting the sum every
            # 32 products (max_num_imprecise_acc) cost 1.1-3x in time (docs/perf_notes/2026-12-03-fp8-accumulation.md).
            if FUSE_ACT:
                acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if not A_TMA:
            a_ptrs += BLOCK_K * stride_ak
        if not B_TMA:
            b_ptrs += BLOCK_K * stride_bk

    if A_SCALE == A_TENSOR:
        acc = acc * tl.load(a_scale_ptr)
    elif A_SCALE == A_EXPERT:
        acc = acc * tl.load(a_scale_ptr + e64)
    elif A_SCALE == A_ROW:
        acc = acc * tl.load(as_row, mask=row_mask, other=0.0)[:, None]
    if B_SCALE == B_TENSOR:
        acc = acc * tl.load(b_scale_ptr + e64 * stride_bse)
    elif B_SCALE == B_CHANNEL:
        acc = acc * tl.load(b_scale_ptr + e64 * stride_bse + offs_bn * stride_bsn)[None, :]
    if FUSE_ACT:
        acc = gated_act(acc, acc_up, ACTIVATION)
    if OUT_GROUP > 0:  # fp8 with one scale per row and OUT_GROUP columns (BLOCK_N holds whole groups)
        NG: tl.constexpr = BLOCK_N // OUT_GROUP
        h = tl.reshape(tl.where(n_mask[None, :], acc, 0.0), (BLOCK_M, NG, OUT_GROUP))
        g_scale = scale_of(tl.max(finite_abs(h), axis=2))
        acc = tl.reshape(to_fp8(h, g_scale[:, :, None], c_ptr.dtype.element_ty), (BLOCK_M, BLOCK_N))
        offs_g = pid_n * NG + tl.arange(0, NG)
        tl.store(c_scale_ptr + out_row[:, None] * stride_csm + offs_g[None, :] * stride_csn, g_scale,
                 mask=row_mask[:, None] & (offs_g[None, :] * OUT_GROUP < N))
    if MUL_WEIGHT:
        w = tl.load(topk_weights_ptr + (c_row // topk) * stride_wt + (c_row % topk) * stride_wk,
                    mask=row_mask, other=0.0)
        acc = acc * w.to(tl.float32)[:, None]

    c_ptrs = c_ptr + a_e * stride_ce + out_row[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


WS_MIN_BLOCK_M = 64
WS_WARPS = (4, 8)  # one or two warpgroups
# Programs of a persistent launch in the interpreter (a few, so each walks several tiles).
INTERPRETER_PROGRAMS = 3


def resident_programs(device: torch.device) -> int:
    """Programs of a persistent launch: one per SM on a GPU."""
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _strides(t: Optional[torch.Tensor], n: int) -> tuple[int, ...]:
    if t is None:
        return (0,) * n
    s = tuple(t.stride())
    return (0,) * (n - len(s)) + s


def _descriptor(t: torch.Tensor, block: list[int]) -> Optional["TensorDescriptor"]:
    """A tensor descriptor over t with boxes of `block`, or None where TMA cannot address t (the
    kernel then loads it through pointers: same values, no TMA): a GPU before Hopper, or a layout
    whose last stride is not 1 or whose base / other strides are not 16-byte aligned."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if t.device.type == "cuda" and not gpu_has_tma(t.device):  # the interpreter emulates descriptors
        return None
    if not tma_addressable(t):
        return None
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block)


def tma_addressable(t: torch.Tensor) -> bool:
    """Whether t's layout suits TMA boxes (and 16-byte row vectors): last stride 1, base and other strides
    16-byte aligned."""
    item = t.element_size()
    *outer, last = t.stride()
    return last == 1 and not any((s * item) % 16 for s in outer) and t.data_ptr() % 16 == 0


def ws_applies(tile: GemmTile, launch: LaunchOptions, a: torch.Tensor, b_ENK: torch.Tensor, c: torch.Tensor,
               rows: RowLayout, scales: GemmScales, epilogue: GemmEpilogue) -> bool:
    """Whether moe_gemm runs with the warp-specialized kernel: launch.ws on a Hopper-class GPU, sorted rows,
    bf16 / fp16 operands and output of one dtype without scales, B and C rows contiguous, B 16-byte aligned (TMA
    boxes); A sorted (TMA boxes) or, gathered by the kernel, in whole K tiles with 16-byte aligned rows."""
    if not (launch.ws and isinstance(rows, SortedRows) and not scales.scaled and not epilogue.c_group
            and gpu_has_tma(a.device)):
        return False
    if not gluon_kernels_enabled(triton.__version__):
        return False
    if a.dtype not in (torch.bfloat16, torch.float16) or {b_ENK.dtype, c.dtype} != {a.dtype}:
        return False
    if not b_ENK.is_contiguous() or c.stride(-1) != 1 or not tma_addressable(b_ENK.view(-1, b_ENK.shape[-1])):
        return False
    return tma_addressable(a) and (rows.a_sorted or a.shape[-1] % tile.BLOCK_K == 0)


_FP8_WS_SCALES = {(AScale.GROUP, BScale.BLOCK): "BLOCK", (AScale.ROW, BScale.CHANNEL): "ROW"}


def fp8_ws_scales(tile: GemmTile, launch: LaunchOptions, a: torch.Tensor, b_ENK: torch.Tensor, c: torch.Tensor,
                  rows: RowLayout, scales: GemmScales, epilogue: GemmEpilogue) -> Optional[str]:
    """The Fp8Scales name moe_gemm runs with in the fp8 warp-specialized kernel, or None where it does not:
    launch.ws on a Hopper-class GPU, sorted rows, fp8 e4m3 A and B with 1 x 128 / 128 x 128 block scales or
    per-row / per-channel scales, the tile FP8_WS_TILE with FP8_WS_WARPS warps (without an activation also twice
    its BLOCK_N: a wide tile of two column halves), Ko a multiple of 128 (whole K
    steps), A and B TMA-addressable (sorted A loads by TMA, gathered A in 16-byte vectors), B contiguous, scales
    unit-strided along K; with an activation: block scales, N a multiple of 128 and the output quantized in
    1 x 128 groups; else a 16-bit or float32 output."""
    if not (launch.ws and isinstance(rows, SortedRows) and gpu_has_tma(a.device)):
        return None
    if not gluon_kernels_enabled(triton.__version__):
        return None
    fp8 = torch.float8_e4m3fn
    name = _FP8_WS_SCALES.get((scales.a_mode, scales.b_mode))
    if name is None or a.dtype != fp8 or b_ENK.dtype != fp8:
        return None
    bm, bn, bk = FP8_WS_TILE
    wide = epilogue.activation is None and tile.BLOCK_N == 2 * bn  # two halves of bn columns per tile
    if (tile.BLOCK_M, tile.BLOCK_K) != (bm, bk) or (tile.BLOCK_N != bn and not wide) or tile.num_warps != FP8_WS_WARPS:
        return None
    El, No, Ko = b_ENK.shape
    if Ko % FP8_WS_TILE[2] or (name == "BLOCK" and tuple(scales.group_shape) != (FP8_WS_GROUP, FP8_WS_GROUP)):
        return None
    if epilogue.activation is not None:
        if name != "BLOCK" or (No // 2) % FP8_WS_GROUP or c.dtype != fp8 or epilogue.c_group != FP8_WS_GROUP:
            return None
    elif c.dtype not in (torch.bfloat16, torch.float16, torch.float32) or epilogue.c_group:
        return None
    if not b_ENK.is_contiguous() or c.stride(-1) != 1 or not tma_addressable(b_ENK.view(-1, Ko)):
        return None
    if name == "BLOCK" and (scales.a.stride(-1) != 1 or scales.b.stride(-1) != 1):
        return None
    return name if tma_addressable(a) else None


def _a_scale_strides(scale: Optional[torch.Tensor], mode: AScale, batched: bool) -> tuple[int, int, int]:
    """(expert, row, group) strides of an A scale in `mode`."""
    if mode in (AScale.ROW, AScale.GROUP):
        if batched:  # (El, Bt, 1|G)
            return tuple(scale.stride())
        return (0,) + tuple(scale.stride())  # (rows, 1|G)
    return (0, 0, 0)


def _b_scale_strides(scale: Optional[torch.Tensor], mode: BScale) -> tuple[int, int, int]:
    """(expert, row, group) strides of a B scale in `mode`."""
    if mode is BScale.TENSOR:
        return (scale.stride(0), 0, 0)
    if mode is BScale.CHANNEL:
        return (scale.stride(0), scale.stride(1), 0)
    return _strides(scale, 3)


def _check(a: torch.Tensor, b_ENK: torch.Tensor, c: torch.Tensor, tile: GemmTile, launch: LaunchOptions,
           rows: RowLayout, scales: GemmScales, epilogue: GemmEpilogue) -> int:
    """Validate one launch's values against each other; returns No (C's columns)."""
    if not isinstance(rows, ROW_LAYOUTS):
        raise ValueError(f"rows ({type(rows).__name__}) must be one of {[t.__name__ for t in ROW_LAYOUTS]}")
    if isinstance(rows, RouteRows) and not rows.topk_ids_Tk.is_contiguous():
        raise ValueError(f"RouteRows.topk_ids_Tk must be contiguous, got strides {tuple(rows.topk_ids_Tk.stride())}")
    a_unpaired = (scales.a is None) != (scales.a_mode is AScale.NONE)
    if a_unpaired or (scales.b is None) != (scales.b_mode is BScale.NONE):
        name, t, mode = ("a", scales.a, scales.a_mode) if a_unpaired else ("b", scales.b, scales.b_mode)
        raise ValueError(f"GemmScales.{name} ({'None' if t is None else tuple(t.shape)}) must be given exactly "
                         f"where GemmScales.{name}_mode ({mode.name}) is not NONE")
    El, No, Ko = b_ENK.shape
    if epilogue.activation is not None:
        if epilogue.activation not in GEMM_FUSABLE_ACTIVATIONS:
            raise ValueError(f"GemmEpilogue.activation ({epilogue.activation!r}) must be one of "
                             f"{[a.value for a in GEMM_FUSABLE_ACTIVATIONS]}")
        modes = (scales.a_mode, scales.b_mode)
        if modes not in ((AScale.NONE, BScale.NONE), (AScale.GROUP, BScale.BLOCK)) or epilogue.topk_weights_Tk is not None:
            raise ValueError(f"GemmEpilogue.activation is for a first GEMM without top-k weights, unquantized or with "
                             f"group activation / block weight scales; got scales {modes[0].name} / {modes[1].name}")
        if No % 2 or c.shape[-1] != No // 2:
            raise ValueError(f"GemmEpilogue.activation needs b_ENK.size(1) ({No}) even and c with {No // 2} columns, "
                             f"got {c.shape[-1]}")
        No //= 2
    if a.shape[-1] != Ko:
        raise ValueError(f"reduction size of a ({a.shape[-1]}) must equal b_ENK.size(2) ({Ko})")
    c_group = epilogue.c_group
    if c_group:
        c_scale = epilogue.c_scale
        if epilogue.activation is None or c.dtype != torch.float8_e4m3fn or c_scale is None:
            raise ValueError(f"GemmEpilogue.c_group ({c_group}) needs an activation, an fp8 e4m3 c (got {c.dtype}) "
                             f"and c_scale")
        if c_group & (c_group - 1) or tile.BLOCK_N % c_group:
            raise ValueError(f"GemmEpilogue.c_group ({c_group}) must be a power of two dividing tile.BLOCK_N "
                             f"({tile.BLOCK_N})")
        want = (c.shape[0], cdiv(No, c_group))
        if tuple(c_scale.shape) != want or c_scale.dtype != torch.float32:
            raise ValueError(f"GemmEpilogue.c_scale ({tuple(c_scale.shape)}, {c_scale.dtype}) must be {want} float32")
    if scales.a_mode is AScale.GROUP and (scales.b_mode is not BScale.BLOCK or scales.group_shape[1] % tile.BLOCK_K):
        raise ValueError(f"group scales need block weight scales and BLOCK_K ({tile.BLOCK_K}) dividing group_k "
                         f"({scales.group_shape[1]})")
    if isinstance(rows, SortedRows):
        S = rows.sorted_ids_S.numel()
        for flag, on, t in (("a_sorted", rows.a_sorted, a), ("c_sorted", rows.c_sorted, c)):
            if on and t.shape[0] < S:
                raise ValueError(f"SortedRows.{flag} needs {flag[0]} with sorted_ids_S.numel() ({S}) rows, "
                                 f"got {t.shape[0]}")
    if tile.BLOCK_M & (tile.BLOCK_M - 1) or tile.BLOCK_N & (tile.BLOCK_N - 1) or tile.BLOCK_K & (tile.BLOCK_K - 1):
        raise ValueError(f"tile {tile} must have power-of-two blocks")
    if launch.ws and (tile.BLOCK_M < WS_MIN_BLOCK_M or tile.num_warps not in WS_WARPS):
        raise ValueError(f"LaunchOptions.ws needs BLOCK_M >= {WS_MIN_BLOCK_M} (a warpgroup's MMA rows) and num_warps "
                         f"in {WS_WARPS}, got BLOCK_M {tile.BLOCK_M}, num_warps {tile.num_warps}")
    return No


def moe_gemm(
    a: torch.Tensor,
    b_ENK: torch.Tensor,
    c: torch.Tensor,
    tile: GemmTile,
    rows: RowLayout,
    *,
    scales: GemmScales = NO_SCALES,
    epilogue: GemmEpilogue = PLAIN_EPILOGUE,
    launch: LaunchOptions = DEFAULT_LAUNCH,
) -> torch.Tensor:
    """Launch one grouped GEMM; returns c.

    rows (gemm_config.py): SortedRows, a (rows, Ko) and c (R, No) at the rows moe_align sorted; RouteRows, a block
      per route (a single token); BatchedRows, a (El, Bt, Ko) and c (El, Bt, No).
    b_ENK (El, No, Ko); scales as in the module docstring; epilogue: the gated activation (b_ENK then holds the
      gate rows then the up rows, c has No / 2 columns), the top-k weights, the output's group quantization.
    launch: how tiles are loaded and scheduled (tensor descriptors, persistent programs, programmatic dependent
      launch, the warp-specialized Hopper kernels of moe_gemm_ws.py / moe_gemm_ws_fp8.py where they cover the
      case); the values are the same under every option.
    """
    No = _check(a, b_ENK, c, tile, launch, rows, scales, epilogue)
    El, _, Ko = b_ENK.shape
    batched = isinstance(rows, BatchedRows)
    sorted_rows = isinstance(rows, SortedRows)
    per_route = isinstance(rows, RouteRows)
    if batched:
        slots = a.shape[1]
        num_pid_m = cdiv(slots, tile.BLOCK_M)
        grid = (num_pid_m * cdiv(No, tile.BLOCK_N), El)
        sa_e, sa_m, sa_k = a.stride()
        sc_e, sc_m, sc_n = c.stride()
    else:
        slots = 0
        num_pid_m = rows.topk_ids_Tk.numel() if per_route else rows.block_expert_Mb.numel()
        grid = (num_pid_m * cdiv(No, tile.BLOCK_N),)
        sa_e, (sa_m, sa_k) = 0, a.stride()
        sc_e, (sc_m, sc_n) = 0, c.stride()
    if grid[0] == 0:
        return c
    if launch.ws:
        if ws_applies(tile, launch, a, b_ENK, c, rows, scales, epilogue):
            from moe_modular.kernels.moe_gemm_ws import moe_gemm_ws

            return moe_gemm_ws(a, b_ENK, c, tile, rows, epilogue, tiles=grid[0], sms=resident_programs(a.device))
        fp8_scales = fp8_ws_scales(tile, launch, a, b_ENK, c, rows, scales, epilogue)
        if fp8_scales is not None:
            from moe_modular.kernels.moe_gemm_ws_fp8 import Fp8Scales, moe_gemm_ws_fp8

            return moe_gemm_ws_fp8(a, b_ENK, c, Fp8Scales[fp8_scales], scales, rows, epilogue, tiles=grid[0],
                                   sms=resident_programs(a.device), group_m=tile.GROUP_M,
                                   wide=tile.BLOCK_N == 2 * FP8_WS_TILE[1])
    act = epilogue.activation
    persistent = launch.persistent if sorted_rows else 0
    if persistent:  # no more programs than tiles, nor than the device runs at once
        grid = (min(grid[0], resident_programs(a.device)),)
    dummy = b_ENK
    a_scale, b_scale, (group_n, group_k) = scales.a, scales.b, scales.group_shape
    weights, c_scale, c_group = epilogue.topk_weights_Tk, epilogue.c_scale, epilogue.c_group
    expert_map = rows.expert_map_E if per_route else None
    is_fp32 = a.dtype == torch.float32 and b_ENK.dtype == torch.float32
    b_arg = _descriptor(b_ENK, [1, tile.BLOCK_N, tile.BLOCK_K]) if launch.b_tma else None
    a_arg = None
    if launch.a_tma and (batched or rows.a_sorted):
        a_arg = _descriptor(a, [1, tile.BLOCK_M, tile.BLOCK_K] if batched else [tile.BLOCK_M, tile.BLOCK_K])
    dependent = pdl_launch(bool(launch.pdl), a.device)
    launch_kernel(
        _moe_gemm_kernel, grid, a_arg if a_arg is not None else a, b_arg if b_arg is not None else b_ENK, c,
        a_scale if a_scale is not None else dummy,
        b_scale if b_scale is not None else dummy,
        weights if weights is not None else dummy,
        rows.sorted_ids_S if sorted_rows else dummy,
        rows.topk_ids_Tk if per_route else (rows.block_expert_Mb if sorted_rows else dummy),
        rows.num_post_padded if sorted_rows else dummy,
        rows.expert_num_tokens_El if batched else dummy,
        expert_map if expert_map is not None else dummy,
        0 if batched else rows.num_routes, slots, No, Ko, weights.shape[1] if weights is not None else 1, El,
        expert_map.numel() if expert_map is not None else 0,
        sa_e, sa_m, sa_k,
        *b_ENK.stride(),
        sc_e, sc_m, sc_n,
        *_a_scale_strides(a_scale, scales.a_mode, batched),
        *_b_scale_strides(b_scale, scales.b_mode),
        *(weights.stride() if weights is not None else (0, 0)),
        c_scale if c_scale is not None else dummy, *(c_scale.stride() if c_scale is not None else (0, 0)),
        num_pid_m,
        A_ROW_DIV=1 if batched else rows.a_row_div, BATCHED=batched,
        A_SCALE=scales.a_mode.value, B_SCALE=scales.b_mode.value, GROUP_N=group_n, GROUP_K=group_k,
        MUL_WEIGHT=weights is not None, EVEN_K=Ko % tile.BLOCK_K == 0,
        DOT_PRECISION="ieee" if is_fp32 else "tf32",
        FUSE_ACT=act is not None, ACTIVATION=ACT_CODE[act or Activation.SILU],
        B_TMA=b_arg is not None, A_SORTED=sorted_rows and rows.a_sorted, C_SORTED=sorted_rows and rows.c_sorted,
        A_TMA=a_arg is not None, PER_ROUTE=per_route, HAS_MAP=expert_map is not None, OUT_GROUP=c_group,
        BLOCK_M=tile.BLOCK_M, BLOCK_N=tile.BLOCK_N, BLOCK_K=tile.BLOCK_K, GROUP_M=tile.GROUP_M,
        PERSISTENT=persistent, GDC=gpu_has_tma(a.device), PDL=bool(dependent),
        num_warps=tile.num_warps, num_stages=tile.num_stages, **dependent,
    )
    return c


def moe_gemm_torch(
    a_rows: torch.Tensor,
    b_NK: torch.Tensor,
    a_scale_rows: Optional[torch.Tensor] = None,
    b_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Float32 oracle of one expert's tile: a_rows (m, Ko) dequantized with a_scale_rows (m, 1|Ko) (or
    None), times b_NK (No, Ko) dequantized with b_scale broadcast to (No, Ko) (or None), transposed."""
    a = a_rows.float() * (a_scale_rows.float() if a_scale_rows is not None else 1.0)
    b = b_NK.float() * (b_scale.float() if b_scale is not None else 1.0)
    return a @ b.t()
