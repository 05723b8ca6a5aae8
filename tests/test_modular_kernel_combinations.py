"""The combinations matrix: every valid PrepareAndFinalize x Experts pair x scheme, checked against
the float32 oracle with NaN-poisoned outputs and format-derived tolerances.

Under pytest it runs the whole valid matrix at the CPU-sized shapes of moe_modular/testing/cli.py. As a
program it is that command line (its docstring lists the flags):

  python -m tests.test_modular_kernel_combinations [--pf-type X --experts-type Y] [--full] ...
"""
from __future__ import annotations

import sys

import pytest
import torch

from moe_modular.config import dtype_name
from moe_modular.testing.cli import CPU_MS, CPU_SHAPE, CPU_TOPKS, main
from moe_modular.testing.common import Config
from moe_modular.testing.matrix import CellOutcome, matrix_configs, run_configs
from moe_modular.testing.mk_objects import MK_ALL_PREPARE_FINALIZE_TYPES, MK_FUSED_EXPERT_TYPES, MK_QUANT_CONFIGS

PYTEST_SHAPE = CPU_SHAPE

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


_FULL_GRID = dict(Ms=CPU_MS, topks=CPU_TOPKS, **PYTEST_SHAPE)
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


if __name__ == "__main__":
    sys.exit(main())
