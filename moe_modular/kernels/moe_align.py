"""Token-to-expert alignment: group the routes of a batch by local expert, padded per BLOCK_M.

Shape legend:
  T tokens   k topk   R = T * k routes (route r = token r // k, slot r % k)
  E global experts    El local experts    Eb histogram bins (next power of two >= El)
  P route chunks of ALIGN_BLOCK routes (placing programs)    C count chunks of count_group(R) route chunks
  S sorted-id capacity    Mb blocks of BLOCK_M rows

Output layout (what the grouped GEMM reads):
  sorted_ids_S   int32: for each local expert in order, the ids of its routes (ascending), then
                 sentinel R up to the next multiple of BLOCK_M; entries past num_post_padded are
                 never read.
  block_expert_Mb int32: the local expert of each BLOCK_M block, -1 past num_post_padded.
  num_post_padded (1,) int32: the number of meaningful entries of sorted_ids_S.
Routes whose expert is not held here (expert_map -1, or a local id outside [0, El)) get no slot.

Everything is computed on the device and sized from host integers only, so the caller never
synchronizes and the allocation does not depend on data. When all routes fit one ALIGN_BLOCK chunk
(decode) one program does it all; otherwise two launches: a program per count chunk histograms its routes,
then a program per route chunk sums those histograms (all of them: each expert's padded start; the ones
before its chunk: its prefix) and places its routes, program 0 also writing the layout.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moe_modular.kernels.common import local_expert_of_route
from moe_modular.kernels.host import cdiv, next_pow2
from moe_modular.kernels.launcher import launch
from moe_modular.routing import local_route_ids

# Routes per placing program (the in-chunk rank is a BLOCK x BLOCK compare).
ALIGN_BLOCK = 128
# Route chunks per count chunk from GROUPED_FROM route chunks on: the count kernel histograms
# COUNT_GROUP * ALIGN_BLOCK routes per program, so every placing program sums COUNT_GROUP times fewer
# histogram rows; it recounts the (at most COUNT_GROUP - 1) earlier route chunks of its count chunk, which
# costs more than it saves below GROUPED_FROM chunks.
COUNT_GROUP = 8
GROUPED_FROM = 128
# Elements per step of the block-expert writes (experts x blocks of each) and of the histogram-row sums.
LAYOUT_TILE = 8192
# Blocks per step of the -1 tail after the last used block.
FILL_BLOCK = 1024


def num_bins(num_local_experts: int) -> int:
    """Histogram bins: the next power of two >= num_local_experts."""
    return next_pow2(max(int(num_local_experts), 1))


def max_num_blocks(num_routes: int, num_local_experts: int, block_m: int) -> int:
    """An upper bound on the BLOCK_M blocks any routing of num_routes routes can fill.

    Every non-empty block holds at least one route, and each non-empty expert wastes < BLOCK_M slots.
    """
    busy = min(num_local_experts, num_routes)
    return min(num_routes, (num_routes + busy * (block_m - 1)) // block_m)


def sorted_capacity(num_routes: int, num_local_experts: int, block_m: int) -> int:
    """Entries sorted_ids_S must hold for block_m."""
    return max_num_blocks(num_routes, num_local_experts, block_m) * block_m


def num_chunks(num_routes: int) -> int:
    """Route chunks (placing programs)."""
    return cdiv(num_routes, ALIGN_BLOCK)


def count_group(num_routes: int) -> int:
    """Route chunks per count chunk."""
    return COUNT_GROUP if num_chunks(num_routes) >= GROUPED_FROM else 1


def num_count_chunks(num_routes: int) -> int:
    """Count chunks (count programs, histogram rows)."""
    return cdiv(num_routes, ALIGN_BLOCK * count_group(num_routes))


@triton.jit
def _align_count_kernel(topk_ids_ptr, expert_map_ptr, counts_ptr, num_routes, num_local_experts, num_map_entries,
                        HAS_MAP: tl.constexpr, NUM_BINS: tl.constexpr, BLOCK: tl.constexpr):
    """counts_CEb[c, e] = routes of count chunk c (BLOCK routes) whose local expert is e."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    expert, valid = local_expert_of_route(topk_ids_ptr, expert_map_ptr, offs, num_routes, num_local_experts,
                                           num_map_entries, HAS_MAP)
    hist = tl.histogram(expert, NUM_BINS, mask=valid)
    tl.store(counts_ptr + pid * NUM_BINS + tl.arange(0, NUM_BINS), hist.to(tl.int32))


