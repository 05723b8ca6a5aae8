"""Enumerate the matrix's cells and run one cell (all its M x topk cases, on every rank)."""
from __future__ import annotations

import os
import tempfile
import traceback
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

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


def _needs_launch(cfg: Config) -> bool:
    return cfg.world_size > 1 or cfg.prepare_finalize_type.requires_distributed()


def run_config(cfg: Config) -> CellOutcome:
    """Run every case of one cell (world_size > 1 spawns its ranks)."""
    return run_configs([cfg])[cfg]


def run_configs(cfgs: Sequence[Config], on_done: Optional[Callable[[Config, CellOutcome], None]] = None
                ) -> dict[Config, CellOutcome]:
    """Run many cells; cells of one world size share one parallel_launch (one spawn per world
    size, not per cell). on_done(cfg, outcome) is called as each cell's outcome is known."""
    outcomes: dict[Config, CellOutcome] = {}

    def done(cfg: Config, outcome: CellOutcome) -> None:
        outcomes[cfg] = outcome
        if on_done is not None:
            on_done(cfg, outcome)

    by_world_size: dict[int, list[Config]] = {}
    for cfg in cfgs:
        if _needs_launch(cfg):
            by_world_size.setdefault(cfg.world_size, []).append(cfg)
            continue
        try:
            done(cfg, CellOutcome(tuple(_run_cases(cfg))))
        except Exception:  # noqa: BLE001 - a cell's failure is reported, the matrix goes on
            done(cfg, CellOutcome(error=traceback.format_exc(limit=8)))
    for ws, group in by_world_size.items():
        for cfg, outcome in _run_launch(ws, group).items():
            done(cfg, outcome)
    return outcomes


def _run_launch(world_size: int, cfgs: list[Config]) -> dict[Config, CellOutcome]:
    from tests.modular_kernel_tools.parallel_utils import parallel_launch

    with tempfile.TemporaryDirectory(prefix="mk_matrix_") as tmp:
        try:
            parallel_launch(world_size, _distributed_worker, list(cfgs), tmp)
        except Exception:  # noqa: BLE001 - every cell of a failed launch reports the launch's error
            error = traceback.format_exc(limit=8)
            return {cfg: CellOutcome(error=error) for cfg in cfgs}
        per_rank = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
    outcomes = {}
    for i, cfg in enumerate(cfgs):
        errors = [rank_out[i] for rank_out in per_rank if isinstance(rank_out[i], str)]
        if errors:
            outcomes[cfg] = CellOutcome(error=errors[0])
        else:
            outcomes[cfg] = CellOutcome(tuple(r for rank_out in per_rank for r in rank_out[i]))
    return outcomes


def _distributed_worker(pgi, cfgs: list[Config], result_dir: str) -> None:
    """One rank: run every cell's cases under one ParallelContext per cell placement and save
    [results or error text per cell] as result_dir/rank<r>.pt. A cell that raises on one rank
    while the others wait in a collective ends the launch (the harness reports that rank)."""
    from moe_modular.parallel_context import ParallelContext

    out: list = []
    for cfg in cfgs:
        context = ParallelContext.from_group(pgi.group, pgi.device, cfg.placement)
        try:
            out.append(_run_cases(cfg, rank=pgi.rank, context=context))
        except Exception:  # noqa: BLE001 - recorded per cell; see the docstring
            out.append(traceback.format_exc(limit=8))
        finally:
            context.destroy()
    torch.save(out, os.path.join(result_dir, f"rank{pgi.rank}.pt"))
