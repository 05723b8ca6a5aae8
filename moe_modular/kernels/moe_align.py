"""Token-to-expert alignment: group the routes of a batch by local expert, padded per BLOCK_M.

Shape legend:
  T tokens   k topk   R = T * k routes (route r = token r // k, slot r % k)
  E global experts    El local experts    Eb histogram bins (next power of two >= El)
  P route chunks of ALIGN_BLOCK routes (scatter)    C count chunks of count_group(R) route chunks
  S sorted-id capacity    Mb blocks of BLOCK_M rows

Output layout (what the grouped GEMM reads):
  sorted_ids_S   int32: for each local expert in order, the ids of its routes (ascending), then
                 sentinel R up to the next multiple of BLOCK_M; entries past num_post_padded are
                 never read.
  block_expert_Mb int32: the local expert of each BLOCK_M block, -1 past num_post_padded.
  num_post_padded (1,) int32: the number of meaningful entries of sorted_ids_S.
Routes whose expert is not held here (expert_map -1, or a local id outside [0, El)) get no slot.

Everything is computed on the device and sized from host integers only, so the caller never
synchronizes and the allocation does not depend on data. Launches:
  - all routes in one ALIGN_BLOCK chunk (decode): one program does everything;
  - up to ONEPASS_MAX_CHUNKS chunks: one launch of a program per chunk, each histogramming every route
    (the totals give the experts' starts, the routes before its chunk its prefix) before placing its own;
  - more: three launches (count, offsets, scatter), so no program reads more than its count chunks.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moe_modular.kernels.host import cdiv, next_pow2
from moe_modular.kernels.launcher import launch

# Routes per program in the scatter kernel (the in-chunk rank is a BLOCK x BLOCK compare).
ALIGN_BLOCK = 128
# Route chunks per count chunk from GROUPED_FROM route chunks on: the count kernel histograms
# COUNT_GROUP * ALIGN_BLOCK routes per program, so the one-program prefix scan walks COUNT_GROUP times
# fewer rows; a scatter program recounts the (at most COUNT_GROUP - 1) earlier route chunks of its
# count chunk, which costs more than it saves below GROUPED_FROM chunks.
COUNT_GROUP = 8
GROUPED_FROM = 128
# Route chunks up to which one launch places every route (each program reads all R routes, so its work
# grows with R while the three launches' fixed cost does not); the routes each of its programs
# histograms per step.
ONEPASS_MAX_CHUNKS = 64
ONEPASS_SCAN = 1024


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
    """Route chunks (scatter programs)."""
    return cdiv(num_routes, ALIGN_BLOCK)


def count_group(num_routes: int) -> int:
    """Route chunks per count chunk."""
    return COUNT_GROUP if num_chunks(num_routes) >= GROUPED_FROM else 1


def num_count_chunks(num_routes: int) -> int:
    """Count chunks (count programs, rows of the prefix scan)."""
    return cdiv(num_routes, ALIGN_BLOCK * count_group(num_routes))


@triton.jit
def _local_expert_of_route(topk_ids_ptr, expert_map_ptr, offs, num_routes, num_local_experts,
                           HAS_MAP: tl.constexpr):
    """Local expert of routes `offs` and whether it is held here (in [0, El))."""
    in_range = offs < num_routes
    ids = tl.load(topk_ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
    if HAS_MAP:
        ids = tl.load(expert_map_ptr + ids, mask=in_range & (ids >= 0), other=-1).to(tl.int32)
    valid = in_range & (ids >= 0) & (ids < num_local_experts)
    return tl.where(valid, ids, 0), valid


@triton.jit
def _align_count_kernel(topk_ids_ptr, expert_map_ptr, counts_ptr, num_routes, num_local_experts,
                        HAS_MAP: tl.constexpr, NUM_BINS: tl.constexpr, BLOCK: tl.constexpr):
    """counts_CEb[c, e] = routes of count chunk c (BLOCK routes) whose local expert is e."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    expert, valid = _local_expert_of_route(topk_ids_ptr, expert_map_ptr, offs, num_routes, num_local_experts,
                                           HAS_MAP)
    hist = tl.histogram(expert, NUM_BINS, mask=valid)
    tl.store(counts_ptr + pid * NUM_BINS + tl.arange(0, NUM_BINS), hist.to(tl.int32))


