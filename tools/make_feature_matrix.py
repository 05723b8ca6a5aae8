"""Generate the feature matrix: every registered PrepareAndFinalize x Experts pair in every
registered scheme and world size, run against the float32 oracle, written as Markdown and CSV.

  python -m tools.make_feature_matrix [--world-sizes 1 2 4] [--out-dir docs] [-m M ...] [--topk k ...]

The pairs and schemes are the combinations matrix's registries (moe_modular/testing/
mk_objects.py); whether a cell can run is asked of the classes (Config.is_valid), so every SKIP
carries the class's reason; a FAIL carries the error. Cells of world size 1 whose
PrepareAndFinalize needs no process group run in this process; the other cells of one world
size share one parallel_launch (starting ranks costs seconds, cells cost milliseconds): each
cell gets its own process group whose collectives time out, so a cell that fails on one rank
fails the cell, not the launch. A rank that dies fails its cell and the remaining cells are
relaunched. Writes OUT_DIR/feature_matrix.md and OUT_DIR/feature_matrix.csv.
Exit codes: 0 written (whatever the cells' results), 2 bad arguments.
"""
from __future__ import annotations

import argparse
import csv
import io
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from moe_modular.config import dtype_name
from moe_modular.testing.common import Config
from moe_modular.testing.matrix import (
    COLLECTIVE_TIMEOUT_S,
    CellOutcome,
    last_line,
    matrix_configs,
    run_configs,
)
from moe_modular.testing.cli import CPU_SHAPE
from moe_modular.testing.progress import ProgressBar
from moe_modular.testing.triton_interpreter import use_interpreter_without_gpu

# One small case per cell keeps the whole run to minutes on two CPU cores (Triton experts run in
# the interpreter there). M=1: a single token; M=7: a prime count, several tokens per expert.
FEATURE_MATRIX_MS = (1, 7)
FEATURE_MATRIX_TOPKS = (2,)  # a token reaches two experts (two ranks at world size 2)
DEFAULT_WORLD_SIZES = (1, 2, 4)
RESULTS = ("PASS", "FAIL", "SKIP")
CSV_FIELDS = ("world_size", "prepare_finalize", "experts", "dtype", "quant", "result", "max_error",
              "tolerance", "detail")


@dataclass(frozen=True)
class CellRecord:
    """One row of the feature matrix. detail: '' for PASS, the error for FAIL, the reason for SKIP."""

    world_size: int
    prepare_finalize: str
    experts: str
    dtype: str
    quant: str
    result: str
    detail: str = ""
    max_error: Optional[float] = None
    tolerance: Optional[float] = None

    @property
    def scheme(self) -> str:
        return scheme_label(self.dtype, self.quant)


def scheme_label(dtype: str, quant: str) -> str:
    return f"{dtype}/{quant}"


def describe_failure(outcome: CellOutcome) -> str:
    """One line: the exception message (per failing rank), or the cases that missed the tolerance."""
    if outcome.error:
        return last_line(outcome.error)
    bad = [r for r in outcome.results if not r.passed]
    if not bad:
        return "no cases ran"
    shown = "; ".join(f"M={r.M} topk={r.topk} rank={r.rank} err={r.error:.2e} > tol={r.tolerance:.1e}" for r in bad[:3])
    return shown + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else "")


def record_of(cfg: Config, result: str, detail: str = "", outcome: Optional[CellOutcome] = None) -> CellRecord:
    errs = [r.error for r in outcome.results] if outcome else []
    return CellRecord(
        world_size=cfg.world_size, prepare_finalize=cfg.prepare_finalize_type.__name__,
        experts=cfg.fused_experts_type.__name__, dtype=dtype_name(cfg.dtype), quant=cfg.quant.name,
        result=result, detail=detail,
        max_error=max(errs) if errs else None,
        tolerance=outcome.results[0].tolerance if outcome and outcome.results else None,
    )


def record_of_outcome(cfg: Config, outcome: CellOutcome) -> CellRecord:
    if outcome.passed:
        return record_of(cfg, "PASS", "", outcome)
    return record_of(cfg, "FAIL", describe_failure(outcome), outcome)


