"""Profile one PrepareAndFinalize x Experts pair with torch.profiler and write Chrome traces.

  python -m tools.profile_modular_kernel --pf-type X --experts-type Y --torch-trace-dir-path DIR
      [--world-size N] [-m M ...] [-k K] [-n N] [--num-experts E] [--topk k ...] [--dtype D]
      [--quant-dtype fp8] [--per-token-quantized-activations] [--per-channel-quantized-weights]
      [--static-activation-scale] [--block-shape BN BK] [--warmup W] [--top-kernels N]

The problem flags and their errors are the combinations CLI's
(tests/test_modular_kernel_combinations.py). The ranks are spawned with parallel_launch (gloo on
the CPU, NCCL on GPUs), also at world size 1. For every M x topk, each rank builds the case the
combinations matrix builds (moe_modular/testing/runner.py), runs the forward `--warmup`
times, then once under torch.profiler (CPU activity, plus CUDA where present, shapes recorded)
and writes DIR/m{M}_topk{k}_rank{r}.json. An existing file is never overwritten: the run takes
the first suffix (_1, _2, ...) free for all its files. The profiled forward's output is checked
against the float32 oracle, and a per-phase time table is printed from the traces; on a GPU also,
per case, the `--top-kernels` kernels that took the most GPU time inside the forward.

Without --dtype or quant flags the first registered scheme the pair supports is profiled.
Exit codes: 0 traces written and the output matches the oracle, 1 a case failed or a rank
raised, 2 bad arguments or an unsupported pair.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from moe_modular.config import dtype_name
from moe_modular.testing.common import Config
from moe_modular.testing.matrix import matrix_configs
from moe_modular.testing.cli import build_parser, parse_request
from moe_modular.testing.runner import CaseResult, run_case
from moe_modular.testing.triton_interpreter import use_interpreter_without_gpu

# The ranges a forward emits, outermost first within each group. `forward` is this tool's range
# around one call; the kernel emits prepare / shared_experts / experts / finalize; the EP
# PrepareAndFinalize classes emit dispatch (inside prepare) and combine (inside finalize).
PHASES: tuple[str, ...] = ("forward", "prepare", "dispatch", "shared_experts", "experts", "finalize", "combine")
# Chrome-trace categories of record_function ranges: on the host, and their span on the GPU stream.
CPU_RANGE_CATEGORY = "user_annotation"
GPU_RANGE_CATEGORY = "gpu_user_annotation"
DEFAULT_WARMUP = 2
# Chrome-trace category of a GPU kernel's execution.
KERNEL_CATEGORY = "kernel"
DEFAULT_TOP_KERNELS = 10
# The key under which each trace carries what was profiled (rank, shapes, pair, scheme).
TRACE_METADATA_KEY = "moe_modular"


def build_profiler_parser() -> argparse.ArgumentParser:
    """The combinations CLI's parser plus the profiler's own flags."""
    p = build_parser()
    p.prog = "python -m tools.profile_modular_kernel"
    p.description = "Profile one PrepareAndFinalize x Experts pair with torch.profiler (one Chrome trace per rank, M and topk)."
    p.add_argument("--torch-trace-dir-path", required=True, metavar="DIR",
                   help="directory for the traces (created when missing)")
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help="forwards run before the profiled one")
    p.add_argument("--top-kernels", type=int, default=DEFAULT_TOP_KERNELS, metavar="N",
                   help="GPU runs: list the N kernels with the most GPU time inside each forward (0: none)")
    return p


@dataclass(frozen=True)
class ProfileRequest:
    """A validated profiler command line: one cell (its Ms x topks), where to write, how long to warm up."""

    cfg: Config
    trace_dir: str
    warmup: int
    top_kernels: int = DEFAULT_TOP_KERNELS


def parse_profile_request(argv: Optional[Sequence[str]] = None) -> ProfileRequest:
    """Parse argv (argparse errors exit 2); bad values raise ValueError naming the flag and value."""
    parser = build_profiler_parser()
    args = parser.parse_args(argv)
    req = parse_request(argv, parser)
    if not req.explicit_pair:
        raise ValueError("--pf-type and --experts-type are required: the profiler runs one pair")
    if len(req.world_sizes) != 1:
        raise ValueError(f"--world-size ({list(req.world_sizes)}) takes one size for the profiler")
    if args.warmup < 0:
        raise ValueError(f"--warmup ({args.warmup}) must be >= 0")
    if args.top_kernels < 0:
        raise ValueError(f"--top-kernels ({args.top_kernels}) must be >= 0")
    if os.path.exists(args.torch_trace_dir_path) and not os.path.isdir(args.torch_trace_dir_path):
        raise ValueError(f"--torch-trace-dir-path ({args.torch_trace_dir_path!r}) exists and is not a directory")
    cells = matrix_configs(req.pf_types, req.fe_types, req.schemes, req.world_sizes, **req.shape)
    valid = [c for c, ok, _ in cells if ok]
    if not valid:
        raise UnsupportedPair([f"{c.describe()}: {reason}" for c, _, reason in cells])
    return ProfileRequest(valid[0], args.torch_trace_dir_path, args.warmup, args.top_kernels)


class UnsupportedPair(ValueError):
    """No scheme of the request is supported by the pair; `reasons` holds one line per scheme."""

    def __init__(self, reasons: list[str]):
        super().__init__("; ".join(reasons))
        self.reasons = reasons


# ---- trace names -----------------------------------------------------------------------------

def trace_stem(M: int, topk: int, rank: int) -> str:
    return f"m{M}_topk{topk}_rank{rank}"


def choose_suffix(trace_dir: str, cfg: Config) -> str:
    """The first suffix ("", "_1", "_2", ...) under which none of this run's trace files exist."""
    stems = [trace_stem(M, k, r) for M in cfg.Ms for k in cfg.topks for r in range(cfg.world_size)]
    n = 0
    while True:
        suffix = "" if n == 0 else f"_{n}"
        if not any(os.path.exists(os.path.join(trace_dir, s + suffix + ".json")) for s in stems):
            return suffix
        n += 1