@triton.jit
def _align_offsets_kernel(counts_ptr, expert_start_ptr, sorted_ids_ptr, block_expert_ptr, num_post_padded_ptr,
                          num_chunks, num_routes, num_blocks,
                          NUM_BINS: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
                          BLOCKS_PER_ITER: tl.constexpr):
    """One program: turn counts_CEb into per-count-chunk exclusive prefixes (in place), write each
    expert's padded start, num_post_padded, the expert of every block and the sentinel padding."""
    bins = tl.arange(0, NUM_BINS)
    running = tl.zeros((NUM_BINS,), dtype=tl.int32)
    for p0 in range(0, num_chunks, ROWS):
        rows = p0 + tl.arange(0, ROWS)
        ptrs = counts_ptr + rows[:, None] * NUM_BINS + bins[None, :]
        m = rows[:, None] < num_chunks
        tile = tl.load(ptrs, mask=m, other=0)
        before = tl.cumsum(tile, axis=0) - tile + running[None, :]
        tl.store(ptrs, before, mask=m)
        running += tl.sum(tile, axis=0)
    _write_layout(running, expert_start_ptr, sorted_ids_ptr, block_expert_ptr, num_post_padded_ptr, num_routes,
                  num_blocks, NUM_BINS, BLOCK_M, BLOCKS_PER_ITER)


@triton.jit
def _padded_ranges(count, BLOCK_M: tl.constexpr):
    """From the route count of every expert (NUM_BINS,): each expert's padded [start, end) and the total."""
    padded = tl.cdiv(count, BLOCK_M) * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    return end - padded, end, tl.sum(padded, axis=0)


@triton.jit
def _write_layout(count, expert_start_ptr, sorted_ids_ptr, block_expert_ptr, num_post_padded_ptr, num_routes,
                  num_blocks, NUM_BINS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr):
    """From the route count of every expert (NUM_BINS,): each expert's padded start (stored and
    returned), num_post_padded, the expert of every block and the sentinel padding."""
    bins = tl.arange(0, NUM_BINS)
    start, end, total = _padded_ranges(count, BLOCK_M)
    tl.store(expert_start_ptr + bins, start)
    tl.store(num_post_padded_ptr, total)
    # The expert of block b is the number of experts whose padded range ends at or before b * BLOCK_M.
    for b0 in range(0, num_blocks, BLOCKS_PER_ITER):
        blk = b0 + tl.arange(0, BLOCKS_PER_ITER)
        pos = blk * BLOCK_M
        owner = tl.sum((end[None, :] <= pos[:, None]).to(tl.int32), axis=1)
        owner = tl.where(pos < total, owner, -1)
        tl.store(block_expert_ptr + blk, owner, mask=blk < num_blocks)
    # Sentinel (num_routes) in the < BLOCK_M padding slots after each expert's routes.
    slot = (start + count)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    sentinel = tl.full((NUM_BINS, BLOCK_M), 0, tl.int32) + num_routes
    tl.store(sorted_ids_ptr + slot, sentinel, mask=slot < end[:, None])
    return start


@triton.jit
def _rank_in_block(expert, valid, BLOCK: tl.constexpr):
    """For each lane, how many earlier valid lanes have the same expert."""
    lane = tl.arange(0, BLOCK)
    earlier = (expert[:, None] == expert[None, :]) & (lane[None, :] < lane[:, None]) & valid[None, :]
    return tl.sum(earlier.to(tl.int32), axis=1)


@triton.jit
def _per_lane(per_bin, expert, NUM_BINS: tl.constexpr):
    """per_bin[expert] for each lane (a register gather from a (NUM_BINS,) vector)."""
    bins = tl.arange(0, NUM_BINS)
    return tl.sum(tl.where(bins[None, :] == expert[:, None], per_bin[None, :], 0), axis=1)


