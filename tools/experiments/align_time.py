"""GPU time of moe_align (token-to-expert alignment) on tools/benchmark_moe's random routing, optionally side
by side with another version of the kernel file.

    python -m tools.experiments.align_time --shapes mixtral qwen3 deepseek-v3 -m 8 64 256 1024 4096 16384
    python -m tools.experiments.align_time --baseline OLD/moe_modular/kernels/moe_align.py     # this tree's against OLD's
    python -m tools.experiments.align_time --baseline OLD/.../moe_align.py --forward  # and the whole forward with each
    python -m tools.experiments.align_time --smoke --out OUT        # tiny shapes, the CPU interpreter

Per cell: the routes of M tokens (top-k of a softmax over random logits, as the benchmark draws them) and BLOCK_M
from the shipped tile tables (the one TritonExperts would use for that M, or --block-m). Every version is first
checked equal to the oracle (`moe_align_torch`), then the versions are timed alternately for --rounds rounds,
each keeping its best. On a GPU a timing replays a CUDA graph of --repeat alignments after an L2 flush (GPU time
per alignment, no host launch cost); on the CPU each call is timed eagerly. A baseline file is loaded as a
module of its own: it must import only what this tree's moe_align.py can (the package's launcher and host
helpers) and keep moe_align's signature. "baseline / this" > 1: this tree's is faster. --forward also times one
bf16 forward of the cell (NoEP PF and TritonExperts with the same tiles, tools/tune_moe.py's trial: a CUDA graph
after an L2 flush) with each version as TritonExperts' alignment, alternating in the same rounds. Prints a table
last and writes OUT/align_time.csv.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys

import torch

from tools.experiments.ab_tiles import time_variants, variant_times_us
from tools.bench_common import (
    QUANTS,
    capture_graph,
    make_inputs,
    make_weights,
    n_sets_for,
    resolve_shapes_and_quants,
    spot_check,
    write_csv,
)
from tools.tune_moe import Trial, incumbent, trial_context

CSV_FIELDS = ("shape", "M", "E", "topk", "routes", "block_m", "us", "us_baseline", "baseline_over_this",
              "fwd_us", "fwd_us_baseline", "fwd_baseline_over_this")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", help="of mixtral, qwen3, deepseek-v3 (smoke: tiny, tiny-e16)")
    p.add_argument("-m", "--m", dest="ms", type=int, nargs="+", help="token counts (default 8 64 256 1024 4096 16384)")
    p.add_argument("--block-m", type=int, default=0, help="BLOCK_M for every cell (default: the shipped tables')")
    p.add_argument("--baseline", help="another moe_align.py to time side by side with this tree's")
    p.add_argument("--forward", action="store_true", help="also time the bf16 forward with each version")
    p.add_argument("--check-tol", type=float, default=0.05, help="largest relative error of the forward's spot check")
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
        from moe_modular.testing.triton_interpreter import use_interpreter

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


@contextlib.contextmanager
def forward_alignment(module):
    """TritonExperts aligning through module.moe_align (on buffers of module's own sizes) for the block."""
    from moe_modular.experts import triton_experts

    shipped = triton_experts.moe_align

    def align(topk_ids, block_m, El, expert_map=None, buffers=None):
        return module.moe_align(topk_ids, block_m, El, expert_map)

    triton_experts.moe_align = shipped if module.moe_align is shipped else align
    try:
        yield
    finally:
        triton_experts.moe_align = shipped


def forward_timer(trial: Trial, cfg, check, tol: float):
    """trial(module) -> seconds per forward with module's alignment, after a spot check of its output."""

    def run(module) -> float:
        with forward_alignment(module):
            err = check(trial.kernel(cfg))
            if not err <= tol:
                raise RuntimeError(f"spot check: relative error {err:.2e} > {tol}")
            return trial(cfg)

    return run


def table(rows: list[dict], baseline: bool, forward: bool) -> str:
    cols = [("us", "us")] + ([("us_baseline", "baseline us"), ("baseline_over_this", "baseline / this")]
                             if baseline else [])
    if forward:
        cols += [("fwd_us", "forward us")] + ([("fwd_us_baseline", "forward baseline us"),
                                               ("fwd_baseline_over_this", "baseline / this")] if baseline else [])
    head = "| shape | M | routes | BLOCK_M | " + " | ".join(label for _, label in cols) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = [_fmt(r[key], ".3f" if "over" in key else ".2f") for key, _ in cols]
        lines.append(f"| {r['shape']} | {r['M']} | {r['routes']} | {r['block_m']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(v, spec: str) -> str:
    return "failed" if v is None else format(v, spec)


def _record(row: dict, prefix: str, best: dict, cell: str) -> bool:
    """Put best's times into row as prefix + us[_baseline] and their ratio; True if any failed."""
    us, failed = variant_times_us(best, cell)
    this, base = us["this"], us.get("baseline")
    row[prefix + "us"], row[prefix + "us_baseline"] = this, base
    row[prefix + "baseline_over_this"] = base / this if this is not None and base is not None else None
    return failed


def main(argv=None) -> int:
    args, shapes = parse_args(argv)
    from moe_modular.kernels import moe_align as this

    versions = {"this": this}
    if args.baseline:
        versions["baseline"] = load_baseline(args.baseline)
    device, timer, shipped, dev_key = trial_context(args)
    qc = QUANTS["bf16"]
    rows: list[dict] = []
    failed = False
    for shape_key in args.shapes:
        shape = shapes[shape_key]
        weights = make_weights(shape, qc, device, args.seed) if args.forward else None
        for M in args.ms:
            cfg = incumbent(shipped, shape, qc, M, dev_key)
            block_m = args.block_m or cfg.block_m
            sets = make_inputs(shape, M, n_sets_for(shape, qc, M, timer.l2_bytes) if args.forward else 1, device,
                               args.seed)
            ids = sets[0].topk_ids
            for label, module in versions.items():
                check(module, ids, block_m, shape.E, label)
            cell = f"{shape_key} M={M}"
            row = {"shape": shape_key, "M": M, "E": shape.E, "topk": shape.topk, "routes": M * shape.topk,
                   "block_m": block_m, **dict.fromkeys(CSV_FIELDS[7:])}
            trials = [("", timer_of(ids, block_m, shape.E, timer, args.repeat), "alignment")]
            if args.forward:
                s0 = sets[0]
                out_err = lambda mk: spot_check(shape, qc, weights, s0, mk(s0.x, weights.w1, weights.w2,  # noqa: E731
                                                                            s0.topk_weights, s0.topk_ids))
                trials.append(("fwd_", forward_timer(Trial(shape, qc, M, weights, sets, timer), cfg, out_err,
                                                     args.check_tol), "forward"))
            for prefix, trial, what in trials:
                best = time_variants(trial, list(versions.items()), args.rounds)
                failed |= _record(row, prefix, best, f"{cell} {what}")
            rows.append(row)
            del sets
        weights = None  # drop the references (closures above use these names)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    write_csv(os.path.join(args.out, "align_time.csv"), rows, CSV_FIELDS)
    print(table(rows, bool(args.baseline), args.forward))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
