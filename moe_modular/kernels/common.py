"""What several kernel modules share: @triton.jit helpers (fp8 scaling, the local expert of a route, the grouped
tile order) and compile-time constants. A kernel module imports these from here, never another kernel module's
private names; this module imports only the fp8 format (so quant.py's kernel path has no cycle through it)."""
from __future__ import annotations

import triton
import triton.language as tl

from moe_modular.fp8_format import FP8_MAX, MIN_AMAX

# Activation codes as the kernels see them (act_and_mul.ACT_CODE maps moe_modular.config.Activation to them).
ACT_SILU: tl.constexpr = tl.constexpr(0)
ACT_GELU: tl.constexpr = tl.constexpr(1)
ACT_SWIGLU_OAI: tl.constexpr = tl.constexpr(2)
FP8_MAX_C: tl.constexpr = tl.constexpr(FP8_MAX)
MIN_AMAX_C: tl.constexpr = tl.constexpr(MIN_AMAX)

# The fp8 warp-specialized kernel's tile (moe_gemm_ws_fp8.py): 128 x 128 outputs, K steps of 128, two consumer
# warpgroups (num_warps 8 counts their warps; the launch's own is one of them).
FP8_WS_TILE = (128, 128, 128)
FP8_WS_WARPS = 8
FP8_WS_GROUP = 128


@triton.jit
def scale_of(amax):
    """The fp8 scale of an amax, as quant.py computes it."""
    a = tl.maximum(amax, MIN_AMAX_C)
    return tl.math.div_rn(a, tl.zeros_like(a) + FP8_MAX_C)


@triton.jit
def finite_abs(h):
    """|h| where h is finite, else 0: the amax of a scale is over the finite elements (quant.finite_amax)."""
    a = tl.abs(h)
    return tl.where(a < float("inf"), a, 0.0)


@triton.jit
def to_fp8(h, scale, out_dtype: tl.constexpr):
    # Correctly rounded division (what torch computes), so fp8 rounding matches the oracle's; saturated; an element
    # that is not finite becomes NaN (the GPU's min / max would turn NaN into a finite bound).
    q = tl.math.div_rn(h, tl.zeros_like(h) + scale)
    q = tl.minimum(tl.maximum(q, -FP8_MAX_C), FP8_MAX_C)
    return tl.where(tl.abs(h) < float("inf"), q, float("nan")).to(out_dtype)


@triton.jit
def local_expert_of_route(topk_ids_ptr, expert_map_ptr, offs, num_routes, num_local_experts, num_map_entries,
                          HAS_MAP: tl.constexpr):
    """Local expert of routes `offs` and whether it is held here (in [0, El)). With a map, an id outside
    [0, num_map_entries) is not held (the map is never read out of bounds)."""
    in_range = offs < num_routes
    ids = tl.load(topk_ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
    if HAS_MAP:
        ids = tl.load(expert_map_ptr + ids, mask=in_range & (ids >= 0) & (ids < num_map_entries), other=-1).to(tl.int32)
    valid = in_range & (ids >= 0) & (ids < num_local_experts)
    return tl.where(valid, ids, 0), valid


@triton.jit
def tile_order(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(row block, column block) of tile number `tile`: GROUP_M row blocks share each column sweep (their
    B tiles stay in L2)."""
    per_group = GROUP_M * num_pid_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + ((tile % per_group) % group_rows), (tile % per_group) // group_rows
