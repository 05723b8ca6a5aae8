"""Sweep TritonExperts tile configurations on the GPU and write tuned tables (moe_modular/tile_config.py).

    python -m tools.tune_moe --shapes qwen3 --quant bf16 --out OUT            # every bench M bucket
    python -m tools.tune_moe --shapes deepseek-v3 -m 1 64 --space small --out OUT
    python -m tools.tune_moe --smoke --out OUT                               # tiny, CPU interpreter

For each shape, scheme and M bucket, two stages, each candidate timed as the full modular-kernel
forward (NoEP PF) replayed from a CUDA graph with an L2 flush before each repetition:
  1. one tile shared by both GEMMs, over the search space (pruned: shared memory, accumulator
     registers, BLOCK_M against the tokens per expert, BLOCK_K within the fp8 block), plus the
     incumbent: the tiles TritonExperts picks today (the shipped table's entry, or the default
     heuristic), so a tuned bucket is never slower than what it replaces in the same run;
  2. with the best first GEMM kept (both GEMMs share the alignment block), the second GEMM's
     BLOCK_N / BLOCK_K / GROUP_M / num_warps / num_stages over the same space;
  3. the best tiles so far with each launch option that can change their speed on this device
     (launch_options: a persistent second GEMM; on Hopper and later also programmatic dependent
     launches, and the warp-specialized kernel for unquantized tiles it takes), and on Hopper for
     fp8 1 x 128 / 128 x 128 blocks and fp8 per-token the fp8 warp-specialized kernel's own
     configurations (tile_config.fp8_ws_tile_configs: its fixed 128-row tile, the second GEMM also
     as a 256-column wide tile), where its 128-row tiles are not mostly padding; none is timed twice in a bucket.
Writes OUT/<TileConfigTable.file_name(key)> per (shape, scheme) (copy into moe_modular/configs/ to
ship it; buckets of the shipped table that this run did not tune are carried over unless
--no-merge) and OUT/tune_moe.csv with every trial. A candidate that fails to compile or launch
(out of resources) is recorded and skipped. --budget-s stops the sweep and writes what was found.
"""
from __future__ import annotations

import argparse
import csv
import itertools
import math
import os
import random
import sys
import time
from dataclasses import replace
from typing import Callable, Optional

import torch

from tools.bench_common import (
    BENCH_MS,
    QUANTS,
    SHAPES,
    SMOKE_SHAPES,
    Shape,
    Timer,
    capture_graph,
    make_inputs,
    make_weights,
    n_sets_for,
    resolve_shapes_and_quants,
)

# Search spaces: "full" is the cross product below (pruned), "small" a short list that covers the
# decode (narrow BLOCK_M, deep BLOCK_K) and prefill (128-row tiles, grouped order) regimes.
FULL_SPACE = dict(BLOCK_M=(16, 32, 64, 128), BLOCK_N=(32, 64, 128, 256), BLOCK_K=(64, 128, 256),
                  GROUP_M=(1, 8), num_warps=(4, 8), num_stages=(2, 3, 4, 5))
SMALL_SPACE = [  # (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages); candidates() appends b_tma, a_tma,
    # act_q
    # decode: one or two tokens per expert, the weights stream through
    (16, 32, 128, 1, 4, 4), (16, 32, 256, 1, 4, 3), (16, 64, 128, 1, 4, 4), (16, 64, 256, 1, 4, 3),
    (16, 64, 256, 1, 4, 4), (16, 128, 128, 1, 4, 3), (16, 128, 256, 1, 8, 3),
    # a few to a few dozen tokens per expert
    (32, 64, 128, 1, 4, 4), (32, 64, 256, 1, 4, 3), (32, 128, 64, 1, 4, 4), (64, 64, 64, 8, 4, 4),
    (64, 64, 128, 8, 4, 4), (64, 128, 64, 8, 4, 4), (64, 128, 128, 8, 8, 3), (64, 256, 64, 8, 8, 4),
    # prefill: compute-bound, wide tiles in grouped order
    (128, 128, 64, 8, 4, 4), (128, 128, 64, 8, 8, 4), (128, 128, 128, 8, 8, 3), (128, 256, 64, 8, 8, 3),
    (128, 256, 64, 8, 8, 4), (256, 128, 64, 8, 8, 3),
]
SMOKE_SPACE = [(16, 32, 32, 1, 4, 1), (32, 64, 64, 1, 4, 1)]
# Hopper: 227 KiB of shared memory per block; keep a margin for the epilogue.
SMEM_BYTES = 200 * 1024
# fp32 accumulator registers per thread above which a tile spills.
MAX_ACC_PER_THREAD = 128


