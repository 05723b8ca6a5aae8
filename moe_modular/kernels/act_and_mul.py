"""Gated activation (act(gate) * up) over the w1 output, optionally fused with fp8 quantization. Its float32
oracle is moe_modular.activation.act_and_mul_torch (torch only: the CPU path and the oracle need no Triton).

Shape legend: T rows, N2 = 2 * N columns of the w1 output, N intermediate size, R rows of a
Triton launch (routes, or El * Bt batched slots), El local experts, Bt slots per expert,
G = ceil(N / group) quantization groups.
"""
from __future__ import annotations

import enum
from typing import Optional

import torch
import triton
import triton.language as tl

from moe_modular.activation import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from moe_modular.config import Activation
from moe_modular.fp8_format import FP8_DTYPE
from moe_modular.kernels.common import (
    ACT_GELU,
    ACT_SILU,
    ACT_SWIGLU_OAI,
    finite_abs,
    local_expert_of_route,
    scale_of,
    to_fp8,
)
from moe_modular.kernels.gemm_config import IntermediateQuant
from moe_modular.kernels.host import cdiv, next_pow2
from moe_modular.kernels.launcher import launch

TARGET_PROGRAMS = 4096  # a GPU launch spreads smaller batches over at least this many programs (act_blocks)

# ---- Triton -------------------------------------------------------------------------


class RowMode(enum.Enum):
    """Which rows of the launch hold data, and which local expert each belongs to."""

    ALL = 0  # every row, expert 0
    ROUTES = 1  # row r is route r of topk_ids; held when its (mapped) local id is in [0, El)
    BATCHED = 2  # row r is slot r % Bt of expert r // Bt; held when below expert_num_tokens


# moe_modular.config.Activation -> the kernels' activation code (kernels/common.py)
ACT_CODE: dict[Activation, int] = {Activation.SILU: ACT_SILU.value, Activation.GELU: ACT_GELU.value,
                                   Activation.SWIGLU_OAI: ACT_SWIGLU_OAI.value}
_Q_CODE: dict[IntermediateQuant, int] = {IntermediateQuant.NONE: 0, IntermediateQuant.TENSOR_STATIC: 1,
                                         IntermediateQuant.TENSOR_DYNAMIC: 3, IntermediateQuant.TOKEN: 4,
                                         IntermediateQuant.GROUP: 5}
_Q_AMAX_PASS = 2  # the first pass of TENSOR_DYNAMIC: per-expert amax only

_Q_NONE: tl.constexpr = tl.constexpr(0)
_Q_STATIC: tl.constexpr = tl.constexpr(1)
_Q_AMAX: tl.constexpr = tl.constexpr(2)
_Q_EXPERT: tl.constexpr = tl.constexpr(3)
_Q_TOKEN: tl.constexpr = tl.constexpr(4)
_Q_GROUP: tl.constexpr = tl.constexpr(5)
_ROWS_ROUTES: tl.constexpr = tl.constexpr(1)
_ROWS_BATCHED: tl.constexpr = tl.constexpr(2)
_OAI_ALPHA: tl.constexpr = tl.constexpr(SWIGLU_OAI_ALPHA)
_OAI_LIMIT: tl.constexpr = tl.constexpr(SWIGLU_OAI_LIMIT)


@triton.jit
def _act_tile(x_row_ptrs, offs_n, mask, N, stride_xn, ACTIVATION: tl.constexpr):
    """act(gate) * up in float32 for columns offs_n of the rows at x_row_ptrs (BLOCK_R, 1)."""
    if ACTIVATION == ACT_SWIGLU_OAI:
        g = tl.load(x_row_ptrs + (2 * offs_n)[None, :] * stride_xn, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_row_ptrs + (2 * offs_n + 1)[None, :] * stride_xn, mask=mask, other=0.0).to(tl.float32)
        g = tl.minimum(g, _OAI_LIMIT)
        u = tl.minimum(tl.maximum(u, -_OAI_LIMIT), _OAI_LIMIT)
        h = (u + 1.0) * g / (1.0 + tl.exp(g * (-_OAI_ALPHA)))  # tensor first: some interpreters mis-type constexpr * tensor
    else:
        g = tl.load(x_row_ptrs + offs_n[None, :] * stride_xn, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_row_ptrs + (N + offs_n)[None, :] * stride_xn, mask=mask, other=0.0).to(tl.float32)
        h = gated_act(g, u, ACTIVATION)
    return h


@triton.jit
def gated_act(g, u, ACTIVATION: tl.constexpr):
    """act(g) * u in float32 for SiLU or GELU (the contiguous gate | up layout)."""
    if ACTIVATION == ACT_SILU:
        h = g / (1.0 + tl.exp(-g)) * u
    else:
        h = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476)) * u
    return h