def claim_trace_path(trace_dir: str, stem: str, suffix: str) -> str:
    """Create stem+suffix.json exclusively (the next free suffix if another run took it) and return it."""
    n = int(suffix[1:]) if suffix else 0
    while True:
        path = os.path.join(trace_dir, f"{stem}{'' if n == 0 else f'_{n}'}.json")
        try:
            with open(path, "x"):
                return path
        except FileExistsError:
            n += 1


# ---- one rank ---------------------------------------------------------------------------------

def profiler_activities() -> list[ProfilerActivity]:
    acts = [ProfilerActivity.CPU]
    if torch.cuda.is_available() and ProfilerActivity.CUDA in torch.profiler.supported_activities():
        acts.append(ProfilerActivity.CUDA)
    return acts


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class RankCase:
    """One rank's profiled case: its oracle check and the trace it wrote."""

    result: CaseResult
    trace_path: str


def _profile_worker(pgi, cfg: Config, trace_dir: str, suffix: str, warmup: int, result_dir: str) -> None:
    """One rank: for every M x topk, warm up, profile one forward, write the trace, check the oracle."""
    from moe_modular.parallel_context import ParallelContext

    context = ParallelContext.from_group(pgi.group, pgi.device, cfg.placement)
    cases: list[RankCase] = []
    try:
        for M in cfg.Ms:
            for topk in cfg.topks:
                path = claim_trace_path(trace_dir, trace_stem(M, topk, pgi.rank), suffix)
                meta = dict(rank=pgi.rank, world_size=pgi.world_size, M=M, topk=topk, K=cfg.K, N=cfg.N,
                            E=cfg.E, prepare_finalize=cfg.prepare_finalize_type.__name__,
                            experts=cfg.fused_experts_type.__name__, dtype=dtype_name(cfg.dtype),
                            quant=cfg.quant.name, warmup=warmup)

                def around_forward(forward, path=path, meta=meta) -> None:
                    for _ in range(warmup):
                        forward()
                    _synchronize(pgi.device)
                    with profile(activities=profiler_activities(), record_shapes=True) as prof:
                        prof.add_metadata_json(TRACE_METADATA_KEY, json.dumps(meta))
                        # Started profilers first, then the ranks enter the forward together.
                        dist.barrier(group=pgi.group)
                        with record_function("forward"):
                            forward()
                        _synchronize(pgi.device)
                    prof.export_chrome_trace(path)

                # The same seed as the combinations matrix gives this case.
                result = run_case(cfg, M, topk, rank=pgi.rank, context=context, seed=1000 * M + topk,
                                  device=pgi.device, around_forward=around_forward)
                cases.append(RankCase(result, path))
    finally:
        context.destroy()
    torch.save(cases, os.path.join(result_dir, f"rank{pgi.rank}.pt"))


