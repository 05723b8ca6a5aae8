"""The combinations matrix: every valid PrepareAndFinalize x Experts pair x scheme, checked against
the float32 oracle with NaN-poisoned outputs and format-derived tolerances.

Under pytest it runs the whole valid matrix at the CPU-sized shapes below. As a program:

  python -m tests.test_modular_kernel_combinations --pf-type X --experts-type Y [--world-size N]
      [-m M ...] [-k K] [-n N] [--num-experts E] [--topk k ...] [--dtype D] [--quant-dtype fp8]
      [--per-token-quantized-activations] [--per-channel-quantized-weights] [--block-shape B B]

Without --pf-type / --experts-type it runs a tour of the valid matrix (each pair once in its first valid
scheme, then each remaining scheme once: every PF, experts class and scheme appears), or with --full the
whole valid matrix, with a progress bar (time left, cell names) and a summary table. Exit codes: 0 all
passed, 1 a case failed, 2 bad arguments or an invalid pair.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

import pytest
import torch

from moe_modular.config import SUPPORTED_DTYPES, Activation, ExpertPlacement, dtype_name
from moe_modular.quant import QuantConfig
from tests.modular_kernel_tools.common import Config
from tests.modular_kernel_tools.mk_objects import (
    FUSED_EXPERTS_BY_NAME,
    MK_ALL_PREPARE_FINALIZE_TYPES,
    MK_FUSED_EXPERT_TYPES,
    MK_QUANT_CONFIGS,
    PREPARE_FINALIZE_BY_NAME,
    lookup,
)
from tests.modular_kernel_tools.matrix import CellOutcome, matrix_configs, run_configs, tour
from tests.modular_kernel_tools.progress import ProgressBar

# Problem sizes for the matrix on the CPU. Each line covers an edge:
PYTEST_MS = (1, 7, 64)  # one token; a prime count; a full small batch
PYTEST_TOPKS = (1, 2, 4)  # topk=1 (apply-on-input allowed); typical; topk = E/2
PYTEST_SHAPE = dict(K=192, N=96, E=8)  # K = 1.5 fp8 blocks of 128 (a partial block); N2 = 192

# Experts that run as plain torch on the CPU take the full grid and every scheme at every world
# size. The Triton experts run in Triton's interpreter on the CPU (seconds per launch, on every
# rank), so their expert-parallel cells take every fp8 scheme with bf16 activations (the other
# dtypes are covered at world size 1, where the dispatch plays no part) on a smaller grid.
CPU_FAST_EXPERTS = [t for t in MK_FUSED_EXPERT_TYPES if t.__name__ in ("TorchExperts", "NaiveBatchedExperts",
                                                                       "GroupedMMExperts")]
_INTERPRETED_EXPERTS = [t for t in MK_FUSED_EXPERT_TYPES if t not in CPU_FAST_EXPERTS]
EP_SCHEMES = tuple((d, q) for d, q in MK_QUANT_CONFIGS if d is torch.bfloat16)
PYTEST_EP_GRIDS = {
    1: dict(Ms=(3,), topks=(2,)),  # the EP classes on a group of one rank
    2: dict(Ms=(1, 7), topks=(1, 4)),  # one token per rank; a prime count; topk=1 and topk=E/2
    4: dict(Ms=(5,), topks=(2,)),  # 20 tokens over 4 ranks, 2 experts held per rank
}
_SINGLE_RANK_PFS = [t for t in MK_ALL_PREPARE_FINALIZE_TYPES if not t.requires_distributed()]
_EP_PFS = [t for t in MK_ALL_PREPARE_FINALIZE_TYPES if t.requires_distributed()]


def _cell_id(cfg: Config) -> str:
    return (f"{cfg.prepare_finalize_type.__name__}-{cfg.fused_experts_type.__name__}-"
            f"{dtype_name(cfg.dtype)}-{cfg.quant.name}-ws{cfg.world_size}")


_FULL_GRID = dict(Ms=PYTEST_MS, topks=PYTEST_TOPKS, **PYTEST_SHAPE)
_CELLS = matrix_configs(_SINGLE_RANK_PFS, MK_FUSED_EXPERT_TYPES, MK_QUANT_CONFIGS, (1,), **_FULL_GRID)
for _ws, _grid in PYTEST_EP_GRIDS.items():
    _pfs = _EP_PFS if _ws == 1 else MK_ALL_PREPARE_FINALIZE_TYPES
    _CELLS += matrix_configs(_pfs, CPU_FAST_EXPERTS, MK_QUANT_CONFIGS, (_ws,), **_FULL_GRID)
    _CELLS += matrix_configs(_pfs, _INTERPRETED_EXPERTS, EP_SCHEMES, (_ws,), **_grid, **PYTEST_SHAPE)


_VALID = [c for c, ok, _ in _CELLS if ok]


def _group(cfg: Config) -> tuple[int, str]:
    return cfg.world_size, cfg.fused_experts_type.__name__


@pytest.fixture(scope="module")
def matrix_outcome():
    """cfg -> its outcome. The cells run in groups (world size, experts class), each group when its first cell's
    test asks for it (one spawn per group that needs ranks): the tests report as the matrix goes, and no test
    waits for the whole matrix."""
    done: dict[tuple[int, str], dict] = {}

    def outcome(cfg: Config) -> CellOutcome:
        key = _group(cfg)
        if key not in done:
            done[key] = run_configs([c for c in _VALID if _group(c) == key])
        return done[key][cfg]

    return outcome


@pytest.mark.parametrize("cfg", _VALID, ids=_cell_id)
def test_modular_kernel_combination(cfg: Config, matrix_outcome):
    outcome = matrix_outcome(cfg)
    failed = [r for r in outcome.results if not r.passed]
    assert outcome.error is None, outcome.error
    assert len(outcome.results) == len(cfg.Ms) * len(cfg.topks) * cfg.world_size
    assert not failed, "; ".join(f"M={r.M} topk={r.topk} rank={r.rank} err={r.error:.3e} tol={r.tolerance:.1e}"
                                 for r in failed)


def test_matrix_covers_reference_pairs():
    """The reference pairs are valid in every scheme at world size 1, so the matrix cannot be empty."""
    valid = {(c.prepare_finalize_type.__name__, c.fused_experts_type.__name__, c.quant.name)
             for c, ok, _ in _CELLS if ok and c.world_size == 1}
    for quant in (q for _, q in MK_QUANT_CONFIGS):
        assert ("MoEPrepareAndFinalizeNoEP", "TorchExperts", quant.name) in valid
        assert ("BatchedPrepareAndFinalize", "NaiveBatchedExperts", quant.name) in valid


def test_invalid_cells_carry_reasons():
    invalid = [(c, reason) for c, ok, reason in _CELLS if not ok]
    assert invalid, "the matrix has format-mismatched pairs, which must be reported invalid"
    for cfg, reason in invalid:
        assert reason, f"{_cell_id(cfg)} is invalid without a reason"
    mismatched = [r for c, r in invalid
                  if c.is_batched_prepare_finalize() != c.is_batched_fused_experts()]
    assert mismatched and all(r.startswith("format mismatch") for r in mismatched)


# ---- command line ------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tests.test_modular_kernel_combinations",
                                description="Check PrepareAndFinalize x Experts pairs against the float32 oracle.")
    p.add_argument("--pf-type", help=f"one of: {', '.join(PREPARE_FINALIZE_BY_NAME)}")
    p.add_argument("--experts-type", help=f"one of: {', '.join(FUSED_EXPERTS_BY_NAME)}")
    p.add_argument("--world-size", type=int, nargs="+", default=[1], help="EP ranks, one or more sizes (default 1)")
    p.add_argument("-m", type=int, nargs="+", default=list(PYTEST_MS), help="tokens per rank")
    p.add_argument("-k", type=int, default=PYTEST_SHAPE["K"], help="hidden size K")
    p.add_argument("-n", type=int, default=PYTEST_SHAPE["N"], help="intermediate size N")
    p.add_argument("--num-experts", type=int, default=PYTEST_SHAPE["E"])
    p.add_argument("--topk", type=int, nargs="+", default=list(PYTEST_TOPKS))
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


def _print_case_lines(cfg: Config, outcome: CellOutcome) -> None:
    for r in outcome.results:
        status = "PASS" if r.passed else "FAIL"
        print(f"{status} {cfg.describe()} rank={r.rank} M={r.M} topk={r.topk} "
              f"err={r.error:.3e} tol={r.tolerance:.1e}", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
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

    def report(cfg: Config, outcome: CellOutcome) -> None:
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
