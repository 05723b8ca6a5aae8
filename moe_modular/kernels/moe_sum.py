"""Top-k reduction: out[t] = sum over the held routes j of y[t * k + j].

Shape legend: T tokens, k topk, K hidden, R = T * k routes, E global experts, El local experts.
A route is held when its local expert (topk id, mapped through expert_map when given) is in
[0, El); routes not held contribute nothing, whatever their rows of y contain.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from moe_modular.kernels.host import cdiv, next_pow2, pdl_launch
from moe_modular.kernels.launcher import launch
from moe_modular.routing import local_route_ids

# Programs a launch aims for on a GPU: small batches are split into blocks of down to MIN_BLOCK elements
# so that enough loads are in flight (a handful of programs looping over the routes is latency-bound).
TARGET_PROGRAMS = 256
MIN_BLOCK = 128
MAX_BLOCK = 4096


@triton.jit
def _moe_sum_kernel(y_ptr, out_ptr, topk_ids_ptr, expert_map_ptr, T, K, num_local_experts, num_map_entries,
                    stride_ym, stride_yk, stride_om, stride_ok, stride_it, stride_ik,
                    HAS_MAP: tl.constexpr, TOPK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                    PDL: tl.constexpr):
    if PDL:  # placed while the kernel before (the one writing y) finishes: wait for its end
        gdc_wait()
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    t_mask = offs_t < T
    k_mask = offs_k < K
    t64 = offs_t.to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    for j in tl.static_range(TOPK):  # unrolled: the k route loads are independent and overlap
        ids = tl.load(topk_ids_ptr + t64 * stride_it + j * stride_ik, mask=t_mask, other=-1).to(tl.int32)
        if HAS_MAP:
            ids = tl.load(expert_map_ptr + ids, mask=t_mask & (ids >= 0) & (ids < num_map_entries),
                          other=-1).to(tl.int32)
        held = t_mask & (ids >= 0) & (ids < num_local_experts)
        m = held[:, None] & k_mask[None, :]
        y = tl.load(y_ptr + (t64 * TOPK + j)[:, None] * stride_ym + offs_k[None, :] * stride_yk, mask=m, other=0.0)
        acc += tl.where(m, y.to(tl.float32), 0.0)
    tl.store(out_ptr + t64[:, None] * stride_om + offs_k[None, :] * stride_ok,
             acc.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & k_mask[None, :])


def moe_sum(
    y_RK: torch.Tensor,
    topk_ids_Tk: torch.Tensor,
    out_TK: torch.Tensor,
    num_local_experts: int,
    expert_map_E: Optional[torch.Tensor] = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Sum y_RK (R, K) route rows into out_TK (T, K) (any float dtypes; float32 accumulation).

    topk_ids_Tk (T, k) int: local ids, or global ids with expert_map_E (E,) int32 (-1 not held; an id outside
    [0, E) is not held either).
    pdl (a GPU of compute capability >= 9; ignored elsewhere): launched as a programmatic dependent of the
    kernel before it, whose end its programs wait for before they read anything.
    """
    T, k = topk_ids_Tk.shape
    K = out_TK.shape[1]
    if y_RK.shape[0] < T * k or y_RK.shape[1] != K:
        raise ValueError(f"y_RK shape ({tuple(y_RK.shape)}) must be at least ({T * k}, {K})")
    if T == 0:
        return out_TK
    block_t, block_k, warps = sum_blocks(T, K, out_TK.is_cuda)
    grid = (cdiv(T, block_t), cdiv(K, block_k))
    has_map = expert_map_E is not None
    dependent = pdl_launch(pdl, out_TK.device)
    launch(_moe_sum_kernel, grid, y_RK, out_TK, topk_ids_Tk, expert_map_E if has_map else topk_ids_Tk, T, K,
           num_local_experts, expert_map_E.numel() if has_map else 0, *y_RK.stride(), *out_TK.stride(), *topk_ids_Tk.stride(),
           HAS_MAP=has_map, TOPK=k, BLOCK_T=block_t, BLOCK_K=block_k, PDL=bool(dependent), num_warps=warps,
           **dependent)
    return out_TK


def sum_blocks(T: int, K: int, gpu: bool) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_K, num_warps) of one launch: blocks of up to MAX_BLOCK elements, smaller (down to
    MIN_BLOCK) on a GPU until the launch has TARGET_PROGRAMS programs; the interpreter (CPU) runs the
    fewest programs fastest."""
    elems = MAX_BLOCK
    if gpu:
        while elems > MIN_BLOCK and cdiv(T * K, elems) < TARGET_PROGRAMS:
            elems //= 2
    block_k = min(next_pow2(K), elems, 1024 if gpu else 256)
    block_t = max(1, min(next_pow2(T), elems // block_k))
    warps = max(1, min(4, block_t * block_k // 256))
    return block_t, block_k, warps


def moe_sum_torch(
    y_RK: torch.Tensor,
    topk_ids_Tk: torch.Tensor,
    num_local_experts: int,
    expert_map_E: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Float32 oracle of moe_sum: (T, K)."""
    T, k = topk_ids_Tk.shape
    held = local_route_ids(topk_ids_Tk, expert_map_E, num_local_experts) >= 0
    y = y_RK[: T * k].float().reshape(T, k, -1)
    return torch.where(held.unsqueeze(-1), y, torch.zeros_like(y)).sum(dim=1)