def profile_config(cfg: Config, trace_dir: str, warmup: int = DEFAULT_WARMUP) -> list[RankCase]:
    """Spawn cfg.world_size ranks, profile every case of `cfg`; the cases of all ranks, rank-major."""
    from moe_modular.testing.parallel_utils import parallel_launch

    os.makedirs(trace_dir, exist_ok=True)
    suffix = choose_suffix(trace_dir, cfg)
    with tempfile.TemporaryDirectory(prefix="mk_profile_") as tmp:
        parallel_launch(cfg.world_size, _profile_worker, cfg, os.path.abspath(trace_dir), suffix, warmup, tmp)
        per_rank = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(cfg.world_size)]
    return [c for rank_cases in per_rank for c in rank_cases]


# ---- reading traces --------------------------------------------------------------------------

@dataclass(frozen=True)
class PhaseTime:
    """Total time of a phase's ranges in one trace (nested ranges count inside their parent too)."""

    calls: int
    cpu_us: float
    gpu_us: Optional[float]  # None when the trace has no GPU ranges


def load_trace(path: str) -> dict:
    """A Chrome trace written by torch.profiler (a JSON object with `traceEvents`)."""
    with open(path) as f:
        trace = json.load(f)
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents list)")
    return trace


def phase_times(trace: dict) -> dict[str, PhaseTime]:
    """PHASES name -> its time in `trace`, for the phases the trace contains."""
    cpu: dict[str, list[float]] = {}
    gpu: dict[str, float] = {}
    for ev in trace["traceEvents"]:
        if ev.get("ph") != "X" or ev.get("name") not in PHASES:
            continue
        if ev.get("cat") == CPU_RANGE_CATEGORY:
            cpu.setdefault(ev["name"], []).append(float(ev.get("dur", 0.0)))
        elif ev.get("cat") == GPU_RANGE_CATEGORY:
            gpu[ev["name"]] = gpu.get(ev["name"], 0.0) + float(ev.get("dur", 0.0))
    return {name: PhaseTime(len(cpu[name]), sum(cpu[name]), gpu.get(name)) for name in PHASES if name in cpu}


def case_order(case: RankCase) -> tuple[int, int, int]:
    """The order cases are reported in: (M, topk, rank)."""
    return case.result.M, case.result.topk, case.result.rank


def load_traces(cases: list[RankCase]) -> list[tuple[RankCase, dict]]:
    """Each case with its trace, read once, in case_order: what format_summary and format_kernels take."""
    return [(c, load_trace(c.trace_path)) for c in sorted(cases, key=case_order)]


def format_summary(traced: list[tuple[RankCase, dict]]) -> str:
    """A table: one row per (M, topk, rank) of load_traces' list, one column per phase present, in ms (CPU, and GPU
    when traced)."""
    timed = [(c, phase_times(trace)) for c, trace in traced]
    present = [p for p in PHASES if any(p in t for _, t in timed)]
    has_gpu = any(pt.gpu_us is not None for _, t in timed for pt in t.values())
    lines = []
    for clock in ("cpu", "gpu") if has_gpu else ("cpu",):
        lines.append(f"{clock.upper()} time per phase (ms; a nested phase is also counted in its parent):")
        lines.append(f"{'M':>6s} {'topk':>4s} {'rank':>4s} " + " ".join(f"{p:>14s}" for p in present))
        for c, t in timed:
            cells = []
            for p in present:
                us = None if p not in t else (t[p].cpu_us if clock == "cpu" else t[p].gpu_us)
                cells.append(f"{us / 1000:14.3f}" if us is not None else f"{'-':>14s}")
            r = c.result
            lines.append(f"{r.M:6d} {r.topk:4d} {r.rank:4d} " + " ".join(cells))
    return "\n".join(lines)


