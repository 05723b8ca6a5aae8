"""Enumerate the matrix's cells and run one cell (all its M x topk cases, on every rank)."""
from __future__ import annotations

import datetime
import os
import tempfile
import threading
import traceback
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from moe_modular.config import Activation, ExpertPlacement
from moe_modular.quant import QuantConfig
from moe_modular.testing.common import Config
from moe_modular.testing.runner import CaseResult, run_case


# How long a rank waits in one collective of a cell before the cell fails (a peer raised).
COLLECTIVE_TIMEOUT_S = 120.0


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


def tour(cells: Sequence[tuple[Config, bool, str]]) -> list[Config]:
    """A short tour of the valid cells: each (PF, experts, world size) once, in its first valid scheme (the order
    of `cells`), then each scheme not yet seen once, in the first pair that runs it. Every PF, experts class and
    scheme of the matrix appears."""
    chosen, pairs, schemes = [], set(), set()
    valid = [c for c, ok, _ in cells if ok]
    for c in valid:
        pair = (c.prepare_finalize_type, c.fused_experts_type, c.world_size)
        if pair not in pairs:
            pairs.add(pair)
            schemes.add((c.dtype, c.quant))
            chosen.append(c)
    for c in valid:
        if (c.dtype, c.quant) not in schemes:
            schemes.add((c.dtype, c.quant))
            chosen.append(c)
    return chosen


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


def run_configs(cfgs: Sequence[Config], on_done: Optional[Callable[[Config, CellOutcome], None]] = None,
                collective_timeout_s: float = COLLECTIVE_TIMEOUT_S) -> dict[Config, CellOutcome]:
    """Run many cells; on_done(cfg, outcome) is called as each cell's outcome is known.

    Cells of world size 1 whose PF needs no process group run in this process. The other cells of
    one world size share one parallel_launch (starting ranks costs seconds, cells milliseconds):
    each cell gets its own process group whose collectives time out, so a cell that fails on one
    rank fails that cell, not the launch; a rank that dies fails its cell and the remaining cells
    are relaunched."""
    outcomes: dict[Config, CellOutcome] = {}

    def done(cfg: Config, outcome: CellOutcome) -> None:
        outcomes[cfg] = outcome
        if on_done is not None:
            on_done(cfg, outcome)

    launched: dict[int, list[Config]] = {}
    for cfg in cfgs:
        if _needs_launch(cfg):
            launched.setdefault(cfg.world_size, []).append(cfg)
            continue
        try:
            done(cfg, CellOutcome(tuple(_run_cases(cfg))))
        except Exception:  # noqa: BLE001 - a cell's failure is reported, the matrix goes on
            done(cfg, CellOutcome(error=traceback.format_exc(limit=8)))
    for ws in sorted(launched):
        group = launched[ws]
        run_batched(group, ws, lambda j, outcome, group=group: done(group[j], outcome), collective_timeout_s)
    return outcomes


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else text.strip()


# ---- running cells -----------------------------------------------------------------------------

def _cell_path(result_dir: str, index: int, rank: int) -> str:
    return os.path.join(result_dir, f"cell{index}_rank{rank}.pt")


def _batch_worker(pgi, cfgs: list[Config], result_dir: str, collective_timeout_s: float) -> None:
    """One rank: run the cells in order, each in a fresh process group with a collective timeout,
    saving each cell's outcome as result_dir/cell<i>_rank<r>.pt as soon as it is known."""
    from moe_modular.parallel_context import ParallelContext

    ranks = list(range(pgi.world_size))
    for i, cfg in enumerate(cfgs):
        # Every rank creates the group (a collective on the launch's group), so the ranks start
        # each cell together even when a peer timed out of the previous one.
        group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=collective_timeout_s))
        context = None
        try:
            context = ParallelContext.from_group(group, pgi.device, cfg.placement)
            outcome = CellOutcome(tuple(_run_cases(cfg, rank=pgi.rank, context=context)))
        except Exception:  # noqa: BLE001 - the cell fails, the next cell runs
            outcome = CellOutcome(error=f"rank {pgi.rank}: " + traceback.format_exc(limit=8))
        finally:
            if context is not None:
                context.destroy()
        if outcome.error is None:
            # Free the group's communicator (NCCL ones hold device memory). A group a peer may
            # still be stuck in is left alone: tearing it down could block.
            dist.destroy_process_group(group)
        tmp = _cell_path(result_dir, i, pgi.rank) + ".tmp"
        torch.save(outcome, tmp)
        os.replace(tmp, _cell_path(result_dir, i, pgi.rank))


def _merge_ranks(outcomes: list[CellOutcome]) -> CellOutcome:
    errors = [o.error for o in outcomes if o.error]
    results = tuple(r for o in outcomes for r in o.results)
    if not errors:
        return CellOutcome(results)
    # A peer's timeout is a consequence; report the rank that raised something else first.
    errors.sort(key=lambda e: "timed out" in e.lower() or "timeout" in e.lower())
    return CellOutcome(results, error=errors[0])


def run_batched(cfgs: list[Config], world_size: int, on_done: Callable[[int, CellOutcome], None],
                collective_timeout_s: float = COLLECTIVE_TIMEOUT_S, launch_timeout_s: Optional[float] = None) -> None:
    """Run `cfgs` (all of `world_size`) in as few launches as possible; on_done(i, outcome) for each
    cell as it completes, in order. A launch that fails (a rank died or the launch timed out) fails
    the cell it was in, and the cells after it are relaunched."""
    from moe_modular.testing.parallel_utils import parallel_launch

    start = 0
    while start < len(cfgs):
        batch = cfgs[start:]
        timeout = launch_timeout_s or 600.0 + 2 * collective_timeout_s * len(batch)
        with tempfile.TemporaryDirectory(prefix="feature_matrix_") as tmp:
            failure: list[BaseException] = []

            def launch() -> None:
                try:
                    parallel_launch(world_size, _batch_worker, batch, tmp, collective_timeout_s, timeout_s=timeout)
                except BaseException as exc:  # noqa: BLE001 - reported below
                    failure.append(exc)

            thread = threading.Thread(target=launch, daemon=True)
            thread.start()
            done = 0
            while True:
                alive = thread.is_alive()
                while done < len(batch) and all(os.path.exists(_cell_path(tmp, done, r)) for r in range(world_size)):
                    outcomes = [torch.load(_cell_path(tmp, done, r), weights_only=False) for r in range(world_size)]
                    on_done(start + done, _merge_ranks(outcomes))
                    done += 1
                if not alive:
                    break
                thread.join(timeout=0.2)
        if done < len(batch):
            on_done(start + done, CellOutcome(error=launch_failure_line(failure[0] if failure else None)))
            done += 1
        start += done


def launch_failure_line(exc: Optional[BaseException]) -> str:
    """A failed launch in one line: each failed rank with the last line of what happened to it."""
    from moe_modular.testing.parallel_utils import ParallelLaunchError

    if isinstance(exc, ParallelLaunchError):
        return "launch failed: " + " | ".join(f"rank {r}: {last_line(d)}" for r, d in exc.failures.items())
    return f"launch failed: {type(exc).__name__}: {exc}" if exc is not None else "launch failed: it ended early"


