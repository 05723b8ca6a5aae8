"""Side-by-side timing of tile variants of TritonExperts in one process: an A/B for kernel options.

    python -m tools.experiments.ab_tiles --shapes mixtral qwen3 -m 1024 16384 --variant b_tma=1
    python -m tools.experiments.ab_tiles --shapes deepseek-v3 -m 4096 --variant gemm2.num_stages=3 --variant b_tma=1 GROUP_M=16
    python -m tools.experiments.ab_tiles --smoke --out OUT                  # tiny shape, the CPU interpreter

For each shape, scheme and M: the tiles TritonExperts picks today ("base": the shipped table's entry,
or the default heuristic) and each --variant (FIELD=VALUE overrides of base, space-separated; a bare
table-entry field applies to both GEMMs, gemm1.FIELD / gemm2.FIELD to one) are timed like a
tools/tune_moe.py trial: the full forward through the NoEP PF, replayed from a CUDA graph with an L2
flush before each repetition. Base and variants alternate for --rounds rounds and each keeps its best
round, so a slow spell of the device hits all of them. Prints the times and base / variant (> 1: the
variant is faster) last and writes OUT/ab_tiles.csv. Compare kernel options here, not across runs:
compute-bound timings on one GPU move by several percent between runs.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

from tools.bench_common import (
    QUANTS,
    SHAPES,
    SMOKE_SHAPES,
    make_inputs,
    make_weights,
    n_sets_for,
    resolve_shapes_and_quants,
    write_csv,
)
from tools.tune_moe import Trial, incumbent, trial_context

SMOKE_VARIANT = ["b_tma=1"]
CSV_FIELDS = ("shape", "quant", "M", "variant", "us", "ratio", "error", "tiles")


def tile_fields() -> list[str]:
    """The fields a variant may set: a table entry's (tile, launch options, act_q)."""
    from moe_modular.tile_config import TILE_FIELDS

    return list(TILE_FIELDS)


def parse_override(token: str) -> tuple[tuple[str, ...], str, int]:
    """'FIELD=VALUE' or 'gemm1.FIELD=VALUE' -> (the GEMMs it applies to, field, value)."""
    from moe_modular.tile_config import GEMMS

    allowed = tile_fields()
    name, sep, value = token.partition("=")
    gemms: tuple[str, ...] = GEMMS
    if "." in name:
        which, _, name = name.partition(".")
        if which not in GEMMS:
            raise ValueError(f"override {token!r}: prefix {which!r} must be one of {list(GEMMS)}")
        gemms = (which,)
    if name not in allowed:
        raise ValueError(f"override {token!r}: field {name!r} must be one of {allowed}")
    if name == "BLOCK_M" and len(gemms) == 1:
        raise ValueError(f"override {token!r}: BLOCK_M is shared by both GEMMs (the alignment block); "
                         "override it without a gemm1./gemm2. prefix")
    try:
        number = int(value) if sep else None
    except ValueError:
        number = None
    if number is None:
        raise ValueError(f"override {token!r} must be FIELD=INTEGER")
    return gemms, name, number


