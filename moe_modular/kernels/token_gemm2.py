"""The second GEMM of a single token with the top-k sum in the same kernel (GEMV form).

Shape legend: k topk (the token's routes), Ni intermediate, K hidden, El local experts, E global experts.

    out (1, K) = sum over the held routes j of weight[j] * (inter[j] (Ni,) @ w2[expert of j] (K, Ni).T)

One token has k routes to k distinct experts, each a matrix-vector product that streams its expert's
w2 once. Each program owns BLOCK_N output columns and walks every route's K steps in one flattened
loop (so the weight loads of the next route are in flight while this one finishes), summing in
float32 and writing the output once: no (k, K) intermediate, no separate top-k sum kernel and its
launch. A route is held when its local expert (topk id, mapped through expert_map when given) is in
[0, El); routes not held contribute nothing (their loads are masked off). Unquantized operands only.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from moe_modular.kernels.host import cdiv, pdl_launch
from moe_modular.kernels.launcher import launch

TOKEN_GEMM2_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _token_gemm2_kernel(a_ptr, b_ptr, out_ptr, weights_ptr, topk_ids_ptr, expert_map_ptr,
                        N, K, topk, num_local_experts,
                        stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_on,
                        HAS_MAP: tl.constexpr, MUL_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    # N: output columns (the hidden size), K: the reduction (the intermediate size)
    if PDL:  # placed while the kernel before (the one writing the intermediate) finishes: wait for its end
        gdc_wait()
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_n64 = offs_n.to(tl.int64)
    steps = tl.cdiv(K, BLOCK_K)
    # products summed elementwise over every route and K step; one reduction across the K lanes at the end
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for t in range(0, topk * steps):
        j = t // steps
        offs_k = (t - j * steps) * BLOCK_K + tl.arange(0, BLOCK_K)
        e = tl.load(topk_ids_ptr + j).to(tl.int32)
        if HAS_MAP:
            e = tl.where(e >= 0, tl.load(expert_map_ptr + tl.maximum(e, 0)).to(tl.int32), -1)
        held = (e >= 0) & (e < num_local_experts)
        e64 = tl.where(held, e, 0).to(tl.int64)
        if EVEN_K:
            k_mask = held & (offs_k >= 0)
        else:
            k_mask = held & (offs_k < K)
        a = tl.load(a_ptr + j * stride_am + offs_k * stride_ak, mask=k_mask, other=0.0).to(tl.float32)
        if MUL_WEIGHT:
            a = a * tl.load(weights_ptr + j).to(tl.float32)
        b = tl.load(b_ptr + e64 * stride_be + offs_n64[:, None] * stride_bn + offs_k[None, :] * stride_bk,
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += b * a[None, :]
    tl.store(out_ptr + offs_n64 * stride_on, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=n_mask)


def token_gemm2(
    a_kNi: torch.Tensor,
    b_EKNi: torch.Tensor,
    out_1K: torch.Tensor,
    topk_ids_1k: torch.Tensor,
    num_local_experts: int,
    *,
    block_n: int,
    block_k: int,
    num_warps: int = 4,
    num_stages: int = 3,
    topk_weights_1k: Optional[torch.Tensor] = None,
    expert_map_E: Optional[torch.Tensor] = None,
    pdl: bool = False,
) -> torch.Tensor:
    """out_1K = sum over held routes j of topk_weights_1k[0, j] * a_kNi[j] @ b_EKNi[expert j].T; returns out_1K.

    a_kNi (k, Ni): the token's intermediate rows in route order; b_EKNi (El, K, Ni) the second GEMM's
    weights; out_1K (1, K); all of one of TOKEN_GEMM2_DTYPES (unquantized). topk_ids_1k (1, k) int:
    local ids, or global ids mapped by expert_map_E (E,) int32 (-1 not held). topk_weights_1k (1, k)
    float32, or None (weights applied on the input). block_n / block_k: output columns per program and
    the reduction step (powers of two). pdl as in moe_gemm.
    """
    if topk_ids_1k.dim() != 2 or topk_ids_1k.shape[0] != 1:
        raise ValueError(f"topk_ids_1k ({tuple(topk_ids_1k.shape)}) must be (1, k): one token")
    k = topk_ids_1k.shape[1]
    El, K, Ni = b_EKNi.shape
    if a_kNi.dim() != 2 or a_kNi.shape[0] < k or a_kNi.shape[1] != Ni:
        raise ValueError(f"a_kNi ({tuple(a_kNi.shape)}) must be ({k}, {Ni}): the token's intermediate rows")
    if out_1K.dim() != 2 or tuple(out_1K.shape) != (1, K):
        raise ValueError(f"out_1K ({tuple(out_1K.shape)}) must be (1, {K})")
    for name, t in (("a_kNi", a_kNi), ("b_EKNi", b_EKNi), ("out_1K", out_1K)):
        if t.dtype not in TOKEN_GEMM2_DTYPES:
            raise ValueError(f"{name} dtype ({t.dtype}) must be one of {list(TOKEN_GEMM2_DTYPES)} (unquantized)")
    if topk_weights_1k is not None and tuple(topk_weights_1k.shape) != (1, k):
        raise ValueError(f"topk_weights_1k ({tuple(topk_weights_1k.shape)}) must be (1, {k})")
    for name, v in (("block_n", block_n), ("block_k", block_k)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name} ({v}) must be a power of two")
    if not (topk_ids_1k.is_contiguous() and (topk_weights_1k is None or topk_weights_1k.is_contiguous())):
        raise ValueError("topk_ids_1k and topk_weights_1k must be contiguous")
    dependent = pdl_launch(pdl, out_1K.device)
    launch(_token_gemm2_kernel, (cdiv(K, block_n),), a_kNi, b_EKNi, out_1K,
           topk_weights_1k if topk_weights_1k is not None else topk_ids_1k, topk_ids_1k,
           expert_map_E if expert_map_E is not None else topk_ids_1k,
           K, Ni, k, num_local_experts, *a_kNi.stride(), *b_EKNi.stride(), out_1K.stride(1),
           HAS_MAP=expert_map_E is not None, MUL_WEIGHT=topk_weights_1k is not None, EVEN_K=Ni % block_k == 0,
           BLOCK_N=block_n, BLOCK_K=block_k, PDL=bool(dependent), num_warps=num_warps, num_stages=num_stages,
           **dependent)
    return out_1K


def token_gemm2_torch(
    a_kNi: torch.Tensor,
    b_EKNi: torch.Tensor,
    topk_ids_1k: torch.Tensor,
    num_local_experts: int,
    topk_weights_1k: Optional[torch.Tensor] = None,
    expert_map_E: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Float32 oracle of token_gemm2: (1, K)."""
    ids = topk_ids_1k[0].long()
    if expert_map_E is not None:
        ids = torch.where(ids >= 0, expert_map_E.long()[ids.clamp(min=0)], torch.full_like(ids, -1))
    out = torch.zeros(1, b_EKNi.shape[1], dtype=torch.float32, device=b_EKNi.device)
    for j, e in enumerate(ids.tolist()):
        if 0 <= e < num_local_experts:
            w = 1.0 if topk_weights_1k is None else topk_weights_1k[0, j].float()
            out[0] += w * (b_EKNi[e].float() @ a_kNi[j].float())
    return out
