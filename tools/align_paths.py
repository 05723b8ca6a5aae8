"""moe_align's two multi-chunk paths side by side: one launch (every program histograms all routes) against
three (count, offsets, scatter), on tools/benchmark_moe's random routing.

    python -m tools.align_paths --shapes mixtral qwen3 deepseek-v3 -m 64 256 1024 2048 4096
    python -m tools.align_paths --smoke --out OUT        # tiny shapes, the CPU interpreter

Per cell: the routes of M tokens (top-k of a softmax over random logits, as the benchmark draws them), BLOCK_M
from the shipped tile tables (the one TritonExperts would use for that M, or --block-m), both paths checked
equal to the oracle (`moe_align_torch`), then timed alternately for --rounds rounds, each keeping its best. On a
GPU each timing replays a CUDA graph of --repeat alignments (GPU time per alignment, no host launch cost) after an
L2 flush; on the CPU each call is timed eagerly. "three / one" > 1: the single launch is faster. The threshold
it informs is `moe_modular.kernels.moe_align.ONEPASS_MAX_CHUNKS` (route chunks of ALIGN_BLOCK). Prints a table
last and writes OUT/align_paths.csv.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

from tools.ab_tiles import time_variants
from tools.benchmark_moe import QUANTS, capture_graph, make_inputs, resolve_shapes_and_quants, write_csv
from tools.tune_moe import incumbent, trial_context

CSV_FIELDS = ("shape", "M", "E", "topk", "routes", "chunks", "block_m", "us_one", "us_three", "three_over_one")
PATHS = {"one": 1 << 30, "three": 1}  # onepass_max_chunks of each path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", help="of mixtral, qwen3, deepseek-v3 (smoke: tiny, tiny-e16)")
    p.add_argument("-m", "--m", dest="ms", type=int, nargs="+", help="token counts (default 64 256 1024 2048 4096)")
    p.add_argument("--block-m", type=int, default=0, help="BLOCK_M for every cell (default: the shipped tables')")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; each path keeps its best")
    p.add_argument("--repeat", type=int, default=20, help="alignments per CUDA graph replay")
    p.add_argument("--rep-ms", type=float, default=20.0)
    p.add_argument("--out", default="align_out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, the CPU interpreter")
    args = p.parse_args(argv)
    args.quant = ["bf16"]
    shapes = resolve_shapes_and_quants(p, args, smoke_default=["tiny", "tiny-e16"])
    for name in ("rounds", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name} ({getattr(args, name)}) must be >= 1")
    if args.block_m < 0 or args.block_m & (args.block_m - 1):
        p.error(f"--block-m ({args.block_m}) must be a power of two (or 0: the shipped tables')")
    args.ms = args.ms or ([40, 100] if args.smoke else [64, 256, 1024, 2048, 4096])
    if min(args.ms) < 1:
        p.error(f"-m ({min(args.ms)}) must be >= 1")
    if args.smoke:
        args.rep_ms, args.rounds, args.repeat = 1.0, 1, 1
    if args.smoke and not torch.cuda.is_available():
        from tests.triton_interpreter_patch import use_interpreter

        use_interpreter()
    return args, shapes


def check_paths(topk_ids: torch.Tensor, block_m: int, E: int) -> None:
    """Raise unless both paths give the oracle's sorted ids, block experts and count."""
    from moe_modular.kernels.moe_align import moe_align, moe_align_torch

    ref_sorted, ref_blocks, ref_n = moe_align_torch(topk_ids.cpu(), block_m, E)
    for label, max_chunks in PATHS.items():
        sorted_ids, block_expert, npp = moe_align(topk_ids, block_m, E, onepass_max_chunks=max_chunks)
        n = int(npp.item())
        if n != ref_n or not torch.equal(sorted_ids[:n].cpu(), ref_sorted) or \
                not torch.equal(block_expert[: n // block_m].cpu(), ref_blocks):
            raise RuntimeError(f"moe_align path {label!r} differs from the oracle (num_post_padded {n}, want {ref_n})")


def path_timer(topk_ids: torch.Tensor, block_m: int, E: int, timer, repeat: int):
    """trial(max_chunks) -> seconds per alignment."""
    from moe_modular.kernels.moe_align import align_workspace_numel, moe_align

    buffers = {name: torch.empty(n, dtype=torch.int32, device=topk_ids.device)
               for name, n in align_workspace_numel(topk_ids.numel(), E, block_m).items()}

    def trial(max_chunks: int) -> float:
        run = lambda: moe_align(topk_ids, block_m, E, buffers=buffers, onepass_max_chunks=max_chunks)  # noqa: E731
        if not timer.cuda:
            return timer.median_s(run)
        graph = capture_graph([run] * repeat, topk_ids.device)
        return timer.median_s(graph.replay, per_call=repeat)

    return trial


def table(rows: list[dict]) -> str:
    lines = ["| shape | M | routes | chunks | BLOCK_M | one launch us | three launches us | three / one |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        us = ["failed" if r[k] is None else f"{r[k]:.2f}" for k in ("us_one", "us_three")]
        ratio = "-" if r["three_over_one"] is None else f"{r['three_over_one']:.3f}"
        lines.append(f"| {r['shape']} | {r['M']} | {r['routes']} | {r['chunks']} | {r['block_m']} | {us[0]} | "
                     f"{us[1]} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args, shapes = parse_args(argv)
    from moe_modular.kernels.moe_align import num_chunks

    device, timer, shipped, dev_key = trial_context(args)
    rows: list[dict] = []
    failed = False
    for shape_key in args.shapes:
        shape = shapes[shape_key]
        for M in args.ms:
            routes = M * shape.topk
            if num_chunks(routes) == 1:
                print(f"{shape_key} M={M}: {routes} routes fit one chunk (one program on either path); skipped",
                      flush=True)
                continue
            block_m = args.block_m or incumbent(shipped, shape, QUANTS["bf16"], M, dev_key).block_m
            ids = make_inputs(shape, M, 1, device, args.seed)[0].topk_ids
            check_paths(ids, block_m, shape.E)
            best = time_variants(path_timer(ids, block_m, shape.E, timer, args.repeat), list(PATHS.items()),
                                 args.rounds)
            row = {"shape": shape_key, "M": M, "E": shape.E, "topk": shape.topk, "routes": routes,
                   "chunks": num_chunks(routes), "block_m": block_m}
            for label in PATHS:
                t, err = best[label]
                ok = not err and math.isfinite(t)
                failed |= not ok
                row[f"us_{label}"] = t * 1e6 if ok else None
                print(f"{shape_key} M={M} {label}: {f'{t * 1e6:.2f} us' if ok else 'failed: ' + err}", flush=True)
            both = row["us_one"] is not None and row["us_three"] is not None
            row["three_over_one"] = row["us_three"] / row["us_one"] if both else None
            rows.append(row)
    write_csv(os.path.join(args.out, "align_paths.csv"), rows, CSV_FIELDS)
    print(table(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
