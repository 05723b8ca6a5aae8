"""GPU time of moe_align (token-to-expert alignment) on tools/benchmark_moe's random routing, optionally side
by side with another version of the kernel file.

    python -m tools.align_time --shapes mixtral qwen3 deepseek-v3 -m 8 64 256 1024 4096 16384
    python -m tools.align_time --baseline OLD/moe_modular/kernels/moe_align.py     # this tree's against OLD's
    python -m tools.align_time --smoke --out OUT        # tiny shapes, the CPU interpreter

Per cell: the routes of M tokens (top-k of a softmax over random logits, as the benchmark draws them) and BLOCK_M
from the shipped tile tables (the one TritonExperts would use for that M, or --block-m). Every version is first
checked equal to the oracle (`moe_align_torch`), then the versions are timed alternately for --rounds rounds,
each keeping its best. On a GPU a timing replays a CUDA graph of --repeat alignments after an L2 flush (GPU time
per alignment, no host launch cost); on the CPU each call is timed eagerly. A baseline file is loaded as a
module of its own: it must import only what this tree's moe_align.py can (the package's launcher and host
helpers) and keep moe_align's signature. "baseline / this" > 1: this tree's is faster. Prints a table last and
writes OUT/align_time.csv.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys

import torch

from tools.ab_tiles import time_variants
from tools.benchmark_moe import QUANTS, capture_graph, make_inputs, resolve_shapes_and_quants, write_csv
from tools.tune_moe import incumbent, trial_context

CSV_FIELDS = ("shape", "M", "E", "topk", "routes", "block_m", "us", "us_baseline", "baseline_over_this")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", help="of mixtral, qwen3, deepseek-v3 (smoke: tiny, tiny-e16)")
    p.add_argument("-m", "--m", dest="ms", type=int, nargs="+", help="token counts (default 8 64 256 1024 4096 16384)")
    p.add_argument("--block-m", type=int, default=0, help="BLOCK_M for every cell (default: the shipped tables')")
    p.add_argument("--baseline", help="another moe_align.py to time side by side with this tree's")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; each version keeps its best")
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
    if args.baseline and not os.path.isfile(args.baseline):
        p.error(f"--baseline ({args.baseline}) is not a file")
    args.ms = args.ms or ([1, 40, 100] if args.smoke else [8, 64, 256, 1024, 4096, 16384])
    if min(args.ms) < 1:
        p.error(f"-m ({min(args.ms)}) must be >= 1")
    if args.smoke:
        args.rep_ms, args.rounds, args.repeat = 1.0, 1, 1
    if args.smoke and not torch.cuda.is_available():
        from tests.triton_interpreter_patch import use_interpreter

        use_interpreter()
    return args, shapes


def load_baseline(path: str):
    """The moe_align module in the file at path, imported under a name of its own."""
    spec = importlib.util.spec_from_file_location("moe_align_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check(module, topk_ids: torch.Tensor, block_m: int, E: int, label: str) -> None:
    """Raise unless module.moe_align gives the oracle's sorted ids, block experts and count."""
    from moe_modular.kernels.moe_align import moe_align_torch

    ref_sorted, ref_blocks, ref_n = moe_align_torch(topk_ids.cpu(), block_m, E)
    sorted_ids, block_expert, npp = module.moe_align(topk_ids, block_m, E)
    n = int(npp.item())
    if n != ref_n or not torch.equal(sorted_ids[:n].cpu(), ref_sorted) or \
            not torch.equal(block_expert[: n // block_m].cpu(), ref_blocks):
        raise RuntimeError(f"moe_align of {label} differs from the oracle (num_post_padded {n}, want {ref_n})")


def timer_of(topk_ids: torch.Tensor, block_m: int, E: int, timer, repeat: int):
    """trial(module) -> seconds per alignment through module.moe_align, on buffers of its own."""

    def trial(module) -> float:
        buffers = {name: torch.empty(n, dtype=torch.int32, device=topk_ids.device)
                   for name, n in module.align_workspace_numel(topk_ids.numel(), E, block_m).items()}
        run = lambda: module.moe_align(topk_ids, block_m, E, buffers=buffers)  # noqa: E731
        if not timer.cuda:
            return timer.median_s(run)
        graph = capture_graph([run] * repeat, topk_ids.device)
        return timer.median_s(graph.replay, per_call=repeat)

    return trial


def table(rows: list[dict], baseline: bool) -> str:
    head = "| shape | M | routes | BLOCK_M | us |" + (" baseline us | baseline / this |" if baseline else "")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        line = f"| {r['shape']} | {r['M']} | {r['routes']} | {r['block_m']} | {_us(r['us'])} |"
        if baseline:
            ratio = "-" if r["baseline_over_this"] is None else f"{r['baseline_over_this']:.3f}"
            line += f" {_us(r['us_baseline'])} | {ratio} |"
        lines.append(line)
    return "\n".join(lines)


def _us(v) -> str:
    return "failed" if v is None else f"{v:.2f}"


def main(argv=None) -> int:
    args, shapes = parse_args(argv)
    from moe_modular.kernels import moe_align as this

    versions = {"this": this}
    if args.baseline:
        versions["baseline"] = load_baseline(args.baseline)
    device, timer, shipped, dev_key = trial_context(args)
    rows: list[dict] = []
    failed = False
    for shape_key in args.shapes:
        shape = shapes[shape_key]
        for M in args.ms:
            block_m = args.block_m or incumbent(shipped, shape, QUANTS["bf16"], M, dev_key).block_m
            ids = make_inputs(shape, M, 1, device, args.seed)[0].topk_ids
            for label, module in versions.items():
                check(module, ids, block_m, shape.E, label)
            best = time_variants(timer_of(ids, block_m, shape.E, timer, args.repeat), list(versions.items()),
                                 args.rounds)
            row = {"shape": shape_key, "M": M, "E": shape.E, "topk": shape.topk, "routes": M * shape.topk,
                   "block_m": block_m, "us_baseline": None, "baseline_over_this": None}
            for label in versions:
                t, err = best[label]
                ok = not err and math.isfinite(t)
                failed |= not ok
                row["us" if label == "this" else "us_baseline"] = t * 1e6 if ok else None
                print(f"{shape_key} M={M} {label}: {f'{t * 1e6:.2f} us' if ok else 'failed: ' + err}", flush=True)
            if row["us"] is not None and row["us_baseline"] is not None:
                row["baseline_over_this"] = row["us_baseline"] / row["us"]
            rows.append(row)
    write_csv(os.path.join(args.out, "align_time.csv"), rows, CSV_FIELDS)
    print(table(rows, bool(args.baseline)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
