"""Gather token rows into sorted-route order: out[p] = x[sorted_ids[p] // k] for the routes of p.

Shape legend: T tokens, k topk, K hidden, R = T * k routes, S sorted-id capacity (moe_align).
Padding entries (sorted id R) and entries past num_post_padded are not written (their rows keep
whatever they held). The output lets the first grouped GEMM read each block's rows contiguously
(moe_gemm a_sorted), through a tensor descriptor where the GPU has TMA.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_modular.kernels.host import cdiv, next_pow2
from moe_modular.kernels.launcher import launch


@triton.jit
def _sort_rows_kernel(x_ptr, out_ptr, sorted_ids_ptr, num_post_padded_ptr, num_routes, K, topk,
                      stride_xm, stride_xk, stride_om, stride_ok,
                      BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr):
    first = tl.program_id(0) * BLOCK_S
    if first >= tl.load(num_post_padded_ptr):
        return
    offs_s = first + tl.arange(0, BLOCK_S)
    sid = tl.load(sorted_ids_ptr + offs_s)
    rows = sid < num_routes
    src = (sid // topk).to(tl.int64)
    dst = offs_s.to(tl.int64)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    m = rows[:, None] & (offs_k[None, :] < K)
    v = tl.load(x_ptr + src[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=m)
    tl.store(out_ptr + dst[:, None] * stride_om + offs_k[None, :] * stride_ok, v, mask=m)


def sort_rows(
    x_TK: torch.Tensor,
    sorted_ids_S: torch.Tensor,
    num_post_padded: torch.Tensor,
    topk: int,
    out_SK: torch.Tensor,
) -> torch.Tensor:
    """out_SK[p] = x_TK[sorted_ids_S[p] // topk] where sorted_ids_S[p] < T * topk and p < num_post_padded
    (sorted_ids_S, num_post_padded from moe_align); other rows are left as they were. Returns out_SK."""
    T, K = x_TK.shape
    S = sorted_ids_S.numel()
    if out_SK.shape[0] < S or out_SK.shape[1] != K or out_SK.dtype != x_TK.dtype:
        raise ValueError(f"out_SK ({tuple(out_SK.shape)}, {out_SK.dtype}) must be at least ({S}, {K}) "
                         f"of {x_TK.dtype}")
    if S == 0 or T == 0:
        return out_SK
    block_k = min(next_pow2(K), 512 if x_TK.is_cuda else 256)
    block_s = max(1, min(next_pow2(S), 4096 // block_k))
    launch(_sort_rows_kernel, (cdiv(S, block_s), cdiv(K, block_k)),
           x_TK, out_SK, sorted_ids_S, num_post_padded, T * topk, K, topk, *x_TK.stride(), *out_SK.stride(),
           BLOCK_S=block_s, BLOCK_K=block_k, num_warps=4)
    return out_SK


def sort_rows_torch(x_TK: torch.Tensor, sorted_ids_S: torch.Tensor, num_post_padded: int, topk: int) -> dict:
    """Oracle: {p: x_TK[sorted_ids_S[p] // topk]} for the route entries p < num_post_padded."""
    R = x_TK.shape[0] * topk
    return {p: x_TK[int(s) // topk] for p, s in enumerate(sorted_ids_S[:num_post_padded].tolist()) if s < R}
