"""The in-run yardstick of the fp8 cells of tools/benchmark_moe: dense fp8 GEMMs with a cell's useful work.

For a cell (E, K, N, top-k, M) the grouped GEMMs compute R = M * k routed rows: (R, K) x (K, 2N), then
(R, N) x (N, K). The yardstick runs exactly those two products as dense fp8 GEMMs through torch._scaled_mm
(cuBLAS / CUTLASS), as if the routing were balanced and every expert the same: the same flops with no token
gather, no padding, no per-expert weights, activation or top-k sum, and bf16 outputs. Its time is what the
installed torch reaches on the same work; ours / yardstick says how close the grouped kernel gets.

Scaling: blockwise (1 x 128 activation groups, 128 x 128 weight blocks), the fp8-block scheme's own, where the
installed torch runs it on this GPU; else per-row x per-column, the fp8-token scheme's. Which one ran is
reported with the time.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

FP8 = torch.float8_e4m3fn
GROUP = 128
# Below this many routed rows a cell streams weights: no compute yardstick.
MIN_ROWS = 1024


def _rowwise(a: torch.Tensor, b_t: torch.Tensor) -> Callable[[], torch.Tensor]:
    """a (R, K) fp8 times b_t (K, No) fp8 (column-major) with a float32 scale per row of a and column of b."""
    sa = torch.rand(a.shape[0], 1, device=a.device) + 0.5
    sb = torch.rand(1, b_t.shape[1], device=a.device) + 0.5
    return lambda: torch._scaled_mm(a, b_t, sa, sb, out_dtype=torch.bfloat16)


def _blockwise(a: torch.Tensor, b_t: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The same product with 1 x 128 scales of a (column-major (R, K/128)) and 128 x 128 blocks of b (the scale
    of b_t.t() (No/128, K/128) row-major, passed transposed)."""
    R, K = a.shape
    No = b_t.shape[1]
    sa = (torch.rand(K // GROUP, R, device=a.device) + 0.5).t()
    sb = (torch.rand(No // GROUP, K // GROUP, device=a.device) + 0.5).t()
    return lambda: torch._scaled_mm(a, b_t, sa, sb, out_dtype=torch.bfloat16)


SCALINGS: dict[str, Callable] = {"blockwise 1x128 / 128x128": _blockwise, "row-wise": _rowwise}


def dense_pair(R: int, K: int, N: int, device: torch.device, prefer_blockwise: bool,
               ) -> tuple[Optional[Callable[[], None]], str]:
    """(fn running both dense products, the scaling that ran), or (None, why not). Each scaling is tried once
    (a run and a check that the output is finite) in the order the scheme prefers."""
    g = torch.Generator(device=device).manual_seed(0)
    rand = lambda *s: (torch.rand(*s, device=device, generator=g) - 0.5).to(FP8)  # noqa: E731
    a1, w1_t = rand(R, K), rand(2 * N, K).t()
    a2, w2_t = rand(R, N), rand(K, N).t()
    order = list(SCALINGS) if prefer_blockwise else list(reversed(SCALINGS))
    notes = []
    for name in order:
        if name.startswith("blockwise") and (K % GROUP or N % GROUP):
            notes.append(f"{name}: K ({K}) and N ({N}) must be multiples of {GROUP}")
            continue
        try:
            first, second = SCALINGS[name](a1, w1_t), SCALINGS[name](a2, w2_t)
            if not (torch.isfinite(first()).all() and torch.isfinite(second()).all()):
                raise RuntimeError("non-finite output")
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            notes.append(f"{name}: {(str(exc).splitlines() or [''])[0][:120]}")
            continue

        def both(first=first, second=second) -> None:
            first()
            second()

        label = name if not notes else f"{name} ({'; '.join(notes)})"
        return both, label
    return None, "; ".join(notes)


def yardstick_us(M: int, topk: int, K: int, N: int, prefer_blockwise: bool, timer) -> tuple[Optional[float], str]:
    """(microseconds of the two dense fp8 GEMMs of a cell, the scaling) on timer's device, replayed from a CUDA
    graph (timer: tools.benchmark_moe.Timer); (None, why) below MIN_ROWS routed rows or off a GPU."""
    R = M * topk
    if not timer.cuda:
        return None, "no GPU"
    if R < MIN_ROWS:
        return None, f"{R} routed rows: below {MIN_ROWS}, the cell streams weights"
    fn, scaling = dense_pair(R, K, N, timer.device, prefer_blockwise)
    if fn is None:
        return None, scaling
    from tools.bench_common import capture_graph

    graph = capture_graph([fn], timer.device)
    us = timer.median_s(graph.replay) * 1e6
    del graph
    return us, scaling
