"""Expert-parallel dispatch / combine benchmark: every EP PrepareAndFinalize, timed per phase.

    python -m tools.benchmark_ep --world-size 8 --out OUT                  # DeepSeek-V3 shapes, every PF
    python -m tools.benchmark_ep --world-size 2 --pf-types nccl_all_to_all deepep_high_throughput \\
        --tokens-per-rank 128 4096 --dispatch bf16 fp8-block --wires per_route prereduced --out OUT
    python -m tools.benchmark_ep --smoke --out OUT                          # tiny shapes, 2 ranks on gloo

Problem: DeepSeek-V3's MoE layer (hidden 7168, intermediate 2048, 256 experts, top-8), 128 tokens per
rank (low-latency) and 4096 (high-throughput), dispatched in bf16 or fp8 (per-token, or 1x128 groups
with 128x128 weight blocks). The ranks are spawned with parallel_launch (NCCL, one GPU per rank; gloo
on the CPU with --smoke). Every rank builds the same seeded routing and its own seeded tokens and
local experts.

Cells: for each dispatch scheme, tokens per rank, EP PF (registry.PREPARE_FINALIZE_BY_BACKEND plus
SliceAllGatherPrepareAndFinalize) and, for the PFs that combine over AllToAllPrepareAndFinalize's
CombineWire, each wire. A PF whose `supports(moe)` refuses is a SKIP row with its reason. For the others:
  dispatch  pf.prepare(...) alone;
  combine   pf.finalize(...) alone, of a fixed (seeded) experts output of the shape the experts write;
  layer     FusedMoEModularKernel(pf, experts) forward; experts: the first registry class for the PF's
            format and device (TritonExperts / BatchedTritonExperts on a GPU, TorchExperts /
            NaiveBatchedExperts on the CPU).
Timing: warm-up, then repetitions, each phase preceded by a barrier of all ranks; CUDA events on a
GPU, perf_counter on the CPU; every rank's median, and the cell reports the largest (the slowest rank).
Each cell's layer output (NaN-filled first) is compared once with the float32 oracle
(moe_modular.reference.moe_torch) on the first CHECK_TOKENS tokens of every rank, with the tolerance
of the number format (moe_modular/testing/common.py); above it the cell is FAIL.

Bytes per rank (what crosses to other ranks; see the byte models below): the busiest rank's bytes of
the phase; algorithmic bandwidth = bytes / time. The link bandwidth is measured in the same run: a
LINK_BYTES NCCL send from rank 0 to rank 1 (not measured with one GPU or on the CPU, with the reason);
each cell then also gets its fraction of it.

Writes OUT/benchmark_ep.csv (one row per cell, status PASS / FAIL / SKIP and reason), OUT/benchmark_ep.json
(hardware, versions, link measurement, command) and OUT/benchmark_ep.png (bandwidth per PF; needs
matplotlib, skipped with a note when it is missing). Prints the table last. Exit 1 when a cell FAILs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from moe_modular.config import MoEConfig, ParallelConfig
from tools.bench_common import write_csv
from moe_modular.interfaces import ActivationFormat
from moe_modular.prepare_finalize.all_to_all_prepare_and_finalize import AllToAllPrepareAndFinalize
from moe_modular.prepare_finalize.combine_wire import COMBINE_WIRES, CombineWire, combine_wire
from moe_modular.prepare_finalize.ep_common import ExpertPlacementTables
from moe_modular.prepare_finalize.slice_allgather_prepare_and_finalize import SliceAllGatherPrepareAndFinalize
from moe_modular.wire_bytes import PhaseBytes, RouteCounts
from moe_modular.quant import FP8_DTYPE, MoEQuantParams, QuantConfig, quantize_weights
from moe_modular.registry import NO_EP_BACKEND, PREPARE_FINALIZE_BY_BACKEND

# ---- the problem ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """One MoE layer: E experts, hidden K, intermediate N, top-k."""

    label: str
    E: int
    K: int
    N: int
    topk: int


PROBLEM = Problem("DeepSeek-V3", 256, 7168, 2048, 8)
SMOKE_PROBLEM = Problem("tiny", 16, 128, 64, 4)
BENCH_TOKENS = (128, 4096)
SMOKE_TOKENS = (8, 33)
SMOKE_WORLD_SIZE = 2

DISPATCH_SCHEMES: Mapping[str, QuantConfig] = MappingProxyType({
    "bf16": QuantConfig.unquantized(),
    "fp8-token": QuantConfig.fp8_per_token(),
    "fp8-block": QuantConfig.fp8_block((128, 128)),
})
DEFAULT_DISPATCH = ("bf16", "fp8-block")
ACTIVATION_DTYPE = torch.bfloat16
NO_WIRE = "-"  # the wire column of PFs with their own, fixed combine format

# Tokens per rank whose layer output is compared with the oracle (the oracle needs every expert those
# tokens hit, built on each rank).
CHECK_TOKENS = 4
# The link measurement: one NCCL send of this many bytes from rank 0 to rank 1, repeated.
LINK_BYTES = 256 << 20
LINK_REPS = 10
FLOAT32_BYTES = 4

# ---- bytes moved ------------------------------------------------------------------------------


ByteModel = Callable[[MoEConfig, RouteCounts, Optional[CombineWire], bool], PhaseBytes]

# ---- the PFs ------------------------------------------------------------------------------------


def make_plain(cls, moe: MoEConfig, context, wire: Optional[str]):
    return cls.make(moe, context)


def make_wired(cls, moe: MoEConfig, context, wire: Optional[str]):
    return cls.make(moe, context, combine_wire=wire)


def make_slice(cls, moe: MoEConfig, context, wire: Optional[str]):
    inner = AllToAllPrepareAndFinalize.make(cls.slice_moe(moe), context, combine_wire=wire)
    return cls(moe, context, inner)


@dataclass(frozen=True)
class PFSpec:
    """One benchmarked PF: its class, how bytes are counted, how it is built.

    wired: it combines over CombineWire (one cell per wire). replicated: every rank passes the same
    whole batch (W*T tokens) and keeps a slice of T."""

    name: str
    cls: type
    bytes_model: Optional[ByteModel]
    build: Callable[..., Any] = make_plain
    wired: bool = False
    replicated: bool = False

    def make(self, moe: MoEConfig, context, wire: Optional[str]):
        return self.build(self.cls, moe, context, None if wire == NO_WIRE else wire)

    def wires(self, wires: Sequence[str]) -> tuple[str, ...]:
        return tuple(wires) if self.wired else (NO_WIRE,)


SLICE_ALLGATHER = "slice_allgather"


def registered_specs() -> dict[str, PFSpec]:
    """Every EP PF of the registry (by backend name), then slice + all-gather over the all-to-all. Each PF's
    class gives its byte model (wire_bytes) and its combine wires."""
    specs: dict[str, PFSpec] = {}
    for name, cls in PREPARE_FINALIZE_BY_BACKEND.items():
        if name == NO_EP_BACKEND:
            continue
        wired = bool(cls.combine_wires())
        specs[name] = PFSpec(name, cls, cls.wire_bytes, make_wired if wired else make_plain, wired)
    specs[SLICE_ALLGATHER] = PFSpec(SLICE_ALLGATHER, SliceAllGatherPrepareAndFinalize,
                                    SliceAllGatherPrepareAndFinalize.wire_bytes, make_slice, wired=True,
                                    replicated=True)
    return specs


PF_SPECS: Mapping[str, PFSpec] = MappingProxyType(registered_specs())

# ---- run configuration ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TimingConfig:
    """rep_ms: time budget of one measurement; reps are clamped to [min_reps, max_reps]."""

    rep_ms: float = 200.0
    warmup: int = 3
    min_reps: int = 10
    max_reps: int = 100


@dataclass(frozen=True)
class RunConfig:
    problem: Problem
    world_size: int
    tokens_per_rank: tuple[int, ...]
    dispatch: tuple[str, ...]
    wires: tuple[str, ...]
    timing: TimingConfig = field(default_factory=TimingConfig)
    seed: int = 0
    check_tokens: int = CHECK_TOKENS
    link_bytes: int = LINK_BYTES

    def cells(self, specs: Sequence[PFSpec]) -> list[dict]:
        """The cell keys in run order (dispatch scheme, tokens, PF, wire)."""
        return [dict(dispatch=d, tokens_per_rank=T, pf=s.name, wire=w)
                for d in self.dispatch for T in self.tokens_per_rank for s in specs for w in s.wires(self.wires)]


def moe_config(problem: Problem, qc: QuantConfig, world_size: int, rank: int, max_tokens: int) -> MoEConfig:
    return MoEConfig(num_experts=problem.E, topk=problem.topk, hidden_dim=problem.K, intermediate_dim=problem.N,
                     dtype=ACTIVATION_DTYPE, quant=qc, parallel=ParallelConfig(ep_size=world_size, ep_rank=rank),
                     max_num_tokens=max(1, max_tokens))


def cell_moe(spec: PFSpec, problem: Problem, qc: QuantConfig, world_size: int, rank: int, T: int) -> MoEConfig:
    """A replicated PF's layer sees the whole batch (W*T tokens) on every rank."""
    return moe_config(problem, qc, world_size, rank, world_size * T if spec.replicated else T)