# The table-entry fields a candidate tuple holds, in order (the tile, two load paths, act_q); the others
# (persistent, pdl, ws: stage 3) keep their defaults.
TUNED_FIELDS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "b_tma", "a_tma", "act_q")


def _fields(t: tuple) -> dict:
    """A candidate tuple as one GEMM's table-entry fields."""
    return dict(zip(TUNED_FIELDS, t, strict=True))


def _config(t1: tuple, t2: tuple):
    """The TileConfig of a first- and a second-GEMM candidate."""
    from moe_modular.tile_config import TileConfig

    return TileConfig.from_gemm_fields(_fields(t1), _fields(t2))


def _tuned(cfg, which: str) -> tuple:
    """The candidate tuple of one GEMM of a TileConfig (its TUNED_FIELDS)."""
    d = cfg.gemm_fields(which)
    return tuple(d[f] for f in TUNED_FIELDS)


def _fits(t, elt_bytes: int, per_expert: float, block_k_limit: Optional[int]) -> bool:
    bm, bn, bk, gm, warps, stages = t[:6]
    if stages * (bm * bk + bk * bn) * elt_bytes > SMEM_BYTES:
        return False
    if bm * bn / (warps * 32) > MAX_ACC_PER_THREAD:
        return False
    if bm * bn < 16 * 64 and warps > 4:
        return False
    if block_k_limit is not None and bk > block_k_limit:
        return False
    return not _mostly_padding(bm, per_expert)


def _mostly_padding(block_m: int, per_expert: float) -> bool:
    """Whether BLOCK_M is far above the tokens an expert gets, so its rows are mostly padding: the smallest block
    is kept, and those up to twice the average."""
    return block_m > 16 and block_m > 2 * 2 ** math.ceil(math.log2(max(per_expert, 1)))