def apply_overrides(base, overrides: list[tuple[tuple[str, ...], str, int]]):
    """base (a TileConfig) with the overrides applied; TileConfig validates the result."""
    from moe_modular.tile_config import GEMMS, TileConfig

    flat = {g: base.gemm_fields(g) for g in GEMMS}
    for gemms, name, value in overrides:
        for g in gemms:
            flat[g][name] = value
    return TileConfig.from_gemm_fields(flat["gemm1"], flat["gemm2"])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", help=f"of {list(SHAPES)} (smoke: {list(SMOKE_SHAPES)})")
    p.add_argument("-m", "--m", dest="ms", type=int, nargs="+", help="token counts (default 1024 4096 16384)")
    p.add_argument("--quant", nargs="+", default=["bf16"], help=f"of {list(QUANTS)}")
    p.add_argument("--variant", dest="variants", nargs="+", action="append", metavar="FIELD=VALUE",
                   help="one variant of the base tiles (repeat --variant for more)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds; each variant keeps its best")
    p.add_argument("--rep-ms", type=float, default=20.0)
    p.add_argument("--out", default="ab_out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help=f"tiny shape, variant {SMOKE_VARIANT}, the CPU interpreter")
    args = p.parse_args(argv)
    shapes = resolve_shapes_and_quants(p, args, smoke_default=["tiny"])
    if args.rounds < 1:
        p.error(f"--rounds ({args.rounds}) must be >= 1")
    args.variants = args.variants or ([SMOKE_VARIANT] if args.smoke else None)
    if not args.variants:
        p.error("give at least one --variant FIELD=VALUE ...")
    args.ms = args.ms or ([8] if args.smoke else [1024, 4096, 16384])
    if args.smoke:
        args.rep_ms, args.rounds = 1.0, 1
    if args.smoke and not torch.cuda.is_available():
        # before anything imports triton (the overrides are checked against the tile tables' fields)
        from moe_modular.testing.triton_interpreter import use_interpreter

        use_interpreter()
    try:
        args.overrides = [[parse_override(t) for t in v] for v in args.variants]
    except ValueError as exc:
        p.error(f"--variant: {exc}")
    return args, shapes


def time_variants(trial, configs: list[tuple[str, object]], rounds: int) -> dict[str, tuple[float, str]]:
    """{label: (best seconds or inf, error text)}; the configs alternate within each round."""
    best: dict[str, tuple[float, str]] = {label: (math.inf, "") for label, _ in configs}
    for _ in range(rounds):
        for label, cfg in configs:
            if best[label][1]:
                continue  # failed to compile or launch once: do not retry
            try:
                best[label] = (min(best[label][0], trial(cfg)), "")
            except Exception as exc:  # noqa: BLE001 - a variant that cannot run is reported, not fatal
                best[label] = (math.inf, f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}")
    return best


def variant_times_us(best: dict[str, tuple[float, str]], cell: str) -> tuple[dict[str, float | None], bool]:
    """time_variants' result as {label: microseconds, None where it failed}, each printed as it is
    read ("CELL LABEL: T us" or "CELL LABEL: failed: ERROR"); the second value says whether any failed."""
    us: dict[str, float | None] = {}
    for label, (t, err) in best.items():
        ok = not err and math.isfinite(t)
        us[label] = t * 1e6 if ok else None
        print(f"{cell} {label}: {f'{t * 1e6:.2f} us' if ok else 'failed: ' + (err or 'no time')}", flush=True)
    return us, any(v is None for v in us.values())


def table(rows: list[dict]) -> str:
    lines = ["| shape | quant | M | variant | us | base / variant |", "|---|---|---|---|---|---|"]
    for r in rows:
        us = "failed" if r["error"] else f"{r['us']:.1f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(f"| {r['shape']} | {r['quant']} | {r['M']} | {r['variant']} | {us} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args, shapes = parse_args(argv)
    device, timer, shipped, dev_key = trial_context(args)
    rows: list[dict] = []
    for shape_key in args.shapes:
        shape = shapes[shape_key]
        for quant_key in args.quant:
            qc = QUANTS[quant_key]
            weights = make_weights(shape, qc, device, args.seed)
            for M in args.ms:
                sets = make_inputs(shape, M, n_sets_for(shape, qc, M, timer.l2_bytes), device, args.seed)
                trial = Trial(shape, qc, M, weights, sets, timer)
                base = incumbent(shipped, shape, qc, M, dev_key)
                configs: list[tuple[str, object]] = [("base", base)]
                errors: dict[str, str] = {}
                for tokens, overrides in zip(args.variants, args.overrides):
                    label = " ".join(tokens)
                    try:
                        configs.append((label, apply_overrides(base, overrides)))
                    except ValueError as exc:  # e.g. a BLOCK_N that is not a power of two
                        errors[label] = f"ValueError: {exc}"
                best = time_variants(trial, configs, args.rounds)
                best.update({label: (math.inf, err) for label, err in errors.items()})
                us, _ = variant_times_us(best, f"{shape_key} {quant_key} M={M}")
                by_label = dict(configs)
                for label, (_, err) in best.items():
                    cfg = by_label.get(label)
                    ok = us[label] is not None and us["base"] is not None
                    rows.append({"shape": shape_key, "quant": quant_key, "M": M, "variant": label,
                                 "us": us[label], "error": err,
                                 "ratio": us["base"] / us[label] if ok else None,
                                 "tiles": cfg.to_dict() if cfg is not None else None})
                del sets, trial
            del weights
            if device.type == "cuda":
                torch.cuda.empty_cache()
    write_csv(os.path.join(args.out, "ab_tiles.csv"), rows, CSV_FIELDS)
    print(table(rows))
    return 0 if all(r["error"] == "" for r in rows if r["variant"] == "base") else 1


if __name__ == "__main__":
    sys.exit(main())