@triton.jit
def _align_small_kernel(topk_ids_ptr, expert_map_ptr, expert_start_ptr, sorted_ids_ptr, block_expert_ptr,
                        num_post_padded_ptr, num_routes, num_local_experts, num_blocks,
                        HAS_MAP: tl.constexpr, NUM_BINS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
                        BLOCKS_PER_ITER: tl.constexpr):
    """All of the alignment in one program when every route fits in one BLOCK (decode batches)."""
    offs = tl.arange(0, BLOCK)
    expert, valid = _local_expert_of_route(topk_ids_ptr, expert_map_ptr, offs, num_routes, num_local_experts,
                                           HAS_MAP)
    count = tl.histogram(expert, NUM_BINS, mask=valid).to(tl.int32)
    start = _write_layout(count, expert_start_ptr, sorted_ids_ptr, block_expert_ptr, num_post_padded_ptr,
                          num_routes, num_blocks, NUM_BINS, BLOCK_M, BLOCKS_PER_ITER)
    base = _per_lane(start, expert, NUM_BINS)
    tl.store(sorted_ids_ptr + base + _rank_in_block(expert, valid, BLOCK), offs, mask=valid)


@triton.jit
def _align_onepass_kernel(topk_ids_ptr, expert_map_ptr, expert_start_ptr, sorted_ids_ptr, block_expert_ptr,
                          num_post_padded_ptr, num_routes, num_local_experts, num_blocks,
                          HAS_MAP: tl.constexpr, NUM_BINS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
                          SCAN: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr):
    """Program p histograms every route (SCAN at a time): the totals give each expert's padded start, the
    routes before its chunk (BLOCK routes) their prefix; it places its chunk's routes, and program 0 also
    writes the layout (num_post_padded, block experts, sentinels)."""
    pid = tl.program_id(0)
    first = pid * BLOCK
    total = tl.zeros((NUM_BINS,), dtype=tl.int32)
    before = tl.zeros((NUM_BINS,), dtype=tl.int32)
    for c0 in range(0, num_routes, SCAN):
        offs_c = c0 + tl.arange(0, SCAN)
        e_c, v_c = _local_expert_of_route(topk_ids_ptr, expert_map_ptr, offs_c, num_routes, num_local_experts,
                                          HAS_MAP)
        hist = tl.histogram(e_c, NUM_BINS, mask=v_c).to(tl.int32)
        total += hist
        if c0 + SCAN <= first:
            before += hist
        elif c0 < first:
            before += tl.histogram(e_c, NUM_BINS, mask=v_c & (offs_c < first)).to(tl.int32)
    if pid == 0:
        start = _write_layout(total, expert_start_ptr, sorted_ids_ptr, block_expert_ptr, num_post_padded_ptr,
                              num_routes, num_blocks, NUM_BINS, BLOCK_M, BLOCKS_PER_ITER)
    else:
        start, _, _ = _padded_ranges(total, BLOCK_M)
    offs = first + tl.arange(0, BLOCK)
    expert, valid = _local_expert_of_route(topk_ids_ptr, expert_map_ptr, offs, num_routes, num_local_experts,
                                           HAS_MAP)
    slot = _per_lane(start + before, expert, NUM_BINS) + _rank_in_block(expert, valid, BLOCK)
    tl.store(sorted_ids_ptr + slot, offs, mask=valid)