@triton.jit
def _act_and_mul_kernel(
    x_ptr, out_ptr, scale_ptr, amax_ptr, topk_ids_ptr, expert_map_ptr, expert_num_tokens_ptr,
    num_rows, N, slots, num_local_experts, num_map_entries, cols,
    stride_xm, stride_xn, stride_om, stride_on, stride_sm, stride_sn,
    ACTIVATION: tl.constexpr, ROW_MODE: tl.constexpr, HAS_MAP: tl.constexpr, QUANT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Program (pid, pid_c): BLOCK_R rows x the columns [c0, c1), `cols` (a multiple of BLOCK_N) wide,
    # walked BLOCK_N at a time; per-token quantization launches whole rows (cols >= N).
    pid = tl.program_id(0)
    c0 = tl.program_id(1) * cols
    c1 = tl.minimum(c0 + cols, N)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    if ROW_MODE == _ROWS_ROUTES:
        expert, valid = local_expert_of_route(topk_ids_ptr, expert_map_ptr, rows, num_rows, num_local_experts,
                                               num_map_entries, HAS_MAP)
    elif ROW_MODE == _ROWS_BATCHED:
        in_range = rows < num_rows
        expert = tl.where(in_range, rows // slots, 0)
        count = tl.load(expert_num_tokens_ptr + expert, mask=in_range, other=0)
        valid = in_range & ((rows % slots) < count)
    else:
        expert = tl.zeros((BLOCK_R,), dtype=tl.int32)
        valid = rows < num_rows
    rows64 = rows.to(tl.int64)
    x_rows = x_ptr + rows64[:, None] * stride_xm
    o_rows = out_ptr + rows64[:, None] * stride_om

    if QUANT == _Q_AMAX or QUANT == _Q_TOKEN:
        amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for n0 in range(c0, c1, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            m = valid[:, None] & (offs_n[None, :] < N)
            h = _act_tile(x_rows, offs_n, m, N, stride_xn, ACTIVATION)
            amax = tl.maximum(amax, tl.max(tl.where(m, finite_abs(h), 0.0), axis=1))
        if QUANT == _Q_AMAX:
            tl.atomic_max(amax_ptr + expert, amax, mask=valid)
            return
        row_scale = scale_of(amax)
        tl.store(scale_ptr + rows64 * stride_sm, row_scale, mask=valid)
    if QUANT == _Q_STATIC:
        tensor_scale = tl.load(scale_ptr)
    if QUANT == _Q_EXPERT:
        expert_scale = scale_of(tl.load(amax_ptr + expert, mask=valid, other=1.0))
        # the first column block stores the scale (the mask built as a row vector: some interpreters refuse a
        # scalar mask operand)
        tl.store(scale_ptr + expert, expert_scale, mask=valid & ((tl.zeros_like(expert) + c0) == 0))

    for n0 in range(c0, c1, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        m = valid[:, None] & (offs_n[None, :] < N)
        h = _act_tile(x_rows, offs_n, m, N, stride_xn, ACTIVATION)
        if QUANT == _Q_NONE:
            y = h.to(out_ptr.dtype.element_ty)
        elif QUANT == _Q_STATIC:
            y = to_fp8(h, tensor_scale, out_ptr.dtype.element_ty)
        elif QUANT == _Q_EXPERT:
            y = to_fp8(h, expert_scale[:, None], out_ptr.dtype.element_ty)
        elif QUANT == _Q_TOKEN:
            y = to_fp8(h, row_scale[:, None], out_ptr.dtype.element_ty)
        else:  # _Q_GROUP: BLOCK_N is the group size
            group_scale = scale_of(tl.max(tl.where(m, finite_abs(h), 0.0), axis=1))
            tl.store(scale_ptr + rows64 * stride_sm + (n0 // BLOCK_N) * stride_sn, group_scale, mask=valid)
            y = to_fp8(h, group_scale[:, None], out_ptr.dtype.element_ty)
        tl.store(o_rows + offs_n[None, :] * stride_on, y, mask=m)


def act_blocks(R: int, N: int, quant: IntermediateQuant, group_size: int, gpu: bool) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_N, cols) of one launch: programs of BLOCK_R rows x `cols` columns (a multiple of
    BLOCK_N; BLOCK_N is the group for GROUP quantization). Per-token quantization needs whole rows
    (cols >= N). On a GPU, where few rows would leave most of it idle, a program's columns and then its
    rows are halved until the launch has TARGET_PROGRAMS programs; the interpreter (CPU) runs the
    fewest programs fastest."""
    if quant is IntermediateQuant.GROUP:
        block_n = group_size
    else:
        block_n = min(next_pow2(N), 1024 if gpu else 128)
    block_r = max(1, min(next_pow2(R), 4096 // block_n)) if gpu else 16
    units = cdiv(N, block_n)  # BLOCK_N-wide column blocks per program
    if gpu:
        whole_rows = quant is IntermediateQuant.TOKEN
        while cdiv(R, block_r) * cdiv(cdiv(N, block_n), units) < TARGET_PROGRAMS:
            if units > 1 and not whole_rows:
                units = cdiv(units, 2)
            elif block_r > 1:
                block_r //= 2
            else:
                break
    return block_r, block_n, units * block_n


def act_and_mul(
    x_RN2: torch.Tensor,
    activation: Activation,
    out_RN: Optional[torch.Tensor] = None,
    *,
    quant: IntermediateQuant = IntermediateQuant.NONE,
    scale: Optional[torch.Tensor] = None,
    amax_El: Optional[torch.Tensor] = None,
    group_size: int = 128,
    row_mode: RowMode = RowMode.ALL,
    topk_ids_Tk: Optional[torch.Tensor] = None,
    expert_map_E: Optional[torch.Tensor] = None,
    num_local_experts: int = 1,
    expert_num_tokens_El: Optional[torch.Tensor] = None,
    slots: int = 1,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Triton act_and_mul over x_RN2 (R, 2N) bf16/fp16/fp32 (rows with unit column stride).

    out_RN (R, N): the activation dtype for quant NONE, else fp8 e4m3 (allocated when None).
    scale: TENSOR_STATIC: the given (1,) float32 scale; TENSOR_DYNAMIC: (El,) written, one per local
      expert; TOKEN: (R, 1) written; GROUP: (R, ceil(N / group_size)) written.
    amax_El: (El,) float32 scratch for TENSOR_DYNAMIC (zeroed here).
    row_mode: which rows hold data (RowMode); ROUTES reads topk_ids_Tk (T, k) contiguous, R = T*k
      (+ expert_map_E), BATCHED reads expert_num_tokens_El (El,) with R = El * slots. Rows without
      data are neither read nor written.
    Returns (out_RN, scale).
    """
    R, N2 = x_RN2.shape
    if N2 % 2:
        raise ValueError(f"x_RN2.size(1) ({N2}) must be even (gate and up halves)")
    N = N2 // 2
    code = ACT_CODE.get(activation)
    if code is None:
        raise ValueError(f"activation ({activation!r}) must be one of {[a.value for a in ACT_CODE]}")
    fp8 = quant is not IntermediateQuant.NONE
    if out_RN is None:
        out_RN = torch.empty((R, N), dtype=FP8_DTYPE if fp8 else x_RN2.dtype, device=x_RN2.device)
    if fp8 and out_RN.dtype != FP8_DTYPE:
        raise ValueError(f"out_RN dtype ({out_RN.dtype}) must be {FP8_DTYPE} for quant {quant.value}")
    if scale is None and fp8:
        if quant is IntermediateQuant.TENSOR_STATIC:
            raise ValueError("act_and_mul quant tensor-static needs the (1,) scale")
        shape = {IntermediateQuant.TENSOR_DYNAMIC: (num_local_experts,), IntermediateQuant.TOKEN: (R, 1),
                 IntermediateQuant.GROUP: (R, cdiv(N, group_size))}[quant]
        scale = torch.empty(shape, dtype=torch.float32, device=x_RN2.device)
    if quant is IntermediateQuant.GROUP and (group_size < 16 or group_size & (group_size - 1)):
        raise ValueError(f"group_size ({group_size}) must be a power of two >= 16")
    if R == 0:
        return out_RN, scale
    if row_mode is RowMode.ROUTES:
        if topk_ids_Tk is None or topk_ids_Tk.numel() != R:
            raise ValueError(f"row_mode routes needs topk_ids_Tk with R ({R}) elements")
        topk_ids_Tk = topk_ids_Tk if topk_ids_Tk.is_contiguous() else topk_ids_Tk.contiguous()
    if row_mode is RowMode.BATCHED and (expert_num_tokens_El is None or R != num_local_experts * slots):
        raise ValueError(f"row_mode batched needs expert_num_tokens_El and R ({R}) == El * slots")
    block_rows, block_n, cols = act_blocks(R, N, quant, group_size, x_RN2.is_cuda)
    dummy = x_RN2
    sc = scale if scale is not None else dummy
    ss = (scale.stride(0), scale.stride(1)) if (scale is not None and scale.dim() == 2) else (0, 0)
    grid = (cdiv(R, block_rows), cdiv(N, cols))
    common = dict(ACTIVATION=code, ROW_MODE=row_mode.value, HAS_MAP=expert_map_E is not None,
                  BLOCK_R=block_rows, BLOCK_N=block_n, num_warps=4)
    ptrs = (topk_ids_Tk if topk_ids_Tk is not None else dummy, expert_map_E if expert_map_E is not None else dummy,
            expert_num_tokens_El if expert_num_tokens_El is not None else dummy)
    sizes = (R, N, slots, num_local_experts, expert_map_E.numel() if expert_map_E is not None else 0, cols,
             x_RN2.stride(0), x_RN2.stride(1), out_RN.stride(0), out_RN.stride(1),
             *ss)
    if quant is IntermediateQuant.TENSOR_DYNAMIC:
        if amax_El is None:
            amax_El = torch.empty(num_local_experts, dtype=torch.float32, device=x_RN2.device)
        amax_El.zero_()
        launch(_act_and_mul_kernel, grid, x_RN2, out_RN, sc, amax_El, *ptrs, *sizes, QUANT=_Q_AMAX_PASS, **common)
    launch(_act_and_mul_kernel, grid, x_RN2, out_RN, sc, amax_El if amax_El is not None else dummy, *ptrs, *sizes,
           QUANT=_Q_CODE[quant], **common)
    return out_RN, scale