@triton.jit
def _padded_starts(count, BLOCK_M: tl.constexpr):
    """From the route count of every expert (NUM_BINS,): each expert's padded start and block count."""
    blocks = tl.cdiv(count, BLOCK_M)
    return (tl.cumsum(blocks, axis=0) - blocks) * BLOCK_M, blocks


@triton.jit
def _write_layout(count, start, blocks, sorted_ids_ptr, block_expert_ptr, num_post_padded_ptr, num_routes,
                  num_blocks, NUM_BINS: tl.constexpr, BLOCK_M: tl.constexpr, RUN: tl.constexpr,
                  FILL: tl.constexpr):
    """From each expert's route count, padded start and block count (NUM_BINS,): num_post_padded, the expert
    of every block (each expert's run of blocks, RUN blocks of every expert per step; -1 after the last) and
    the sentinel padding."""
    bins = tl.arange(0, NUM_BINS)
    used = tl.sum(blocks, axis=0)
    tl.store(num_post_padded_ptr, used * BLOCK_M)
    first = start // BLOCK_M
    run = tl.arange(0, RUN)
    for j0 in range(0, tl.max(blocks, axis=0), RUN):
        j = j0 + run[None, :]
        tl.store(block_expert_ptr + first[:, None] + j, bins[:, None] + 0 * j, mask=j < blocks[:, None])
    for b0 in range(used, num_blocks, FILL):
        blk = b0 + tl.arange(0, FILL)
        tl.store(block_expert_ptr + blk, tl.full((FILL,), -1, tl.int32), mask=blk < num_blocks)
    # Sentinel (num_routes) in the < BLOCK_M padding slots after each expert's routes.
    slot = (start + count)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    sentinel = tl.full((NUM_BINS, BLOCK_M), 0, tl.int32) + num_routes
    tl.store(sorted_ids_ptr + slot, sentinel, mask=slot < (start + blocks * BLOCK_M)[:, None])


@triton.jit
def _rank_in_block(expert, valid, BLOCK: tl.constexpr):
    """For each lane, how many earlier valid lanes have the same expert."""
    lane = tl.arange(0, BLOCK)
    earlier = (expert[:, None] == expert[None, :]) & (lane[None, :] < lane[:, None]) & valid[None, :]
    return tl.sum(earlier.to(tl.int32), axis=1)


@triton.jit
def _place(count, before, topk_ids_ptr, expert_map_ptr, sorted_ids_ptr, block_expert_ptr, num_post_padded_ptr,
           first_route, num_routes, num_local_experts, num_map_entries, num_blocks, WRITE_LAYOUT,
           HAS_MAP: tl.constexpr, NUM_BINS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
           RUN: tl.constexpr, FILL: tl.constexpr):
    """Place routes [first_route, first_route + BLOCK) at start[e] + before[e] + (rank among this chunk's routes
    of e), from the route count of every expert (count) and of the routes before the chunk (before); the
    layout too where WRITE_LAYOUT."""
    start, blocks = _padded_starts(count, BLOCK_M)
    if WRITE_LAYOUT:
        _write_layout(count, start, blocks, sorted_ids_ptr, block_expert_ptr, num_post_padded_ptr, num_routes,
                      num_blocks, NUM_BINS, BLOCK_M, RUN, FILL)
    offs = first_route + tl.arange(0, BLOCK)
    expert, valid = local_expert_of_route(topk_ids_ptr, expert_map_ptr, offs, num_routes, num_local_experts,
                                           num_map_entries, HAS_MAP)
    slot = tl.gather(start + before, expert, 0) + _rank_in_block(expert, valid, BLOCK)
    tl.store(sorted_ids_ptr + slot, offs, mask=valid)