@triton.jit
def _align_scatter_kernel(topk_ids_ptr, expert_map_ptr, prefix_ptr, expert_start_ptr, sorted_ids_ptr,
                          num_routes, num_local_experts,
                          HAS_MAP: tl.constexpr, NUM_BINS: tl.constexpr, BLOCK: tl.constexpr,
                          COUNT_GROUP: tl.constexpr):
    """Place every held route at start[e] + (routes of e in earlier count chunks) + (routes of e in the
    earlier route chunks of this count chunk) + (rank within the chunk)."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    expert, valid = _local_expert_of_route(topk_ids_ptr, expert_map_ptr, offs, num_routes, num_local_experts,
                                           HAS_MAP)
    rank = _rank_in_block(expert, valid, BLOCK)
    first = (pid // COUNT_GROUP) * COUNT_GROUP
    earlier = tl.zeros((NUM_BINS,), dtype=tl.int32)
    for q in range(first, pid):
        e_q, v_q = _local_expert_of_route(topk_ids_ptr, expert_map_ptr, q * BLOCK + tl.arange(0, BLOCK), num_routes,
                                          num_local_experts, HAS_MAP)
        earlier += tl.histogram(e_q, NUM_BINS, mask=v_q).to(tl.int32)
    rank += _per_lane(earlier, expert, NUM_BINS)
    base = tl.load(expert_start_ptr + expert, mask=valid, other=0)
    base += tl.load(prefix_ptr + (pid // COUNT_GROUP) * NUM_BINS + expert, mask=valid, other=0)
    tl.store(sorted_ids_ptr + base + rank, offs, mask=valid)


def align_workspace_numel(num_routes: int, num_local_experts: int, block_m: int) -> dict[str, int]:
    """int32 element counts of the buffers moe_align needs (for carving them from a workspace)."""
    return {
        "sorted_ids": max(sorted_capacity(num_routes, num_local_experts, block_m), 1),
        "block_expert": max(max_num_blocks(num_routes, num_local_experts, block_m), 1),
        "num_post_padded": 1,
        "expert_start": num_bins(num_local_experts),
        "counts": max(num_count_chunks(num_routes), 1) * num_bins(num_local_experts),
    }


def moe_align(
    topk_ids_Tk: torch.Tensor,
    block_m: int,
    num_local_experts: int,
    expert_map_E: Optional[torch.Tensor] = None,
    buffers: Optional[dict[str, torch.Tensor]] = None,
    onepass_max_chunks: int = ONEPASS_MAX_CHUNKS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Align the routes of topk_ids_Tk (T, k) int32/int64 to BLOCK_M blocks per local expert.

    topk_ids are global ids mapped through expert_map_E (E,) int32 (-1: not held here) when it is
    given, else local ids (a value outside [0, El) means not held here).
    buffers: optional int32 views sized by align_workspace_numel (else allocated).
    onepass_max_chunks: route chunks up to which one launch does it all (else three; the same result).
    Returns (sorted_ids_S, block_expert_Mb, num_post_padded (1,)), all int32 on the ids' device.
    """
    if topk_ids_Tk.dim() != 2:
        raise ValueError(f"topk_ids must be 2-D (T, k), got shape {tuple(topk_ids_Tk.shape)}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m ({block_m}) must be a power of two")
    if onepass_max_chunks < 1:
        raise ValueError(f"onepass_max_chunks ({onepass_max_chunks}) must be >= 1")
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
    P, Eb = num_chunks(R), num_bins(El)
    start = buffers["expert_start"][:Eb]
    blocks_per_iter = max(1, min(64, 8192 // Eb))
    if P == 1:  # one launch for decode-sized batches
        launch(_align_small_kernel, (1,), ids, emap, start, sorted_ids, block_expert, num_post_padded, R, El,
               sizes["block_expert"], HAS_MAP=has_map, NUM_BINS=Eb, BLOCK_M=block_m,
               BLOCK=max(16, next_pow2(R)), BLOCKS_PER_ITER=blocks_per_iter,
               num_warps=4 if Eb * block_m <= 8192 else 8)
        return sorted_ids, block_expert, num_post_padded
    if P <= onepass_max_chunks:
        launch(_align_onepass_kernel, (P,), ids, emap, start, sorted_ids, block_expert, num_post_padded, R, El,
               sizes["block_expert"], HAS_MAP=has_map, NUM_BINS=Eb, BLOCK_M=block_m, BLOCK=ALIGN_BLOCK,
               SCAN=ONEPASS_SCAN, BLOCKS_PER_ITER=blocks_per_iter)
        return sorted_ids, block_expert, num_post_padded
    C, G = num_count_chunks(R), count_group(R)
    counts = buffers["counts"][: C * Eb]
    launch(_align_count_kernel, (C,), ids, emap, counts, R, El, HAS_MAP=has_map, NUM_BINS=Eb, BLOCK=ALIGN_BLOCK * G)
    rows = max(1, min(next_pow2(C), 4096 // Eb))
    launch(_align_offsets_kernel, (1,), counts, start, sorted_ids, block_expert, num_post_padded, C, R,
           sizes["block_expert"], NUM_BINS=Eb, BLOCK_M=block_m, ROWS=rows, BLOCKS_PER_ITER=blocks_per_iter,
           num_warps=8)
    launch(_align_scatter_kernel, (P,), ids, emap, counts, start, sorted_ids, R, El, HAS_MAP=has_map, NUM_BINS=Eb,
           BLOCK=ALIGN_BLOCK, COUNT_GROUP=G)
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
    if expert_map_E is not None:
        ids = torch.where(ids >= 0, expert_map_E.long()[ids.clamp(min=0)], torch.full_like(ids, -1))
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
