"""What the routing costs a cell: TritonExperts on tools/benchmark_moe's random routing against the same M on
balanced routing, and cuBLAS on the balanced rows, side by side in one process.

    python -m tools.experiments.routing_cost --shapes mixtral qwen3 deepseek-v3 -m 1024 4096 16384
    python -m tools.experiments.routing_cost --smoke --out OUT        # tiny shape, the CPU interpreter

Balanced routing: token t's j-th route goes to expert (t * k + j) mod E, so every expert gets exactly
M * k / E routes (M * k must be a multiple of E), and where that is a multiple of BLOCK_M no block holds
padding. Per cell, bf16, the shipped tiles:
- random / balanced: one forward through the NoEP PF, replayed from a CUDA graph with an L2 flush before each
  repetition (as tools/tune_moe.py's trials; eager on the CPU); rows = the rows the grouped GEMMs compute (each
  expert's routes padded to BLOCK_M); the first output rows checked against the float32 oracle;
- bmm: torch.bmm over the experts on the balanced rows, first GEMM (rows, K) x (K, 2N), second (rows, N) x
  (N, K): the same useful flops with no padding, token gather, activation or top-k sum.
The three alternate for --rounds rounds, each keeping its best. TFLOP/s count useful work (2 * M * k * 3 * N * K);
"of rate" divides by the bf16 matmul rate measured at the start (8192^3 torch.mm); the L2 read bandwidth
(tools/experiments/l2_read.py) is measured there too, for what a tile can be fed from L2. Prints a table last and writes
OUT/routing_cost.csv.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from tools.experiments.ab_tiles import time_variants, variant_times_us
from tools.bench_common import (
    QUANTS,
    InputSet,
    capture_graph,
    make_inputs,
    make_weights,
    measure_ceilings,
    n_sets_for,
    resolve_shapes_and_quants,
    spot_check,
    write_csv,
)
from tools.tune_moe import Trial, incumbent, trial_context

CSV_FIELDS = ("shape", "M", "topk", "E", "routes", "block_m", "rows_random", "rows_balanced", "us_random",
              "us_balanced", "us_bmm", "tflops_random", "tflops_balanced", "tflops_bmm", "err_random",
              "err_balanced", "bf16_flops", "l2_read_Bps")
LABELS = ("random", "balanced", "bmm")


def balanced_ids(M: int, topk: int, E: int, device: torch.device) -> torch.Tensor:
    """(M, topk) int32: route j of token t to expert (t * topk + j) mod E; every expert gets M * topk / E."""
    if topk > E:
        raise ValueError(f"topk ({topk}) must be at most E ({E}) for balanced routing")
    if (M * topk) % E:
        raise ValueError(f"M ({M}) * topk ({topk}) must be a multiple of E ({E}) for balanced routing")
    return (torch.arange(M * topk, device=device) % E).view(M, topk).to(torch.int32)


def padded_rows(topk_ids: torch.Tensor, E: int, block_m: int) -> int:
    """Rows the grouped GEMMs compute: each expert's routes rounded up to whole BLOCK_M blocks."""
    counts = torch.bincount(topk_ids.reshape(-1).long(), minlength=E)
    return int(((counts + block_m - 1) // block_m * block_m).sum())


def balanced_sets(sets: list[InputSet], E: int) -> list[InputSet]:
    """The same tokens and top-k weights as sets, routed by balanced_ids."""
    out = []
    for s in sets:
        M, topk = s.topk_ids.shape
        out.append(InputSet(s.x, s.topk_weights, balanced_ids(M, topk, E, s.x.device), min(E, M * topk)))
    return out


class BmmPair:
    """torch.bmm of both GEMMs over the experts on `rows` balanced rows each (weights as TritonExperts holds
    them: w1 (E, 2N, K), w2 (E, K, N))."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, rows: int) -> None:
        E, N2, K = w1.shape
        dev = w1.device
        self.w1t, self.w2t = w1.transpose(1, 2), w2.transpose(1, 2)
        self.a = torch.randn(E, rows, K, device=dev).to(w1.dtype)
        self.h = torch.empty(E, rows, N2, device=dev, dtype=w1.dtype)
        self.mid = torch.randn(E, rows, N2 // 2, device=dev).to(w1.dtype)
        self.y = torch.empty(E, rows, K, device=dev, dtype=w1.dtype)

    def __call__(self) -> None:
        torch.bmm(self.a, self.w1t, out=self.h)
        torch.bmm(self.mid, self.w2t, out=self.y)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", help="of mixtral, qwen3, deepseek-v3 (smoke: tiny, tiny-e16)")
    p.add_argument("-m", "--m", dest="ms", type=int, nargs="+", help="token counts (default 1024 4096 16384)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds; each measurement keeps its best")
    p.add_argument("--rep-ms", type=float, default=20.0)
    p.add_argument("--out", default="routing_out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-tol", type=float, default=0.05, help="largest relative error of the spot checks")
    p.add_argument("--smoke", action="store_true", help="tiny shape, M=8, the CPU interpreter")
    args = p.parse_args(argv)
    args.quant = ["bf16"]
    shapes = resolve_shapes_and_quants(p, args, smoke_default=["tiny"])
    if args.rounds < 1:
        p.error(f"--rounds ({args.rounds}) must be >= 1")
    args.ms = args.ms or ([8] if args.smoke else [1024, 4096, 16384])
    for s in args.shapes:
        for M in args.ms:
            shape = shapes[s]
            if M < 1 or (M * shape.topk) % shape.E:
                p.error(f"-m ({M}): M * topk ({shape.topk}) must be a positive multiple of E ({shape.E}) for "
                        f"shape {s}")
    if args.smoke:
        args.rep_ms, args.rounds = 1.0, 1
    if args.smoke and not torch.cuda.is_available():
        from moe_modular.testing.triton_interpreter import use_interpreter

        use_interpreter()
    return args, shapes


def table(rows: list[dict]) -> str:
    lines = ["| shape | M | routes / expert | BLOCK_M | rows computed: random / balanced | us: random / balanced / "
             "bmm | TFLOP/s (of rate): random | balanced | bmm | balanced speed-up | bmm time / balanced |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def cell(r, key):
        us = r[f"us_{key}"]
        return "failed" if us is None else f"{r[f'tflops_{key}']:.0f} ({r[f'tflops_{key}'] * 1e12 / r['bf16_flops']:.2f})"

    for r in rows:
        us = [r[f"us_{k}"] for k in LABELS]
        times = " / ".join("failed" if u is None else f"{u:.1f}" for u in us)
        speedup = "-" if None in us[:2] else f"{us[0] / us[1]:.3f}"
        vs_bmm = "-" if None in us[1:] else f"{us[2] / us[1]:.3f}"
        lines.append(f"| {r['shape']} | {r['M']} | {r['routes'] // r['E']} | {r['block_m']} | {r['rows_random']} / "
                     f"{r['rows_balanced']} | {times} | {cell(r, 'random')} | {cell(r, 'balanced')} | "
                     f"{cell(r, 'bmm')} | {speedup} | {vs_bmm} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args, shapes = parse_args(argv)
    device, timer, shipped, dev_key = trial_context(args)
    qc = QUANTS["bf16"]
    from tools.experiments.l2_read import l2_read_Bps

    ceil = measure_ceilings(timer, args.smoke)
    l2 = l2_read_Bps(timer, args.smoke)
    rows: list[dict] = []
    failed = False
    for shape_key in args.shapes:
        shape = shapes[shape_key]
        weights = make_weights(shape, qc, device, args.seed)
        for M in args.ms:
            cfg = incumbent(shipped, shape, qc, M, dev_key)
            routes = M * shape.topk
            sets = make_inputs(shape, M, n_sets_for(shape, qc, M, timer.l2_bytes), device, args.seed)
            by_routing = {"random": sets, "balanced": balanced_sets(sets, shape.E)}
            trials = {k: Trial(shape, qc, M, weights, s, timer) for k, s in by_routing.items()}
            errs = {}
            for k, s in by_routing.items():
                out = trials[k].kernel(cfg)(s[0].x, weights.w1, weights.w2, s[0].topk_weights, s[0].topk_ids)
                errs[k] = spot_check(shape, qc, weights, s[0], out)
                if not errs[k] <= args.check_tol:
                    print(f"{shape_key} M={M} {k}: spot check failed, relative error {errs[k]:.2e} "
                          f"(--check-tol {args.check_tol})", flush=True)
                    failed = True
            bmm = BmmPair(weights.w1, weights.w2, routes // shape.E)
            if timer.cuda:
                graph = capture_graph([bmm], device)
                bmm_time = lambda: timer.median_s(graph.replay)  # noqa: E731
            else:
                bmm_time = lambda: timer.median_s(bmm)  # noqa: E731
            runs = [("random", lambda: trials["random"](cfg)), ("balanced", lambda: trials["balanced"](cfg)),
                    ("bmm", bmm_time)]
            best = time_variants(lambda fn: fn(), runs, args.rounds)
            flops = 2 * routes * 3 * shape.N * shape.K
            row = {"shape": shape_key, "M": M, "topk": shape.topk, "E": shape.E, "routes": routes,
                   "block_m": cfg.block_m, "bf16_flops": ceil["bf16_flops"], "l2_read_Bps": l2,
                   "rows_random": padded_rows(sets[0].topk_ids, shape.E, cfg.block_m),
                   "rows_balanced": padded_rows(by_routing["balanced"][0].topk_ids, shape.E, cfg.block_m),
                   "err_random": errs["random"], "err_balanced": errs["balanced"]}
            us, any_failed = variant_times_us(best, f"{shape_key} M={M}")
            failed |= any_failed
            for k in LABELS:
                row[f"us_{k}"] = us[k]
                row[f"tflops_{k}"] = flops / us[k] / 1e6 if us[k] is not None else None
            rows.append(row)
            sets = by_routing = trials = bmm = None  # drop the references (closures above use these names)
            if timer.cuda:
                del graph
        weights = None  # drop the references (closures above use these names)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    write_csv(os.path.join(args.out, "routing_cost.csv"), rows, CSV_FIELDS)
    print(f"L2 read {l2 / 1e12:.2f} TB/s (tools/experiments/l2_read.py)")
    print(f"bf16 matmul rate {ceil['bf16_flops'] / 1e12:.1f} TFLOP/s ({ceil['matmul_n']}^3 torch.mm)")
    print(table(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