# ---- seeded inputs (identical wherever they are built) ---------------------------------------------

def make_routing(problem: Problem, world_size: int, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's routing, built on the CPU: topk_weights (W*T, k) float32, topk_ids (W*T, k) int32
    (softmax top-k of seeded logits, renormalized); rows [r*T, (r+1)*T) belong to rank r."""
    from moe_modular.routing import fused_topk

    g = torch.Generator().manual_seed(seed * 1_000_003 + T)
    logits = torch.randn((world_size * T, problem.E), generator=g)
    return fused_topk(logits, logits, problem.topk, renormalize=True)


def make_tokens(problem: Problem, rank: int, T: int, seed: int, device: torch.device) -> torch.Tensor:
    """Rank `rank`'s (T, K) bf16 hidden states."""
    g = torch.Generator(device=device).manual_seed(seed * 7919 + rank * 104_729 + T)
    return torch.randn((T, problem.K), generator=g, device=device).to(ACTIVATION_DTYPE)


def make_expert_weights(problem: Problem, qc: QuantConfig, experts: Sequence[int], seed: int,
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor, MoEQuantParams]:
    """w1 (n, 2N, K), w2 (n, K, N) of the listed global experts (bf16, or fp8 with scales), each expert
    from its own seed, so any rank builds any expert identically."""
    E, K, N = len(experts), problem.K, problem.N
    wdtype = FP8_DTYPE if qc.is_quantized else ACTIVATION_DTYPE
    w1 = torch.empty((E, 2 * N, K), dtype=wdtype, device=device)
    w2 = torch.empty((E, K, N), dtype=wdtype, device=device)
    scales: dict[str, list[torch.Tensor]] = {"w1": [], "w2": []}
    g = torch.Generator(device=device)
    for i, e in enumerate(experts):
        g.manual_seed(seed * 100_003 + int(e))
        for name, w, fan_in in (("w1", w1, K), ("w2", w2, N)):
            f = torch.randn((1,) + tuple(w.shape[1:]), generator=g, device=device) / math.sqrt(fan_in)
            if not qc.is_quantized:
                f = f.to(ACTIVATION_DTYPE).float()  # the bf16 weights the oracle sees too
            q, s = quantize_weights(f, qc)
            w[i] = q[0].to(wdtype)
            if s is not None:
                scales[name].append(s)
    cat = lambda xs: torch.cat(xs) if xs else None  # noqa: E731
    return w1, w2, MoEQuantParams(qc, cat(scales["w1"]), cat(scales["w2"]))


# ---- timing on a rank -------------------------------------------------------------------------------


class RankTimer:
    """Median time of each of a list of steps run in turn, every step after a barrier of all ranks.
    CUDA events on a GPU, perf_counter on the CPU. Every rank runs the same number of repetitions
    (the largest any rank asks for)."""

    def __init__(self, device: torch.device, group: Any, cfg: TimingConfig) -> None:
        self.device, self.group, self.cfg = device, group, cfg
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        self.sync()
        dist.barrier(group=self.group)
        self.sync()

    def agree_max(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def medians_us(self, steps: Sequence[Callable[[], object]]) -> list[float]:
        for _ in range(self.cfg.warmup):
            for step in steps:
                step()
        self.barrier()
        t0 = time.perf_counter()
        for step in steps:
            step()
        self.sync()
        est_ms = max((time.perf_counter() - t0) * 1e3, 1e-3)
        reps = self.agree_max(int(min(self.cfg.max_reps, max(self.cfg.min_reps, self.cfg.rep_ms / est_ms))))
        times: list[list[float]] = [[] for _ in steps]
        events: list[list[tuple[Any, Any]]] = [[] for _ in steps]
        for _ in range(reps):
            for i, step in enumerate(steps):
                self.barrier()
                if self.cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    step()
                    end.record()
                    events[i].append((start, end))
                else:
                    t0 = time.perf_counter()
                    step()
                    times[i].append((time.perf_counter() - t0) * 1e6)
        self.sync()
        if self.cuda:
            times = [[s.elapsed_time(e) * 1e3 for s, e in evs] for evs in events]
        return [statistics.median(ts) for ts in times]


def measure_link(rank: int, world_size: int, device: torch.device, group: Any, n_bytes: int) -> dict:
    """GB/s of an NCCL send of n_bytes from rank 0 to rank 1 (median of LINK_REPS, timed on the
    receiver with CUDA events), or why it was not measured. Every rank must call it."""
    if device.type != "cuda":
        return {"link_GBps": None, "link_note": "not measured: the ranks run on the CPU (gloo), there is no GPU link"}
    if world_size < 2:
        return {"link_GBps": None, "link_note": "not measured: one GPU, no peer to send to"}
    buf = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    if rank == 0:
        buf.fill_(1)
    times_ms = []
    for i in range(LINK_REPS + 2):
        torch.cuda.synchronize(device)
        dist.barrier(group=group)
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if rank == 0:
            dist.send(buf, dst=dist.get_global_rank(group, 1), group=group)
        elif rank == 1:
            dist.recv(buf, src=dist.get_global_rank(group, 0), group=group)
        end.record()
        torch.cuda.synchronize(device)
        if i >= 2:  # the first two set up the connection
            times_ms.append(start.elapsed_time(end))
    if rank != 1:
        return {}
    peer = torch.cuda.can_device_access_peer(device.index, (device.index + 1) % torch.cuda.device_count()) \
        if torch.cuda.device_count() > 1 else False
    return {"link_GBps": n_bytes / (statistics.median(times_ms) * 1e-3) / 1e9,
            "link_note": f"NCCL send of {n_bytes >> 20} MiB rank 0 -> rank 1, median of {LINK_REPS} "
                         f"(peer access {'yes' if peer else 'no'})"}


# ---- one rank ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _RankData:
    """What a rank built for one (dispatch scheme, tokens per rank): its slice of the problem."""

    x: torch.Tensor  # (T, K) bf16, this rank's tokens
    x_all: torch.Tensor  # (W*T, K) bf16, every rank's tokens (replicated PFs)
    tw_all: torch.Tensor  # (W*T, k) float32
    ti_all: torch.Tensor  # (W*T, k) int32 global ids
    ref: torch.Tensor  # (c, K) float32 oracle of this rank's first c tokens
    counts: RouteCounts


def _reference(cfg: RunConfig, qc: QuantConfig, x: torch.Tensor, tw: torch.Tensor, ti: torch.Tensor,
               device: torch.device) -> torch.Tensor:
    """The float32 oracle of tokens x (c, K) with routing (c, k), from the experts they hit."""
    from moe_modular.reference import moe_torch

    used, local = torch.unique(ti.long(), return_inverse=True)
    w1, w2, qp = make_expert_weights(cfg.problem, qc, used.tolist(), cfg.seed, device)
    return moe_torch(x, w1, w2, tw, local, quant=qp)


def _rank_data(cfg: RunConfig, qc: QuantConfig, rank: int, T: int, device: torch.device) -> _RankData:
    W, p = cfg.world_size, cfg.problem
    tw_all, ti_all = make_routing(p, W, T, cfg.seed)
    x_all = torch.cat([make_tokens(p, r, T, cfg.seed, device) for r in range(W)])
    x = x_all[rank * T:(rank + 1) * T]
    c = min(cfg.check_tokens, T)
    rows = slice(rank * T, rank * T + c)
    ref = _reference(cfg, qc, x_all[rows], tw_all[rows].to(device), ti_all[rows].to(device), device)
    tables = ExpertPlacementTables.build(moe_config(p, qc, W, 0, T), torch.device("cpu"))
    counts = RouteCounts.from_owners(tables.owner_of(ti_all).view(W, T, p.topk))
    return _RankData(x, x_all, tw_all.to(device), ti_all.to(device), ref, counts)


def _fixed_expert_output(fe, prepared, moe: MoEConfig, seed: int) -> torch.Tensor:
    """A seeded experts output of the shape the experts write for `prepared` (what finalize combines)."""
    batched = fe.activation_formats()[0] is ActivationFormat.BatchedExperts
    a1q = prepared.a1q
    M = a1q.size(1) if batched else a1q.size(0)
    rerouted = prepared.topk_ids is not None
    topk = prepared.topk_ids.size(1) if rerouted else moe.topk
    E = moe.num_local_experts if rerouted else moe.num_experts
    _, _, out_shape, _ = fe.workspace_shapes(M, 2 * moe.intermediate_dim, moe.hidden_dim, topk, E,
                                            moe.num_local_experts, prepared.expert_tokens_meta)
    g = torch.Generator(device=a1q.device).manual_seed(seed)
    return (torch.randn(tuple(out_shape), generator=g, device=a1q.device) * 0.1).to(moe.dtype)


def run_cell(spec: PFSpec, wire: str, qc: QuantConfig, T: int, data: _RankData, weights, cfg: RunConfig,
             context, timer: RankTimer) -> dict:
    """One cell on this rank: SKIP (with the reason), or the oracle check and the three timings."""
    from moe_modular.modular_kernel import FusedMoEModularKernel
    from moe_modular.registry import select_experts_type
    from moe_modular.weight_and_reduce import TopKWeightAndReduceNoOp
    from moe_modular.testing.common import tolerance
    from moe_modular.testing.runner import relative_error

    rank, W, device = context.rank, context.world_size, context.device
    moe = cell_moe(spec, cfg.problem, qc, W, rank, T)
    ok, reason = spec.cls.supports(moe)
    if ok and spec.bytes_model is None:
        ok, reason = False, f"tools/benchmark_ep.py has no byte model for {spec.cls.__name__}"
    if ok:
        try:
            fe_cls = select_experts_type(spec.cls.activation_format(), moe, device.type)
        except ValueError as exc:
            ok, reason = False, str(exc)
    if not ok:
        return {"status": "SKIP", "reason": reason}
    row: dict = {"pf_class": spec.cls.__name__, "experts": fe_cls.__name__, "tol": tolerance(moe.dtype, qc)}
    w1, w2, qp, expert_map = weights
    x, tw, ti = (data.x_all, data.tw_all, data.ti_all) if spec.replicated else (
        data.x, data.tw_all[rank * T:(rank + 1) * T], data.ti_all[rank * T:(rank + 1) * T])
    own = slice(rank * T, rank * T + data.ref.size(0)) if spec.replicated else slice(0, data.ref.size(0))
    try:
        pf = spec.make(moe, context, wire)
        fe = fe_cls.for_prepare_finalize(moe, qp, pf)
        kernel = FusedMoEModularKernel(pf, fe)
        out = torch.full_like(x, float("nan"))

        def layer() -> None:
            kernel(x, w1, w2, tw, ti, global_num_experts=moe.num_experts, expert_map=expert_map, output=out)

        layer()
        timer.sync()
        err = relative_error(out[own], data.ref)
        row["rel_err"] = err
        row["status"] = "PASS" if math.isfinite(err) and err <= row["tol"] else "FAIL"
        if row["status"] == "FAIL":
            row["reason"] = f"layer output vs the float32 oracle: relative error {err:.3g} > tolerance {row['tol']:.3g}"
        experts_reduce = isinstance(fe.finalize_weight_and_reduce_impl(), TopKWeightAndReduceNoOp)
        wire_obj = combine_wire(wire) if spec.wired else None
        moved = spec.bytes_model(moe, data.counts, wire_obj, experts_reduce)
        row["dispatch_bytes"], row["combine_bytes"] = max(moved.dispatch), max(moved.combine)

        row["layer_us"] = timer.medians_us([layer])[0]

        idx_dtype = pf.topk_indices_dtype()
        ids = ti.to(idx_dtype) if idx_dtype is not None else ti
        prepared = pf.prepare(x, tw, ids, moe.num_experts, expert_map, False, fe.quant)
        fused = _fixed_expert_output(fe, prepared, moe, cfg.seed + rank)
        impl = fe.finalize_weight_and_reduce_impl()
        out2 = torch.empty_like(x)
        row["dispatch_us"], row["combine_us"] = timer.medians_us([
            lambda: pf.prepare(x, tw, ids, moe.num_experts, expert_map, False, fe.quant),
            lambda: pf.finalize(out2, fused, tw, ids, False, impl, prepared.handle),
        ])
    except Exception as exc:  # noqa: BLE001 - the cell is reported FAIL with its error, the run goes on
        row["status"] = "FAIL"
        row["reason"] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
        row["traceback"] = traceback.format_exc()
    return row


def _rank_worker(pgi, cfg: RunConfig, specs: tuple[PFSpec, ...], result_dir: str) -> None:
    """One rank: the link measurement, then every cell in order; results in result_dir/rank{r}.json
    (rewritten after each cell, so a later crash keeps what was done)."""
    from moe_modular.parallel_context import ParallelContext
    from moe_modular.routing import local_expert_ids, make_expert_map

    rank, W, device = pgi.rank, pgi.world_size, pgi.device
    context = ParallelContext.from_group(pgi.group, device)
    timer = RankTimer(device, pgi.group, cfg.timing)
    path = os.path.join(result_dir, f"rank{rank}.json")
    result: dict = {"rank": rank, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "cells": []}
    result.update(measure_link(rank, W, device, pgi.group, cfg.link_bytes))

    def save() -> None:
        with open(path + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(path + ".tmp", path)

    save()
    try:
        held = local_expert_ids(cfg.problem.E, W, rank).tolist()
        expert_map = make_expert_map(cfg.problem.E, W, rank, device=device)
        for dname in cfg.dispatch:
            qc = DISPATCH_SCHEMES[dname]
            w1, w2, qp = make_expert_weights(cfg.problem, qc, held, cfg.seed, device)
            weights = (w1, w2, qp, expert_map)
            for T in cfg.tokens_per_rank:
                data = _rank_data(cfg, qc, rank, T, device)
                for spec in specs:
                    for wire in spec.wires(cfg.wires):
                        t0 = time.perf_counter()
                        row = dict(dispatch=dname, tokens_per_rank=T, pf=spec.name, wire=wire)
                        row.update(run_cell(spec, wire, qc, T, data, weights, cfg, context, timer))
                        row["wall_s"] = time.perf_counter() - t0
                        result["cells"].append(row)
                        save()
                del data
            del w1, w2, qp, weights
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        context.destroy()


# ---- merging the ranks -------------------------------------------------------------------------

CSV_FIELDS = ["pf", "pf_class", "wire", "dispatch", "tokens_per_rank", "world_size", "hidden", "experts_total",
              "topk", "experts", "status", "reason", "dispatch_us", "combine_us", "layer_us", "dispatch_bytes",
              "combine_bytes", "dispatch_GBps", "combine_GBps", "dispatch_link_frac", "combine_link_frac",
              "rel_err", "tol"]
_TIME_FIELDS = ("dispatch_us", "combine_us", "layer_us")


def merge_cells(cfg: RunConfig, specs: Sequence[PFSpec], per_rank: list[Optional[dict]], link_GBps: Optional[float],
                launch_error: str = "") -> list[dict]:
    """One row per cell: times and errors the largest over ranks, FAIL if any rank failed, SKIP if every
    rank skipped; a cell some rank never reported is FAIL with the launch error."""
    by_rank = [{(c["dispatch"], c["tokens_per_rank"], c["pf"], c["wire"]): c for c in (r or {}).get("cells", [])}
               for r in per_rank]
    classes = {s.name: s.cls.__name__ for s in specs}
    rows = []
    for key in cfg.cells(specs):
        k = (key["dispatch"], key["tokens_per_rank"], key["pf"], key["wire"])
        got = [r.get(k) for r in by_rank]
        row = dict(key, pf_class=classes[key["pf"]], world_size=cfg.world_size, hidden=cfg.problem.K,
                   experts_total=cfg.problem.E, topk=cfg.problem.topk)
        if any(g is None for g in got):
            missing = [i for i, g in enumerate(got) if g is None]
            row.update(status="FAIL", reason=f"ranks {missing} never reported this cell"
                       + (f": {launch_error.splitlines()[0][:300]}" if launch_error else ""))
            rows.append(row)
            continue
        statuses = [g["status"] for g in got]
        first_fail = next((g for g in got if g["status"] == "FAIL"), None)
        if first_fail is not None:
            row.update(status="FAIL", reason=first_fail.get("reason", ""))
        elif all(s == "SKIP" for s in statuses):
            row.update(status="SKIP", reason=got[0].get("reason", ""))
            rows.append(row)
            continue
        else:
            row["status"] = "PASS"
        for f in ("experts", "tol", "dispatch_bytes", "combine_bytes"):
            row[f] = got[0].get(f)
        for f in _TIME_FIELDS + ("rel_err",):
            vals = [g.get(f) for g in got]
            row[f] = max(vals) if all(v is not None for v in vals) else None
        for phase in ("dispatch", "combine"):
            us, nbytes = row.get(f"{phase}_us"), row.get(f"{phase}_bytes")
            if us and nbytes is not None:
                row[f"{phase}_GBps"] = nbytes / us / 1e3
                if link_GBps:
                    row[f"{phase}_link_frac"] = row[f"{phase}_GBps"] / link_GBps
        rows.append(row)
    return rows


# ---- outputs ---------------------------------------------------------------------------------------

def _fmt(v, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def table_text(rows: list[dict], meta: dict) -> str:
    link = meta.get("link_GBps")
    lines = [f"{meta['problem']} (E={meta['E']} K={meta['K']} N={meta['N']} top-{meta['topk']}), world size "
             f"{meta['world_size']} on {meta['backend']}, {meta['device_count']} x {meta['device']}; link: "
             + (f"{link:.1f} GB/s ({meta['link_note']})" if link else meta["link_note"]), "",
             "| dispatch | tokens/rank | PF | wire | status | dispatch us | combine us | layer us | dispatch MB "
             "| combine MB | dispatch GB/s | combine GB/s | link frac d/c | rel err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] == "SKIP":
            cells = [r["dispatch"], r["tokens_per_rank"], r["pf"], r["wire"], f"SKIP: {r['reason']}"] + [""] * 9
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
            continue
        mb = lambda v: None if v is None else v / 1e6  # noqa: E731
        frac = ("-" if r.get("dispatch_link_frac") is None else
                f"{r['dispatch_link_frac']:.2f}/{r.get('combine_link_frac') or 0:.2f}")
        status = r["status"] if r["status"] == "PASS" else f"FAIL: {r.get('reason', '')}"
        lines.append(f"| {r['dispatch']} | {r['tokens_per_rank']} | {r['pf']} | {r['wire']} | {status} | "
                     f"{_fmt(r.get('dispatch_us'))} | {_fmt(r.get('combine_us'))} | {_fmt(r.get('layer_us'))} | "
                     f"{_fmt(mb(r.get('dispatch_bytes')), '.3f')} | {_fmt(mb(r.get('combine_bytes')), '.3f')} | "
                     f"{_fmt(r.get('dispatch_GBps'), '.2f')} | {_fmt(r.get('combine_GBps'), '.2f')} | {frac} | "
                     f"{_fmt(r.get('rel_err'), '.1e')} |")
    n = {s: sum(1 for r in rows if r["status"] == s) for s in ("PASS", "FAIL", "SKIP")}
    lines += ["", f"{len(rows)} cells: {n['PASS']} PASS, {n['FAIL']} FAIL, {n['SKIP']} SKIP"]
    return "\n".join(lines)


def plot(path: str, rows: list[dict], meta: dict) -> Optional[str]:
    """Dispatch and combine GB/s per PF (and wire), one panel per (dispatch scheme, tokens per rank),
    with the measured link bandwidth as a line. Returns a note instead when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed; no PNG written"
    timed = [r for r in rows if r.get("dispatch_GBps") is not None]
    panels = list(dict.fromkeys((r["dispatch"], r["tokens_per_rank"]) for r in timed))
    if not panels:
        return "no timed cell; no PNG written"
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.5), squeeze=False)
    for ax, (d, T) in zip(axes[0], panels):
        cells = [r for r in timed if (r["dispatch"], r["tokens_per_rank"]) == (d, T)]
        labels = [r["pf"] + ("" if r["wire"] == NO_WIRE else f"/{r['wire']}") for r in cells]
        ys = range(len(cells))
        ax.barh([y - 0.2 for y in ys], [r["dispatch_GBps"] for r in cells], height=0.4, label="dispatch")
        ax.barh([y + 0.2 for y in ys], [r.get("combine_GBps") or 0 for r in cells], height=0.4, label="combine")
        if meta.get("link_GBps"):
            ax.axvline(meta["link_GBps"], color="k", ls=":", label="link (measured)")
        ax.set_yticks(list(ys))
        ax.set_yticklabels(labels, fontsize=7)
        ax.set_xlabel("GB/s per rank (algorithmic)")
        ax.set_title(f"{d}, {T} tokens/rank", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"{meta['problem']}, world size {meta['world_size']} ({meta['backend']}, {meta['device']})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# ---- the run -----------------------------------------------------------------------------------------

def run(cfg: RunConfig, out_dir: str, specs: Optional[Sequence[PFSpec]] = None, backend: Optional[str] = None,
        timeout_s: float = 3600.0, command: str = "") -> tuple[list[dict], dict]:
    """Spawn the ranks, run every cell, write OUT/benchmark_ep.{csv,json,png}; (rows, run metadata)."""
    from moe_modular.testing.parallel_utils import ParallelLaunchError, choose_backend, parallel_launch

    specs = tuple(PF_SPECS.values() if specs is None else specs)
    backend = backend or choose_backend(cfg.world_size)
    os.makedirs(out_dir, exist_ok=True)
    launch_error = ""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="benchmark_ep_") as tmp:
        try:
            parallel_launch(cfg.world_size, _rank_worker, cfg, specs, tmp, timeout_s=timeout_s, backend=backend)
        except ParallelLaunchError as exc:
            launch_error = str(exc)
            print(f"launch failed: {launch_error}", file=sys.stderr)
        per_rank = []
        for r in range(cfg.world_size):
            p = os.path.join(tmp, f"rank{r}.json")
            if os.path.exists(p):
                with open(p) as f:
                    per_rank.append(json.load(f))
            else:
                per_rank.append(None)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    link_src = next((r for r in per_rank if r and r.get("link_GBps") is not None), None) or \
        next((r for r in per_rank if r and r.get("link_note")), {})
    meta = {"problem": cfg.problem.label, **{k: getattr(cfg.problem, k) for k in ("E", "K", "N", "topk")},
            "world_size": cfg.world_size, "backend": backend,
            "device": (per_rank[0] or {}).get("device", "unknown"),
            "device_count": torch.cuda.device_count() if backend == "nccl" else 0,
            "torch": torch.__version__, "triton": triton_version,
            "link_GBps": link_src.get("link_GBps"),
            "link_note": link_src.get("link_note", "not measured: no rank reported"),
            "config": asdict(cfg), "command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "wall_s": time.perf_counter() - t0, "launch_error": launch_error}
    rows = merge_cells(cfg, specs, per_rank, meta["link_GBps"], launch_error)
    write_csv(os.path.join(out_dir, "benchmark_ep.csv"), rows, CSV_FIELDS)
    with open(os.path.join(out_dir, "benchmark_ep.json"), "w") as f:
        json.dump(meta, f, indent=1, default=str)
    note = plot(os.path.join(out_dir, "benchmark_ep.png"), rows, meta)
    if note:
        print(note, file=sys.stderr)
    return rows, meta


# ---- command line -------------------------------------------------------------------------------------

def parse_args(argv=None) -> tuple[argparse.Namespace, RunConfig]:
    p = argparse.ArgumentParser(prog="python -m tools.benchmark_ep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, help=f"EP ranks (default: the GPU count; {SMOKE_WORLD_SIZE} with --smoke)")
    p.add_argument("--pf-types", nargs="+", default=list(PF_SPECS), help=f"of {list(PF_SPECS)}")
    p.add_argument("--tokens-per-rank", type=int, nargs="+",
                   help=f"default {list(BENCH_TOKENS)} ({list(SMOKE_TOKENS)} with --smoke)")
    p.add_argument("--dispatch", nargs="+", default=list(DEFAULT_DISPATCH), help=f"of {list(DISPATCH_SCHEMES)}")
    p.add_argument("--wires", nargs="+", default=list(COMBINE_WIRES), help=f"combine wires, of {list(COMBINE_WIRES)}")
    p.add_argument("--rep-ms", type=float, help="time budget of one measurement (default 200; 10 with --smoke)")
    p.add_argument("--out", default="benchmark_ep_out", help="directory for the CSV, JSON and PNG")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, help="bound of the whole launch (default 3600; 300 with --smoke)")
    p.add_argument("--smoke", action="store_true",
                   help=f"tiny shapes ({SMOKE_PROBLEM}) on the CPU over gloo: a functional check, "
                        "not a performance figure")
    args = p.parse_args(argv)
    for name, values, allowed in (("--pf-types", args.pf_types, PF_SPECS),
                                  ("--dispatch", args.dispatch, DISPATCH_SCHEMES),
                                  ("--wires", args.wires, COMBINE_WIRES)):
        for v in values:
            if v not in allowed:
                p.error(f"{name} ({v!r}) must be one of {list(allowed)}")
    problem = SMOKE_PROBLEM if args.smoke else PROBLEM
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.world_size is None:
        args.world_size = SMOKE_WORLD_SIZE if args.smoke else max(gpus, 1)
    if args.world_size < 1:
        p.error(f"--world-size ({args.world_size}) must be an int >= 1")
    if problem.E % args.world_size:
        p.error(f"--world-size ({args.world_size}) must divide the number of experts ({problem.E})")
    if not args.smoke and args.world_size > gpus:
        p.error(f"--world-size ({args.world_size}) needs that many GPUs; this machine has {gpus} "
                f"(use --smoke for the tiny CPU check)")
    tokens = tuple(args.tokens_per_rank or (SMOKE_TOKENS if args.smoke else BENCH_TOKENS))
    for T in tokens:
        if T < 1:
            p.error(f"--tokens-per-rank ({T}) must be >= 1")
    timing = (TimingConfig(rep_ms=args.rep_ms or 10.0, warmup=1, min_reps=3, max_reps=10) if args.smoke
              else TimingConfig(rep_ms=args.rep_ms or 200.0))
    if timing.rep_ms <= 0:
        p.error(f"--rep-ms ({timing.rep_ms}) must be > 0")
    args.backend = "gloo" if args.smoke else None
    args.timeout_s = args.timeout_s or (300.0 if args.smoke else 3600.0)
    cfg = RunConfig(problem, args.world_size, tokens, tuple(dict.fromkeys(args.dispatch)),
                    tuple(dict.fromkeys(args.wires)), timing, args.seed)
    return args, cfg


def main(argv=None) -> int:
    args, cfg = parse_args(argv)
    specs = [PF_SPECS[n] for n in dict.fromkeys(args.pf_types)]
    command = "python -m tools.benchmark_ep " + " ".join(sys.argv[1:] if argv is None else argv)
    rows, meta = run(cfg, args.out, specs, backend=args.backend, timeout_s=args.timeout_s, command=command)
    print(f"wrote {os.path.join(args.out, 'benchmark_ep.csv')} and benchmark_ep.json in {meta['wall_s']:.1f} s",
          file=sys.stderr)
    print(table_text(rows, meta))
    return 1 if any(r["status"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
