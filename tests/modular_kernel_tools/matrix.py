"""Enumerate the matrix's cells and run one cell (all its M x topk cases, on every rank)."""
from __future__ import annotations

import os
import tempfile
import traceback
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

from moe_modular.config import Activation, ExpertPlacement
from moe_modular.quant import QuantConfig
from tests.modular_kernel_tools.common import Config
from tests.modular_kernel_tools.runner import CaseResult, run_case


@dataclass(frozen=True)
class CellOutcome:
    results: tuple[CaseResult, ...] = ()
    error: Optional[str] = None  # an exception raised by the cell, with its traceback

    @property
    def passed(self) -> bool:
        return self.error is None and bool(self.results) and all(r.passed for r in self.results)


def matrix_configs(pf_types: Iterable[type], fe_types: Iterable[type],
                   schemes: Iterable[tuple[torch.dtype, QuantConfig]], world_sizes: Iterable[int], *,
                   Ms: tuple[int, ...], topks: tuple[int, ...], K: int, N: int, E: int,
                   activation: Activation = Activation.SILU,
                   placement: ExpertPlacement = ExpertPlacement.LINEAR) -> list[tuple[Config, bool, str]]:
    """Every (pf, experts, scheme, world size) cell with (config, valid, reason)."""
    cells = []
    for ws in world_sizes:
        for pf in pf_types:
            for fe in fe_types:
                for dtype, quant in schemes:
                    cfg = Config(Ms=tuple(Ms), K=K, N=N, E=E, topks=tuple(topks), dtype=dtype, quant=quant,
                                 prepare_finalize_type=pf, fused_experts_type=fe, world_size=ws,
                                 placement=placement, activation=activation)
                    ok, reason = cfg.is_valid()
                    cells.append((cfg, ok, reason))
    return cells


def _run_cases(cfg: Config, rank: int = 0, context=None) -> list[CaseResult]:
    results = []
    for M in cfg.Ms:
        for topk in cfg.topks:
            results.append(run_case(cfg, M, topk, rank=rank, context=context, seed=1000 * M + topk))
    return results


def run_config(cfg: Config) -> CellOutcome:
    """Run every case of a cell; world_size > 1 spawns the ranks through parallel_launch."""
    try:
        if cfg.world_size == 1 and not cfg.prepare_finalize_type.requires_distributed():
            return CellOutcome(tuple(_run_cases(cfg)))
        from tests.modular_kernel_tools.parallel_utils import parallel_launch
        with tempfile.TemporaryDirectory(prefix="mk_matrix_") as tmp:
            parallel_launch(cfg.world_size, _distributed_worker, cfg, tmp)
            per_rank = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(cfg.world_size)]
        return CellOutcome(tuple(r for rank_results in per_rank for r in rank_results))
    except Exception:  # noqa: BLE001 - a cell's failure is reported, the matrix goes on
        return CellOutcome(error=traceback.format_exc(limit=8))


def _distributed_worker(pgi, cfg: Config, result_dir: str) -> None:
    """One rank of a cell: run its cases and save them as result_dir/rank<r>.pt."""
    from moe_modular.parallel_context import ParallelContext

    context = ParallelContext.from_group(pgi.group, pgi.device, cfg.placement)
    try:
        results = _run_cases(cfg, rank=pgi.rank, context=context)
    finally:
        context.destroy()
    torch.save(results, os.path.join(result_dir, f"rank{pgi.rank}.pt"))