def run_cells(cells: list[tuple[Config, bool, str]], collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
              progress: bool = True) -> list[CellRecord]:
    """A record for every cell (in the order given): SKIP with the reason, PASS, or FAIL with the error."""
    runnable = [cfg for cfg, ok, _ in cells if ok]
    bar = ProgressBar(len(runnable), "feature matrix") if progress else None
    records: dict[Config, CellRecord] = {}

    def finish(cfg: Config, outcome: CellOutcome) -> None:
        records[cfg] = record_of_outcome(cfg, outcome)
        if outcome.error:
            print(f"\nFAIL {cfg.describe()}:\n{outcome.error}", file=sys.stderr, flush=True)
        if bar:
            bar.update(1, f"{records[cfg].result} {cfg.describe()}")

    run_configs(runnable, on_done=finish, collective_timeout_s=collective_timeout_s)
    if bar:
        bar.close()
    return [records[cfg] if ok else record_of(cfg, "SKIP", reason) for cfg, ok, reason in cells]


# ---- writing ----------------------------------------------------------------------------------

def to_csv(records: list[CellRecord]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_FIELDS)
    for r in records:
        w.writerow([r.world_size, r.prepare_finalize, r.experts, r.dtype, r.quant, r.result,
                    "" if r.max_error is None else repr(r.max_error),
                    "" if r.tolerance is None else repr(r.tolerance), r.detail])
    return buf.getvalue()


def read_csv(path: str) -> list[CellRecord]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [CellRecord(world_size=int(r["world_size"]), prepare_finalize=r["prepare_finalize"], experts=r["experts"],
                       dtype=r["dtype"], quant=r["quant"], result=r["result"], detail=r["detail"],
                       max_error=float(r["max_error"]) if r["max_error"] else None,
                       tolerance=float(r["tolerance"]) if r["tolerance"] else None) for r in rows]


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(records: list[CellRecord], command: str, shape_line: str) -> str:
    """Per world size a table (rows: pairs; columns: schemes); FAIL and SKIP cells point to notes."""
    notes: dict[str, int] = {}

    def cell(r: CellRecord) -> str:
        if r.result == "PASS":
            return "PASS"
        n = notes.setdefault(r.detail, len(notes) + 1)
        return f"{r.result} [{n}]"

    schemes = list(dict.fromkeys(r.scheme for r in records))
    out = [
        "# Feature matrix",
        "",
        f"Generated by `{command}`; do not edit by hand.",
        "",
        "Every registered PrepareAndFinalize x Experts pair in every registered scheme",
        f"(moe_modular/testing/mk_objects.py), run against the float32 oracle: {shape_line}.",
        "",
        "- PASS: every case matched the oracle within the tolerance of its number format.",
        "- FAIL [n]: a case missed the tolerance or raised; note n gives the error.",
        "- SKIP [n]: the pair does not compose, or a class does not support the scheme or world size;",
        "  note n gives the reason, as the class states it.",
        "- Classes that need a GPU (the DeepEP and symmetric-memory PFs, the warp-specialized kernels) skip or",
        "  run their CPU path here; docs/deepep.md (\"What has been run where\") and the README's GPU checks say",
        "  which ran on a GPU, where and when.",
        "",
    ]
    for ws in sorted({r.world_size for r in records}):
        rows = [r for r in records if r.world_size == ws]
        counts = ", ".join(f"{sum(r.result == x for r in rows)} {x}" for x in RESULTS)
        out += [f"## World size {ws}", "", f"{counts}.", ""]
        out.append("| prepare/finalize | experts | " + " | ".join(schemes) + " |")
        out.append("|---|---|" + "---|" * len(schemes))
        pairs = list(dict.fromkeys((r.prepare_finalize, r.experts) for r in rows))
        by_key = {(r.prepare_finalize, r.experts, r.scheme): r for r in rows}
        for pf, fe in pairs:
            cells = [cell(by_key[(pf, fe, s)]) if (pf, fe, s) in by_key else "" for s in schemes]
            out.append(f"| {pf} | {fe} | " + " | ".join(cells) + " |")
        out.append("")
    if notes:
        out += ["## Notes", ""]
        out += [f"{n}. {_md_escape(text)}" for text, n in notes.items()]
        out.append("")
    return "\n".join(out)


