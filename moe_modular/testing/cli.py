"""The combinations-matrix command line: check PrepareAndFinalize x Experts pairs against the float32 oracle.

  python -m tests.test_modular_kernel_combinations --pf-type X --experts-type Y [--world-size N]   # a checkout
  python -m moe_modular.testing.cli ...                                                          # an install
      [-m M ...] [-k K] [-n N] [--num-experts E] [--topk k ...] [--dtype D] [--quant-dtype fp8]
      [--per-token-quantized-activations] [--per-channel-quantized-weights] [--block-shape B B]

Without --pf-type / --experts-type it runs a tour of the valid matrix (each pair once in its first valid
scheme, then each remaining scheme once: every PF, experts class and scheme appears), or with --full the
whole valid matrix, with a progress bar (time left, cell names) and a summary table. Exit codes: 0 all
passed, 1 a case failed, 2 bad arguments or an invalid pair.

main() chooses Triton's interpreter on a machine without a GPU before it imports a kernel module, so this
module imports the class registry only inside its functions.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from moe_modular.config import SUPPORTED_DTYPES, Activation, ExpertPlacement, dtype_name
from moe_modular.quant import QuantConfig
from moe_modular.testing.common import Config
from moe_modular.testing.triton_interpreter import use_interpreter_without_gpu

PROG = "python -m tests.test_modular_kernel_combinations"
# Problem sizes of the matrix on the CPU (the CLI's defaults and the test suite's grid). Each covers an edge:
CPU_MS = (1, 7, 64)  # one token; a prime count; a full small batch
CPU_TOPKS = (1, 2, 4)  # topk=1 (apply-on-input allowed); typical; topk = E/2
CPU_SHAPE = dict(K=192, N=96, E=8)  # K = 1.5 fp8 blocks of 128 (a partial block); N2 = 192


def build_parser() -> argparse.ArgumentParser:
    from moe_modular.testing.mk_objects import FUSED_EXPERTS_BY_NAME, PREPARE_FINALIZE_BY_NAME

    p = argparse.ArgumentParser(prog=PROG,
                                description="Check PrepareAndFinalize x Experts pairs against the float32 oracle.")
    p.add_argument("--pf-type", help=f"one of: {', '.join(PREPARE_FINALIZE_BY_NAME)}")
    p.add_argument("--experts-type", help=f"one of: {', '.join(FUSED_EXPERTS_BY_NAME)}")
    p.add_argument("--world-size", type=int, nargs="+", default=[1], help="EP ranks, one or more sizes (default 1)")
    p.add_argument("-m", type=int, nargs="+", default=list(CPU_MS), help="tokens per rank")
    p.add_argument("-k", type=int, default=CPU_SHAPE["K"], help="hidden size K")
    p.add_argument("-n", type=int, default=CPU_SHAPE["N"], help="intermediate size N")
    p.add_argument("--num-experts", type=int, default=CPU_SHAPE["E"])
    p.add_argument("--topk", type=int, nargs="+", default=list(CPU_TOPKS))
    p.add_argument("--dtype", default=None, help=f"activation dtype, one of {list(SUPPORTED_DTYPES)}")
    p.add_argument("--activation", default=Activation.SILU.value, help=f"one of {[a.value for a in Activation]}")
    p.add_argument("--placement", default=ExpertPlacement.LINEAR.value,
                   help=f"expert placement, one of {[p.value for p in ExpertPlacement]}")
    p.add_argument("--quant-dtype", default=None, help="none or fp8")
    p.add_argument("--per-token-quantized-activations", action="store_true")
    p.add_argument("--per-channel-quantized-weights", action="store_true")
    p.add_argument("--static-activation-scale", action="store_true", help="fp8 per-tensor with static scales")
    p.add_argument("--block-shape", type=int, nargs=2, default=None, metavar=("BN", "BK"))
    p.add_argument("--full", action="store_true",
                   help="without --pf-type/--experts-type: every valid cell, not the tour (each pair and scheme once)")
    return p


@dataclass(frozen=True)
class CliRequest:
    """Parsed and validated command line."""

    pf_types: tuple[type, ...]
    fe_types: tuple[type, ...]
    schemes: tuple[tuple[torch.dtype, QuantConfig], ...]
    world_sizes: tuple[int, ...]
    explicit_pair: bool
    shape: dict
    full: bool = False


def parse_request(argv: Optional[Sequence[str]] = None,
                  parser: Optional[argparse.ArgumentParser] = None) -> CliRequest:
    """Parse argv; bad values raise ValueError naming the flag, the value and what is allowed.
    parser: build_parser() extended with a tool's own flags (tools.profile_modular_kernel)."""
    from moe_modular.testing.mk_objects import (
        FUSED_EXPERTS_BY_NAME,
        MK_ALL_PREPARE_FINALIZE_TYPES,
        MK_FUSED_EXPERT_TYPES,
        MK_QUANT_CONFIGS,
        PREPARE_FINALIZE_BY_NAME,
        lookup,
    )

    args = (parser or build_parser()).parse_args(argv)
    if (args.pf_type is None) != (args.experts_type is None):
        raise ValueError("--pf-type and --experts-type go together (give both, or neither for the whole matrix)")
    explicit = args.pf_type is not None
    pf_types = (lookup(PREPARE_FINALIZE_BY_NAME, args.pf_type, "--pf-type"),) if explicit else tuple(MK_ALL_PREPARE_FINALIZE_TYPES)
    fe_types = (lookup(FUSED_EXPERTS_BY_NAME, args.experts_type, "--experts-type"),) if explicit else tuple(MK_FUSED_EXPERT_TYPES)
    if args.dtype is not None and args.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"--dtype ({args.dtype!r}) must be one of {list(SUPPORTED_DTYPES)}")
    quant_flags = (args.quant_dtype is not None or args.per_token_quantized_activations
                   or args.per_channel_quantized_weights or args.block_shape is not None or args.static_activation_scale)
    if quant_flags:
        qc = QuantConfig.from_flags(args.quant_dtype, args.per_token_quantized_activations,
                                    args.per_channel_quantized_weights,
                                    tuple(args.block_shape) if args.block_shape else None,
                                    args.static_activation_scale)
        schemes = ((SUPPORTED_DTYPES[args.dtype] if args.dtype else torch.bfloat16, qc),)
    elif args.dtype is not None:
        schemes = ((SUPPORTED_DTYPES[args.dtype], QuantConfig()),)
    else:
        schemes = tuple(MK_QUANT_CONFIGS)
    if any(ws < 1 for ws in args.world_size):
        raise ValueError(f"--world-size ({args.world_size}) must be >= 1")
    world_sizes = tuple(args.world_size)
    for flag, values in (("-m", args.m), ("--topk", args.topk)):
        if any(v < (0 if flag == "-m" else 1) for v in values):
            raise ValueError(f"{flag} ({values}) must be {'>= 0' if flag == '-m' else '>= 1'}")
    shape = dict(Ms=tuple(args.m), topks=tuple(args.topk), K=args.k, N=args.n, E=args.num_experts,
                 activation=Activation.parse(args.activation), placement=_placement(args.placement))
    if args.full and explicit:
        raise ValueError("--full is for the matrix without --pf-type/--experts-type (a pair runs all its cells)")
    return CliRequest(pf_types, fe_types, schemes, world_sizes, explicit, shape, full=args.full)