@dataclass(frozen=True)
class KernelTime:
    """One kernel name's launches inside the forward of a trace."""

    name: str
    calls: int
    gpu_us: float


def kernel_times(trace: dict) -> list[KernelTime]:
    """The GPU kernels that ran inside the forward's GPU span (the whole trace where it has no such span), one
    entry per kernel name, most GPU time first."""
    events = [ev for ev in trace["traceEvents"] if ev.get("ph") == "X"]
    spans = [(float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0.0))) for ev in events
             if ev.get("cat") == GPU_RANGE_CATEGORY and ev.get("name") == "forward"]
    calls: dict[str, int] = {}
    total: dict[str, float] = {}
    for ev in events:
        if ev.get("cat") != KERNEL_CATEGORY:
            continue
        ts = float(ev["ts"])
        if spans and not any(a <= ts <= b for a, b in spans):
            continue
        calls[ev["name"]] = calls.get(ev["name"], 0) + 1
        total[ev["name"]] = total.get(ev["name"], 0.0) + float(ev.get("dur", 0.0))
    return sorted((KernelTime(n, calls[n], total[n]) for n in total), key=lambda k: (-k.gpu_us, k.name))


def format_kernels(traced: list[tuple[RankCase, dict]], top: int, name_width: int = 80) -> str:
    """Per (M, topk, rank) of load_traces' list whose trace has GPU kernels: the `top` kernels with the most GPU time
    inside the forward, with their share of all kernel time there; "" when no trace has kernels (a CPU run) or top
    is 0."""
    if not top:
        return ""
    lines = []
    for c, trace in traced:
        kernels = kernel_times(trace)
        if not kernels:
            continue
        all_us = sum(k.gpu_us for k in kernels)
        r = c.result
        lines.append(f"GPU kernels of M={r.M} topk={r.topk} rank={r.rank}: {len(kernels)} kernels, "
                     f"{all_us / 1000:.3f} ms in all; the {min(top, len(kernels))} longest:")
        lines.append(f"{'ms':>10s} {'share':>6s} {'calls':>5s}  name")
        for k in kernels[:top]:
            name = k.name if len(k.name) <= name_width else k.name[:name_width - 3] + "..."
            lines.append(f"{k.gpu_us / 1000:10.3f} {k.gpu_us / all_us if all_us else 0.0:6.1%} {k.calls:5d}  {name}")
    return "\n".join(lines)


# ---- command line ----------------------------------------------------------------------------

def main(argv: Optional[Sequence[str]] = None) -> int:
    use_interpreter_without_gpu()  # before the class registry imports a kernel
    try:
        req = parse_profile_request(argv)
    except UnsupportedPair as exc:
        for line in exc.reasons:
            print(f"unsupported: {line}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cfg = req.cfg
    print(f"profiling {cfg.describe()} Ms={list(cfg.Ms)} topks={list(cfg.topks)} K={cfg.K} N={cfg.N} E={cfg.E} "
          f"warmup={req.warmup} -> {req.trace_dir}", flush=True)
    try:
        cases = profile_config(cfg, req.trace_dir, req.warmup)
    except Exception as exc:  # noqa: BLE001 - a failed launch is reported with every rank's traceback
        print(f"FAIL {cfg.describe()}: {exc}", file=sys.stderr)
        return 1
    for c in sorted(cases, key=case_order):
        r = c.result
        status = "PASS" if r.passed else "FAIL"
        print(f"{status} M={r.M} topk={r.topk} rank={r.rank} err={r.error:.3e} tol={r.tolerance:.1e} trace={c.trace_path}")
    traced = load_traces(cases)
    print(format_summary(traced))
    kernels = format_kernels(traced, req.top_kernels)
    if kernels:
        print(kernels)
    failed = [c for c in cases if not c.result.passed]
    print(f"{len(cases)} traces written, {len(cases) - len(failed)} outputs match the oracle, {len(failed)} do not")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