def write_outputs(records: list[CellRecord], out_dir: str, command: str, shape_line: str) -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    md_path, csv_path = os.path.join(out_dir, "feature_matrix.md"), os.path.join(out_dir, "feature_matrix.csv")
    with open(md_path, "w") as f:
        f.write(to_markdown(records, command, shape_line))
    with open(csv_path, "w", newline="") as f:
        f.write(to_csv(records))
    return md_path, csv_path


# ---- command line ----------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.make_feature_matrix",
                                description="Run every registered PF x experts x scheme cell and write the feature matrix.")
    p.add_argument("--world-sizes", type=int, nargs="+", default=list(DEFAULT_WORLD_SIZES), metavar="N",
                   help="EP world sizes to run (gloo on the CPU, NCCL on GPUs)")
    p.add_argument("--out-dir", default="docs", help="where feature_matrix.md and feature_matrix.csv go")
    p.add_argument("-m", type=int, nargs="+", default=list(FEATURE_MATRIX_MS), help="tokens per rank")
    p.add_argument("--topk", type=int, nargs="+", default=list(FEATURE_MATRIX_TOPKS))
    return p


@dataclass(frozen=True)
class MatrixRequest:
    world_sizes: tuple[int, ...]
    out_dir: str
    Ms: tuple[int, ...]
    topks: tuple[int, ...]


def parse_matrix_request(argv: Optional[Sequence[str]] = None) -> MatrixRequest:
    """Parse argv (argparse errors exit 2); bad values raise ValueError naming the flag and value."""
    args = build_parser().parse_args(argv)
    if any(ws < 1 for ws in args.world_sizes):
        raise ValueError(f"--world-sizes ({args.world_sizes}) must all be >= 1")
    if any(m < 0 for m in args.m):
        raise ValueError(f"-m ({args.m}) must be >= 0")
    if any(k < 1 for k in args.topk):
        raise ValueError(f"--topk ({args.topk}) must be >= 1")
    return MatrixRequest(tuple(dict.fromkeys(args.world_sizes)), args.out_dir, tuple(args.m), tuple(args.topk))


def shape_description(req: MatrixRequest) -> str:
    device = "cuda (NCCL)" if torch.cuda.is_available() else "cpu (gloo)"
    return (f"M = {', '.join(map(str, req.Ms))} tokens per rank, topk = {', '.join(map(str, req.topks))}, "
            f"K = {CPU_SHAPE['K']}, N = {CPU_SHAPE['N']}, E = {CPU_SHAPE['E']}, on {device}, "
            f"torch {torch.__version__}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    use_interpreter_without_gpu()  # before the class registry imports a kernel
    from moe_modular.testing.mk_objects import MK_ALL_PREPARE_FINALIZE_TYPES, MK_FUSED_EXPERT_TYPES, MK_QUANT_CONFIGS

    try:
        req = parse_matrix_request(argv)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cells = matrix_configs(MK_ALL_PREPARE_FINALIZE_TYPES, MK_FUSED_EXPERT_TYPES, MK_QUANT_CONFIGS, req.world_sizes,
                           Ms=req.Ms, topks=req.topks, **CPU_SHAPE)
    t0 = time.monotonic()
    records = run_cells(cells)
    command = "python -m tools.make_feature_matrix --world-sizes " + " ".join(map(str, req.world_sizes))
    if req.Ms != FEATURE_MATRIX_MS:
        command += " -m " + " ".join(map(str, req.Ms))
    if req.topks != FEATURE_MATRIX_TOPKS:
        command += " --topk " + " ".join(map(str, req.topks))
    md_path, csv_path = write_outputs(records, req.out_dir, command, shape_description(req))
    counts = ", ".join(f"{sum(r.result == x for r in records)} {x}" for x in RESULTS)
    print(f"{counts} in {time.monotonic() - t0:.0f} s; wrote {md_path} and {csv_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