def _placement(name: str) -> ExpertPlacement:
    try:
        return ExpertPlacement(name)
    except ValueError:
        raise ValueError(f"--placement ({name!r}) must be one of {[p.value for p in ExpertPlacement]}") from None


def _print_case_lines(cfg: Config, outcome) -> None:
    for r in outcome.results:
        status = "PASS" if r.passed else "FAIL"
        print(f"{status} {cfg.describe()} rank={r.rank} M={r.M} topk={r.topk} "
              f"err={r.error:.3e} tol={r.tolerance:.1e}", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    use_interpreter_without_gpu()
    from moe_modular.testing.matrix import matrix_configs, run_configs, tour
    from moe_modular.testing.progress import ProgressBar

    try:
        req = parse_request(argv)
        cells = matrix_configs(req.pf_types, req.fe_types, req.schemes, req.world_sizes, **req.shape)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if req.explicit_pair:
        invalid = [(c, r) for c, ok, r in cells if not ok]
        if len(invalid) == len(cells):
            for c, reason in invalid:
                print(f"unsupported: {c.describe()}: {reason}", file=sys.stderr)
            return 2
    runnable = [c for c, ok, _ in cells if ok]
    skipped = [(c, r) for c, ok, r in cells if not ok]
    if not runnable:  # nothing was checked: not a pass
        for c, reason in skipped:
            print(f"unsupported: {c.describe()}: {reason}", file=sys.stderr)
        print(f"0 passed, 0 failed, {len(skipped)} skipped: no cell of the request can run here", file=sys.stderr)
        return 2
    if not req.explicit_pair and not req.full:
        print(f"tour of {len(tour(cells))} of the {len(runnable)} valid cells: every PrepareAndFinalize, experts class "
              f"and scheme once (--full runs all {len(runnable)})", flush=True)
        runnable = tour(cells)
    rows = []
    bar = None if req.explicit_pair else ProgressBar(len(runnable), "matrix")

    def report(cfg: Config, outcome) -> None:
        if req.explicit_pair:
            _print_case_lines(cfg, outcome)
        if outcome.error:
            print(f"FAIL {cfg.describe()}: {outcome.error}", flush=True)
        rows.append((cfg, outcome))
        if bar:
            bar.update(1, cfg.describe())

    run_configs(runnable, on_done=report)
    if bar:
        bar.close()
    failed = [(c, o) for c, o in rows if not o.passed]
    if not req.explicit_pair:
        _print_summary(rows, skipped)
    else:
        for c, r in skipped:
            print(f"SKIP {c.describe()}: {r}")
    print(f"{sum(o.passed for _, o in rows)} passed, {len(failed)} failed, {len(skipped)} skipped")
    return 1 if failed else 0


def _print_summary(rows, skipped) -> None:
    print(f"{'prepare/finalize':44s} {'experts':24s} {'scheme':28s} {'ws':>3s} {'max err':>9s} {'tol':>8s} result")
    for cfg, o in rows:
        errs = [r.error for r in o.results]
        worst = max(errs) if errs else float("nan")
        result = "PASS" if o.passed else ("ERROR" if o.error else "FAIL")
        print(f"{cfg.prepare_finalize_type.__name__:44s} {cfg.fused_experts_type.__name__:24s} "
              f"{dtype_name(cfg.dtype) + '/' + cfg.quant.name:28s} {cfg.world_size:3d} {worst:9.2e} "
              f"{(o.results[0].tolerance if o.results else float('nan')):8.1e} {result}")
    print(f"skipped cells: {len(skipped)} (invalid pairs, each with its reason: use --pf-type/--experts-type to see one)")


if __name__ == "__main__":
    sys.exit(main())