def candidates(space: str, elt_bytes: int, per_expert: float, block_k_limit: Optional[int],
               max_configs: Optional[int], seed: int, b_tma: tuple[int, ...] = (0,),
               a_tma: tuple[int, ...] = (0,), act_q: tuple[int, ...] = (0,)) -> list[tuple]:
    """Stage-1 tiles (shared by both GEMMs) as tuples in GemmTile field order, each once per (b_tma, a_tma,
    act_q) triple of values; act_q 1 only with a group (block_k_limit) that the fused first GEMM's
    per-half BLOCK_N (BLOCK_N / 2) holds whole."""
    if space == "smoke":
        pool = list(SMOKE_SPACE)
    elif space == "small":
        pool = list(SMALL_SPACE)
    else:
        pool = list(itertools.product(*FULL_SPACE.values()))
    pool = [t for t in pool if _fits(t, elt_bytes, per_expert, block_k_limit)] if space != "smoke" else pool
    if max_configs is not None and len(pool) > max_configs:
        pool = random.Random(seed).sample(pool, max_configs)
    return [t + (tb, ta, aq) for aq in act_q for ta in a_tma for tb in b_tma for t in pool
            if not aq or (block_k_limit is not None and (t[1] // 2) % block_k_limit == 0)]


def gemm2_candidates(best: tuple, pool: list[tuple], tried: tuple = (),
                     fits: Callable[[tuple], bool] = lambda t: True) -> list[tuple]:
    """Stage-2 tiles for the second GEMM: the pool's tiles with BLOCK_M and act_q (the last field, a
    first-GEMM option) set to best's that still `fit`, except the second-GEMM tiles already timed with
    this first GEMM (`tried`)."""
    seen, out = set(tried) | {best}, []
    for t in pool:
        c = (best[0],) + tuple(t[1:-1]) + (best[-1],)
        if c not in seen and fits(c):
            seen.add(c)
            out.append(c)
    return out


def launch_options(best, *, hopper: bool, quant, per_expert: float) -> list:
    """Stage-3 configurations, those that differ from `best` (a TileConfig): best with one launch option each
    (the second GEMM persistent, 2: loop nest flattened; on Hopper and later (hopper) the second GEMM, or both
    GEMMs, launched as programmatic dependents (pdl), and, unquantized, both GEMMs in the warp-specialized kernel
    on sorted rows (ws with a_tma) where the tiles suit it (BLOCK_M and warps)); then, on Hopper, for an fp8
    scheme the fp8 warp-specialized kernel takes, its own configurations (tile_config.fp8_ws_tile_configs: its
    128-row tile, the second GEMM also wide) unless 128-row tiles would be mostly padding at per_expert routes
    per expert."""
    from moe_modular.kernels.moe_gemm import WS_MIN_BLOCK_M, WS_WARPS
    from moe_modular.tile_config import fp8_ws_tile_configs

    g1, g2, l1, l2 = best.gemm1, best.gemm2, best.launch1, best.launch2
    out = [replace(best, launch2=replace(l2, persistent=2))]
    if hopper:
        out += [replace(best, launch2=replace(l2, pdl=1)),
                replace(best, launch1=replace(l1, pdl=1), launch2=replace(l2, pdl=1))]
        if not quant.is_quantized and g1.BLOCK_M >= WS_MIN_BLOCK_M and {g1.num_warps, g2.num_warps} <= set(WS_WARPS):
            out.append(replace(best, launch1=replace(l1, ws=1, a_tma=1), launch2=replace(l2, ws=1, a_tma=1)))
        fp8_ws = fp8_ws_tile_configs(quant)
        if fp8_ws and not _mostly_padding(fp8_ws[0].gemm1.BLOCK_M, per_expert):
            out += fp8_ws
    unique = []
    for cfg in out:
        if cfg != best and cfg not in unique:
            unique.append(cfg)
    return unique


# The most stage-3 configurations launch_options returns (the progress bar's count per bucket): three launch
# options, then the unquantized warp-specialized one or up to three fp8_ws_tile_configs (fp8 per-token).
MAX_LAUNCH_OPTIONS = 6


def incumbent(table, shape: Shape, qc, M: int, device: str):
    """The tiles TritonExperts would use today for this problem (shipped table or default heuristic)."""
    return table.select(M, shape.E, shape.N, shape.K, shape.topk, torch.bfloat16, qc, device)


class Trial:
    """Time one forward of TritonExperts with fixed tiles (CUDA graph on a GPU, eager on the CPU)."""

    def __init__(self, shape: Shape, qc, M: int, weights, sets, timer: Timer) -> None:
        from moe_modular.config import MoEConfig
        from moe_modular.prepare_finalize.no_ep import MoEPrepareAndFinalizeNoEP

        self.moe = MoEConfig(num_experts=shape.E, topk=shape.topk, hidden_dim=shape.K, intermediate_dim=shape.N,
                             dtype=torch.bfloat16, quant=qc, max_num_tokens=max(M, 1))
        self.pf = MoEPrepareAndFinalizeNoEP.make(self.moe)
        self.weights, self.sets, self.timer = weights, sets, timer

    def kernel(self, tile_config):
        """The modular kernel (NoEP PF, TritonExperts with these tiles) the trial times."""
        from moe_modular.experts.triton_experts import TritonExperts
        from moe_modular.modular_kernel import FusedMoEModularKernel

        return FusedMoEModularKernel(self.pf, TritonExperts(self.moe, self.weights.qp, tile_config=tile_config))

    def __call__(self, tile_config) -> float:
        mk = self.kernel(tile_config)
        w = self.weights
        fns = [(lambda s=s: mk(s.x, w.w1, w.w2, s.topk_weights, s.topk_ids)) for s in self.sets]
        if self.timer.cuda:
            graph = capture_graph(fns, self.timer.device)
            t = self.timer.median_s(graph.replay, per_call=len(fns))
            del graph
            return t
        return self.timer.median_s(fns[0])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", help=f"of {list(SHAPES)} (smoke: {list(SMOKE_SHAPES)})")
    p.add_argument("-m", "--m", dest="ms", type=int, nargs="+", help=f"M buckets (default {BENCH_MS})")
    p.add_argument("--quant", nargs="+", default=["bf16"], help=f"of {list(QUANTS)}")
    p.add_argument("--space", choices=("small", "full"), default="small")
    p.add_argument("--max-configs", type=int, help="sample at most this many stage-1 tiles per bucket")
    p.add_argument("--b-tma", choices=("off", "on", "both"),
                   help="weight tiles through pointers (off), tensor descriptors / TMA (on), or each tile both ways "
                        "(default: both on a GPU with TMA, compute capability >= 9, else off)")
    p.add_argument("--a-tma", choices=("off", "on", "both"), default="off",
                   help="activation tiles through pointers (off), tensor descriptors (on), or each tile both ways; "
                        "descriptors need sorted rows (unquantized SiLU / GELU: the tokens are gathered first for "
                        "the first GEMM, the intermediate is written sorted for the second); default off")
    p.add_argument("--act-q", choices=("off", "on", "both"), default="off",
                   help="fp8-block: the intermediate's activation and group quantization in the first GEMM's epilogue "
                        "(on; tiles whose BLOCK_N / 2 holds whole groups) or in act_and_mul (off), or both ways")
    p.add_argument("--no-gemm2", dest="gemm2", action="store_false", help="skip stage 2 (gemm2 overrides)")
    p.add_argument("--no-options", dest="options", action="store_false",
                   help="skip stage 3 (launch options: persistent, pdl, ws on the best tiles; the fp8 "
                        "warp-specialized kernel's configurations)")
    p.add_argument("--no-incumbent", dest="incumbent", action="store_false",
                   help="do not time the tiles TritonExperts picks today as a stage-1 candidate")
    p.add_argument("--no-merge", dest="merge", action="store_false",
                   help="write only the buckets tuned in this run (default: carry the shipped table's others)")
    p.add_argument("--rep-ms", type=float, default=30.0)
    p.add_argument("--budget-s", type=float, help="stop after this many seconds and write what was found")
    p.add_argument("--out", default="tune_out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny shape, two tiles, the CPU interpreter")
    args = p.parse_args(argv)
    shapes = resolve_shapes_and_quants(p, args, smoke_default=["tiny"])
    args.ms = args.ms or ([8] if args.smoke else BENCH_MS)
    args.hopper = False  # compute capability >= 9: TMA, programmatic dependent launch, the Gluon kernel
    if torch.cuda.is_available():  # (no triton import on the CPU: --smoke selects the interpreter later)
        from moe_modular.kernels.host import gpu_has_tma

        args.hopper = gpu_has_tma(torch.device("cuda", torch.cuda.current_device()))
    if args.b_tma is None:  # descriptors fall back to pointers without TMA: timing both would repeat trials
        args.b_tma = "both" if args.hopper else "off"
    ways = {"off": (0,), "on": (1,), "both": (0, 1)}
    args.b_tma, args.a_tma, args.act_q = ways[args.b_tma], ways[args.a_tma], ways[args.act_q]
    if args.smoke:
        args.space, args.gemm2, args.rep_ms, args.b_tma = "smoke", False, 1.0, (0,)
    return args, shapes


def trial_context(args):
    """(device, timer, shipped tables, device table key) for timing trials; makes args.out."""
    from moe_modular.tile_config import TileConfigTable, device_name

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    timer = Timer(device, args.rep_ms, min_reps=1 if args.smoke else 5, max_reps=100)
    os.makedirs(args.out, exist_ok=True)
    return device, timer, TileConfigTable.load(), device_name(device)


def main(argv=None) -> int:
    args, shapes = parse_args(argv)
    if args.smoke and not torch.cuda.is_available():
        from moe_modular.testing.triton_interpreter import use_interpreter

        use_interpreter()
    from moe_modular.testing.progress import ProgressBar

    from moe_modular.tile_config import TileConfig, TileConfigTable

    device, timer, shipped, dev_key = trial_context(args)
    deadline = time.monotonic() + args.budget_s if args.budget_s else math.inf
    trials: list[dict] = []
    written: list[str] = []
    for shape_key in args.shapes:
        shape = shapes[shape_key]
        for quant_key in args.quant:
            qc = QUANTS[quant_key]
            weights = make_weights(shape, qc, device, args.seed)
            elt = 1 if qc.is_quantized else 2
            limit = qc.block_shape[1] if qc.is_block else None
            plans = []
            for M in args.ms:
                pool = candidates(args.space, elt, M * shape.topk / shape.E, limit, args.max_configs, args.seed + M,
                                  args.b_tma, args.a_tma, args.act_q)
                plans.append((M, pool))

            def per_bucket(pool: list) -> int:
                return (len(pool) + args.incumbent) * (2 if args.gemm2 else 1) + MAX_LAUNCH_OPTIONS * args.options

            total = sum(per_bucket(pool) for _, pool in plans)
            bar = ProgressBar(total, f"{shape_key} {quant_key}")
            buckets: dict[int, TileConfig] = {}
            for M, pool in plans:
                sets = make_inputs(shape, M, n_sets_for(shape, qc, M, timer.l2_bytes), device, args.seed)
                trial = Trial(shape, qc, M, weights, sets, timer)
                results: list[tuple[float, TileConfig]] = []

                def run(cfg: TileConfig, stage: int) -> None:
                    if time.monotonic() > deadline:
                        bar.update(1, "budget reached")
                        return
                    rec = {"shape": shape_key, "quant": quant_key, "M": M, "stage": stage, **{
                        f"g1_{k}": v for k, v in cfg.gemm_fields("gemm1").items()}, **{
                        f"g2_{k}": v for k, v in cfg.gemm_fields("gemm2").items()}}
                    try:
                        t = trial(cfg)
                        rec["us"] = t * 1e6
                        results.append((t, cfg))
                        note = f"M={M} {t * 1e6:.1f} us"
                    except Exception as exc:  # noqa: BLE001 - compile / launch failures skip the tile
                        rec["error"] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
                        note = f"M={M} failed"
                    trials.append(rec)
                    bar.update(1, note)

                stage1 = [_config(t, t) for t in pool]
                if args.incumbent:
                    now = incumbent(shipped, shape, qc, M, dev_key)
                    stage1 = [now] + [c for c in stage1 if c != now]
                for cfg in stage1:
                    run(cfg, 1)
                todo = []
                if results and args.gemm2:
                    g1 = min(results, key=lambda r: r[0])[1].gemm_fields("gemm1")  # launch options included
                    tried = tuple(_tuned(c, "gemm2") for _, c in results if c.gemm_fields("gemm1") == g1)
                    per_expert = M * shape.topk / shape.E
                    todo = gemm2_candidates(tuple(g1[f] for f in TUNED_FIELDS), pool, tried,
                                            lambda t: args.space == "smoke" or _fits(t, elt, per_expert, limit))
                    for t2 in todo:
                        run(TileConfig.from_gemm_fields(g1, _fields(t2)), 2)
                options = []
                if results and args.options:
                    timed = [c for _, c in results]
                    options = [c for c in launch_options(min(results, key=lambda r: r[0])[1], hopper=args.hopper,
                                                         quant=qc, per_expert=M * shape.topk / shape.E)
                               if c not in timed]
                    for cfg in options:
                        run(cfg, 3)
                # the bar counted every bucket at its most trials; settle the ones this bucket skipped
                bar.update(max(0, per_bucket(pool) - len(stage1) - len(todo) - len(options)))
                if results:
                    buckets[M] = min(results, key=lambda r: r[0])[1]
                sets = trial = None  # drop the references (closures above use these names)
            bar.close()
            if buckets:
                key = TileConfigTable.key_for(shape.E, shape.N, shape.K, torch.bfloat16, qc, dev_key)
                if args.merge:
                    buckets = {**shipped.tables.get(key, {}), **buckets}
                comment = (f"TritonExperts tiles tuned by tools/tune_moe.py (space {args.space}, CUDA graph, NoEP PF)\n"
                           f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
                path = os.path.join(args.out, TileConfigTable.file_name(key))
                with open(path, "w") as f:
                    f.write(TileConfigTable.to_yaml(key, buckets, comment))
                written.append(path)
                for M, cfg in sorted(buckets.items()):
                    print(f"{shape_key} {quant_key} M={M}: {cfg.to_dict()}")
            weights = None  # drop the references (closures above use these names)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if trials:
        head = ["shape", "quant", "M", "stage"]
        fields = head + sorted({k for r in trials for k in r} - set(head))
        with open(os.path.join(args.out, "tune_moe.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerows(trials)
    for path in written:
        print(f"wrote {path}")
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main())
