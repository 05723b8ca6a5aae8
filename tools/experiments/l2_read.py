"""L2 read bandwidth: many programs reading a buffer that fits in L2 over and over (loads that skip L1).

    l2_read_Bps(timer)   # bytes per second, timed with the caller's tools.benchmark_moe.Timer

Imported on use (it imports triton: under --smoke the caller selects Triton's interpreter first).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _l2_read_kernel(x_ptr, out_ptr, nblocks, iters, BLOCK: tl.constexpr):
    """Program p sums blocks 7p, 7p + 1, ... (mod nblocks) of x, iters of them, into its BLOCK of out. The loads
    skip L1 (.cg), so programs that share an SM and reread a block still read it from L2."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(iters):
        acc += tl.load(x_ptr + ((pid * 7 + i) % nblocks) * BLOCK + offs, cache_modifier=".cg")
    tl.store(out_ptr + pid * BLOCK + offs, acc)


def l2_read_Bps(timer, smoke: bool = False) -> float:
    """Bytes per second read from a buffer of a quarter of the L2 (ones; each program's sum is checked)."""
    dev = timer.device
    if smoke:
        buf_bytes, block, programs, iters, warps = 64 << 10, 1024, 4, 4, 4
    else:
        props = torch.cuda.get_device_properties(dev)
        buf_bytes, block, warps = props.L2_cache_size // 4, 4096, 8
        programs, iters = props.multi_processor_count * 8, 512
    nblocks = buf_bytes // (block * 4)
    x = torch.ones(nblocks * block, dtype=torch.float32, device=dev)
    out = torch.full((programs * block,), float("nan"), dtype=torch.float32, device=dev)

    def run():
        _l2_read_kernel[(programs,)](x, out, nblocks, iters, BLOCK=block, num_warps=warps)

    seconds = timer.median_s(run)
    if not bool((out == iters).all()):
        raise RuntimeError(f"l2_read: the programs' sums are not {iters} (the reads did not all happen)")
    return programs * iters * block * 4 / seconds
