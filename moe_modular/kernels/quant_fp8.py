"""fp8 e4m3 activation quantization in Triton: the GPU path of quant.quantize_activations.

Shape legend: T rows (tokens), K columns (hidden), G = ceil(K / group) quantization groups.

Same numbers as the torch path (scale = max(amax, 1e-12) / 448 and x / scale both correctly
rounded, clamped to +-448, rounded to nearest even), so the two are interchangeable bit for bit:
  TOKEN   one scale per row, (T, 1)
  GROUP   one scale per row and group of columns, (T, G); the last group may be partial
  STATIC  the given (1,) scale
  DYNAMIC one scale for the whole tensor, (1,), from its amax (a first pass takes the amax with
          atomic max, which does not depend on the order of the updates)
"""
from __future__ import annotations

import enum
from typing import Optional

import torch
import triton
import triton.language as tl

from moe_modular.kernels.common import finite_abs, scale_of, to_fp8
from moe_modular.fp8_format import FP8_DTYPE
from moe_modular.kernels.host import cdiv, next_pow2
from moe_modular.kernels.launcher import launch


class Fp8Scaling(enum.Enum):
    """Where the scales of quantize_fp8 come from."""

    TOKEN = 0
    GROUP = 1
    STATIC = 2
    DYNAMIC = 3


_TOKEN: tl.constexpr = tl.constexpr(0)
_GROUP: tl.constexpr = tl.constexpr(1)
_STATIC: tl.constexpr = tl.constexpr(2)
_DYNAMIC: tl.constexpr = tl.constexpr(3)


@triton.jit
def _quant_fp8_kernel(
    x_ptr, out_ptr, scale_ptr, amax_ptr, T, K,
    stride_xm, stride_xk, stride_om, stride_ok, stride_sm, stride_sg,
    SCALING: tl.constexpr, AMAX_PASS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = rows < T
    rows64 = rows.to(tl.int64)
    x_rows = x_ptr + rows64[:, None] * stride_xm
    o_rows = out_ptr + rows64[:, None] * stride_om

    if SCALING == _TOKEN or AMAX_PASS:
        amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            m = valid[:, None] & (offs[None, :] < K)
            x = tl.load(x_rows + offs[None, :] * stride_xk, mask=m, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(finite_abs(x), axis=1))
        if AMAX_PASS:
            tl.atomic_max(amax_ptr, tl.max(amax, axis=0))
            return
        row_scale = scale_of(amax)
        tl.store(scale_ptr + rows64 * stride_sm, row_scale, mask=valid)
    if SCALING == _STATIC:
        tensor_scale = tl.load(scale_ptr)
    if SCALING == _DYNAMIC:
        tensor_scale = scale_of(tl.load(amax_ptr))
        if tl.program_id(0) == 0:
            tl.store(scale_ptr, tensor_scale)

    if SCALING == _GROUP:  # one group per program along grid axis 1; BLOCK_K is the group size
        g = tl.program_id(1)
        offs = g * BLOCK_K + tl.arange(0, BLOCK_K)
        m = valid[:, None] & (offs[None, :] < K)
        x = tl.load(x_rows + offs[None, :] * stride_xk, mask=m, other=0.0).to(tl.float32)
        group_scale = scale_of(tl.max(finite_abs(x), axis=1))
        tl.store(scale_ptr + rows64 * stride_sm + g * stride_sg, group_scale, mask=valid)
        tl.store(o_rows + offs[None, :] * stride_ok, to_fp8(x, group_scale[:, None], out_ptr.dtype.element_ty),
                 mask=m)
    else:
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            m = valid[:, None] & (offs[None, :] < K)
            x = tl.load(x_rows + offs[None, :] * stride_xk, mask=m, other=0.0).to(tl.float32)
            if SCALING == _TOKEN:
                y = to_fp8(x, row_scale[:, None], out_ptr.dtype.element_ty)
            else:
                y = to_fp8(x, tensor_scale, out_ptr.dtype.element_ty)
            tl.store(o_rows + offs[None, :] * stride_ok, y, mask=m)


def quantize_fp8(
    x_TK: torch.Tensor,
    scaling: Fp8Scaling,
    *,
    group_size: int = 128,
    static_scale: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x_TK (T, K) bf16/fp16/fp32 to fp8 e4m3; returns (xq (T, K), float32 scale) with the
    scale (T, 1) for TOKEN, (T, ceil(K / group_size)) for GROUP, (1,) for STATIC and DYNAMIC."""
    if x_TK.dim() != 2:
        raise ValueError(f"x_TK must be 2-D (T, K), got shape {tuple(x_TK.shape)}")
    T, K = x_TK.shape
    dev = x_TK.device
    out = torch.empty((T, K), dtype=FP8_DTYPE, device=dev)
    amax = x_TK  # unused pointer unless DYNAMIC
    block_k = min(next_pow2(K), 1024 if x_TK.is_cuda else 128)  # columns per step of a row sweep
    if scaling is Fp8Scaling.GROUP:
        if group_size < 16 or group_size & (group_size - 1):
            raise ValueError(f"group_size ({group_size}) must be a power of two >= 16")
        scale = torch.empty((T, cdiv(K, group_size)), dtype=torch.float32, device=dev)
        block_k = group_size
    elif scaling is Fp8Scaling.TOKEN:
        scale = torch.empty((T, 1), dtype=torch.float32, device=dev)
    elif scaling is Fp8Scaling.STATIC:
        if static_scale is None or static_scale.numel() != 1:
            raise ValueError("quantize_fp8 with static scaling needs static_scale with one element")
        scale = static_scale.to(device=dev, dtype=torch.float32).reshape(1)
    else:
        scale = torch.ones(1, dtype=torch.float32, device=dev)
        amax = torch.zeros(1, dtype=torch.float32, device=dev)
    if T == 0 or K == 0:
        return out, scale
    if scaling is Fp8Scaling.GROUP:  # a program per (row block, group): every SM busy at small T
        block_r = min(next_pow2(T), 16)
        grid = (cdiv(T, block_r), cdiv(K, group_size))
    else:
        block_r = max(1, min(next_pow2(T), 4096 // block_k)) if x_TK.is_cuda else 16
        grid = (cdiv(T, block_r),)
    s_m, s_g = (scale.stride(0), scale.stride(1)) if scale.dim() == 2 else (0, 0)
    args = (x_TK, out, scale, amax, T, K, *x_TK.stride(), *out.stride(), s_m, s_g)
    meta = dict(SCALING=scaling.value, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4)
    if scaling is Fp8Scaling.DYNAMIC:
        launch(_quant_fp8_kernel, grid, *args, AMAX_PASS=True, **meta)
    launch(_quant_fp8_kernel, grid, *args, AMAX_PASS=False, **meta)
    return out, scale