@triton.jit
def _align_small_kernel(topk_ids_ptr, expert_map_ptr, sorted_ids_ptr, block_expert_ptr, num_post_padded_ptr,
                        num_routes, num_local_experts, num_map_entries, num_blocks,
                        HAS_MAP: tl.constexpr, NUM_BINS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
                        RUN: tl.constexpr, FILL: tl.constexpr):
    """All of the alignment in one program when every route fits in one BLOCK (decode batches)."""
    expert, valid = local_expert_of_route(topk_ids_ptr, expert_map_ptr, tl.arange(0, BLOCK), num_routes,
                                           num_local_experts, num_map_entries, HAS_MAP)
    count = tl.histogram(expert, NUM_BINS, mask=valid).to(tl.int32)
    _place(count, tl.zeros((NUM_BINS,), dtype=tl.int32), topk_ids_ptr, expert_map_ptr, sorted_ids_ptr,
           block_expert_ptr, num_post_padded_ptr, 0, num_routes, num_local_experts, num_map_entries, num_blocks, True,
           HAS_MAP,
           NUM_BINS, BLOCK_M, BLOCK, RUN, FILL)


@triton.jit
def _align_place_kernel(topk_ids_ptr, expert_map_ptr, counts_ptr, sorted_ids_ptr, block_expert_ptr,
                        num_post_padded_ptr, num_routes, num_local_experts, num_map_entries, num_blocks,
                        num_count_chunks,
                        HAS_MAP: tl.constexpr, NUM_BINS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
                        COUNT_GROUP: tl.constexpr, ROWS: tl.constexpr, RUN: tl.constexpr, FILL: tl.constexpr):
    """Program p sums the count chunks' histograms (ROWS at a time): all of them give each expert's count,
    those before its count chunk (plus the earlier route chunks of it, recounted) the prefix of its route
    chunk (BLOCK routes); it places that chunk's routes, and program 0 also writes the layout."""
    pid = tl.program_id(0)
    group = pid // COUNT_GROUP
    bins = tl.arange(0, NUM_BINS)
    count = tl.zeros((NUM_BINS,), dtype=tl.int32)
    before = tl.zeros((NUM_BINS,), dtype=tl.int32)
    for r0 in range(0, num_count_chunks, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        tile = tl.load(counts_ptr + rows[:, None] * NUM_BINS + bins[None, :], mask=rows[:, None] < num_count_chunks,
                       other=0)
        count += tl.sum(tile, axis=0)
        before += tl.sum(tl.where(rows[:, None] < group, tile, 0), axis=0)
    for q in range(group * COUNT_GROUP, pid):
        e_q, v_q = local_expert_of_route(topk_ids_ptr, expert_map_ptr, q * BLOCK + tl.arange(0, BLOCK), num_routes,
                                          num_local_experts, num_map_entries, HAS_MAP)
        before += tl.histogram(e_q, NUM_BINS, mask=v_q).to(tl.int32)
    _place(count, before, topk_ids_ptr, expert_map_ptr, sorted_ids_ptr, block_expert_ptr, num_post_padded_ptr,
           pid * BLOCK, num_routes, num_local_experts, num_map_entries, num_blocks, pid == 0, HAS_MAP, NUM_BINS, BLOCK_M, BLOCK, RUN,
           FILL)


def align_workspace_numel(num_routes: int, num_local_experts: int, block_m: int) -> dict[str, int]:
    """int32 element counts of the buffers moe_align needs (for carving them from a workspace)."""
    return {
        "sorted_ids": max(sorted_capacity(num_routes, num_local_experts, block_m), 1),
        "block_expert": max(max_num_blocks(num_routes, num_local_experts, block_m), 1),
        "num_post_padded": 1,
        "counts": max(num_count_chunks(num_routes), 1) * num_bins(num_local_experts),
    }


def moe_align(
    topk_ids_Tk: torch.Tensor,
    block_m: int,
    num_local_experts: int,
    expert_map_E: Optional[torch.Tensor] = None,
    buffers: Optional[dict[str, torch.Tensor]] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Align the routes of topk_ids_Tk (T, k) int32/int64 to BLOCK_M blocks per local expert.

    topk_ids are global ids mapped through expert_map_E (E,) int32 (-1: not held here) when it is
    given, else local ids (a value outside [0, El) means not held here).
    buffers: optional int32 views sized by align_workspace_numel (else allocated).
    Returns (sorted_ids_S, block_expert_Mb, num_post_padded (1,)), all int32 on the ids' device.
    """
    if topk_ids_Tk.dim() != 2:
        raise ValueError(f"topk_ids must be 2-D (T, k), got shape {tuple(topk_ids_Tk.shape)}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m ({block_m}) must be a power of two")
    ids = topk_ids_Tk if topk_ids_Tk.is_contiguous() else topk_ids_Tk.contiguous()
    R = ids.numel()
    El = int(num_local_experts)
    sizes = align_workspace_numel(R, El, block_m)
    if buffers is None:
        buffers = {name: torch.empty(n, dtype=torch.int32, device=ids.device) for name, n in sizes.items()}
    for name, n in sizes.items():
        if buffers[name].numel() < n or buffers[name].dtype != torch.int32:
            raise ValueError(f"moe_align buffer {name} must be int32 with >= {n} elements")
    sorted_ids = buffers["sorted_ids"][: sizes["sorted_ids"]]
    block_expert = buffers["block_expert"][: sizes["block_expert"]]
    num_post_padded = buffers["num_post_padded"][:1]
    if R == 0:
        num_post_padded.zero_()
        block_expert.fill_(-1)
        return sorted_ids, block_expert, num_post_padded
    has_map = expert_map_E is not None
    emap = expert_map_E if has_map else ids  # a placeholder pointer when there is no map
    E = expert_map_E.numel() if has_map else 0
    P, Eb = num_chunks(R), num_bins(El)
    blocks = next_pow2(sizes["block_expert"])  # no expert's run of blocks, nor the -1 tail, is longer
    layout = dict(HAS_MAP=has_map, NUM_BINS=Eb, BLOCK_M=block_m, RUN=max(1, min(LAYOUT_TILE // Eb, blocks)),
                  FILL=min(FILL_BLOCK, blocks))
    if P == 1:  # one launch for decode-sized batches
        launch(_align_small_kernel, (1,), ids, emap, sorted_ids, block_expert, num_post_padded, R, El, E,
               sizes["block_expert"], BLOCK=max(16, next_pow2(R)), **layout)
        return sorted_ids, block_expert, num_post_padded
    C, G = num_count_chunks(R), count_group(R)
    counts = buffers["counts"][: C * Eb]
    launch(_align_count_kernel, (C,), ids, emap, counts, R, El, E, HAS_MAP=has_map, NUM_BINS=Eb, BLOCK=ALIGN_BLOCK * G)
    rows = max(1, min(next_pow2(C), LAYOUT_TILE // Eb))
    launch(_align_place_kernel, (P,), ids, emap, counts, sorted_ids, block_expert, num_post_padded, R, El, E,
           sizes["block_expert"], C, BLOCK=ALIGN_BLOCK, COUNT_GROUP=G, ROWS=rows, **layout)
    return sorted_ids, block_expert, num_post_padded


def moe_align_torch(
    topk_ids_Tk: torch.Tensor,
    block_m: int,
    num_local_experts: int,
    expert_map_E: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Oracle: (sorted_ids, block_expert, num_post_padded) with only the meaningful entries."""
    ids = topk_ids_Tk.reshape(-1).long()
    R = ids.numel()
    ids = local_route_ids(ids, expert_map_E, num_local_experts)
    sorted_ids, block_expert = [], []
    for e in range(num_local_experts):
        routes = (ids == e).nonzero().squeeze(1).tolist()
        if not routes:
            continue
        nblk = -(-len(routes) // block_m)
        sorted_ids += routes + [R] * (nblk * block_m - len(routes))
        block_expert += [e] * nblk
    return (torch.tensor(sorted_ids, dtype=torch.int32), torch.tensor(block_expert, dtype=torch.int32),
            len(sorted_ids))
