"""What the maintained benchmarks and the experiments share: the benchmark shapes and schemes, the timer (L2 flush,
CUDA events, median), the ceilings it measures, the seeded weights and inputs, the floor of a forward, CUDA graph
capture, the oracle spot check, CSV files and the --shapes / --quant flags.

Shape legend: E experts, K hidden size, N intermediate size (w1 is 2N x K), M tokens, k top-k.
"""
from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from moe_modular.quant import QuantConfig, quantize_weights


@dataclass(frozen=True)
class Shape:
    """One MoE layer: E experts, hidden K, intermediate N, top-k."""

    label: str
    E: int
    K: int
    N: int
    topk: int


SHAPES: dict[str, Shape] = {
    "mixtral": Shape("Mixtral-8x7B", 8, 4096, 14336, 2),
    "qwen3": Shape("Qwen3-30B-A3B", 128, 2048, 768, 8),
    "deepseek-v3": Shape("DeepSeek-V3", 256, 7168, 2048, 8),
    # Shapes without tuned tables, run only when named: they show the default heuristic's tiles.
    "qwen3-235b": Shape("Qwen3-235B-A22B", 128, 4096, 1536, 8),
    "deepseek-v3-ep8": Shape("DeepSeek-V3 EP8 (one rank's experts)", 32, 7168, 2048, 8),
}


DEFAULT_SHAPES = ["mixtral", "qwen3", "deepseek-v3"]


SMOKE_SHAPES: dict[str, Shape] = {
    "tiny": Shape("tiny", 8, 64, 32, 2),
    "tiny-e16": Shape("tiny-e16", 16, 128, 64, 4),
}


BENCH_MS = [1, 8, 64, 256, 1024, 4096, 16384]


SMOKE_MS = [1, 8, 33]


QUANTS: dict[str, QuantConfig] = {
    "bf16": QuantConfig.unquantized(),
    "fp8-tensor": QuantConfig.fp8_per_tensor(),
    "fp8-token": QuantConfig.fp8_per_token(),
    "fp8-block": QuantConfig.fp8_block((128, 128)),
}


# Rotate input sets while one forward touches less than this many L2 sizes.
ROTATE_BELOW_L2 = 4


MAX_SETS = 8


# Tokens of the correctness spot check (their output against the float32 oracle).
CHECK_TOKENS = 4


# Weights are generated (and quantized) this many bytes of float32 at a time.
WEIGHT_CHUNK_BYTES = 1 << 30


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Timer:
    """do_bench-style timing on one device: CUDA events with an L2 flush before each repetition on a
    GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device, rep_ms: float, min_reps: int = 10, max_reps: int = 200) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.rep_ms, self.min_reps, self.max_reps = rep_ms, min_reps, max_reps
        self.l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size if self.cuda else 0
        flush_bytes = max(256 << 20, 2 * self.l2_bytes) if self.cuda else 0
        self._flush = torch.empty(flush_bytes // 4, dtype=torch.int32, device=device) if self.cuda else None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def median_s(self, fn: Callable[[], object], per_call: int = 1) -> float:
        """Median seconds of fn() / per_call."""
        fn()
        self.sync()
        t0 = time.perf_counter()
        for _ in range(2):
            fn()
        self.sync()
        est_ms = max((time.perf_counter() - t0) / 2 * 1e3, 1e-3)
        reps = int(min(self.max_reps, max(self.min_reps, self.rep_ms / est_ms)))
        times = []
        if not self.cuda:
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times) / per_call
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            self._flush.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        self.sync()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) / 1e3 / per_call


def measure_ceilings(timer: Timer, smoke: bool) -> dict:
    """Copy bandwidth (bytes/s, read + write), bf16 and fp8 matmul rates (flop/s; fp8 0 when absent)."""
    dev = timer.device
    n_bytes = (16 << 20) if smoke else (2 << 30)
    src = torch.empty(n_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_s = timer.median_s(lambda: dst.copy_(src))
    src = dst = None  # drop the references (closures above use these names)
    n = 256 if smoke else 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    mm_s = timer.median_s(lambda: torch.mm(a, b))
    out = {"copy_bytes": 2 * n_bytes, "copy_Bps": 2 * n_bytes / copy_s, "matmul_n": n,
           "bf16_flops": 2 * n ** 3 / mm_s, "fp8_flops": 0.0, "fp8_note": ""}
    try:
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.to(torch.float8_e4m3fn).t().contiguous().t()  # column-major, as _scaled_mm wants it
        one = torch.ones((), device=dev, dtype=torch.float32)
        fp8_s = timer.median_s(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16))
        out["fp8_flops"] = 2 * n ** 3 / fp8_s
    except (RuntimeError, NotImplementedError) as exc:
        out["fp8_note"] = f"fp8 matmul not measured: {str(exc).splitlines()[0][:160]}"
    return out


@dataclass
class Weights:
    w1: torch.Tensor  # (E, 2N, K) bf16 or fp8
    w2: torch.Tensor  # (E, K, N)
    qp: object  # MoEQuantParams


def make_weights(shape: Shape, qc: QuantConfig, device: torch.device, seed: int) -> Weights:
    """Seeded random expert weights (scaled by 1/sqrt(fan-in)), quantized to qc, built a chunk of
    experts at a time so no full-size float32 copy exists."""
    from moe_modular.quant import MoEQuantParams

    E, K, N = shape.E, shape.K, shape.N
    per_expert = 2 * N * K * 4
    chunk = max(1, min(E, WEIGHT_CHUNK_BYTES // per_expert))
    wdtype = torch.float8_e4m3fn if qc.is_quantized else torch.bfloat16
    w1 = torch.empty(E, 2 * N, K, dtype=wdtype, device=device)
    w2 = torch.empty(E, K, N, dtype=wdtype, device=device)
    scales: dict[str, torch.Tensor] = {}
    g = torch.Generator(device=device)
    for e0 in range(0, E, chunk):
        e1 = min(E, e0 + chunk)
        g.manual_seed(seed * 100003 + e0)
        for name, w, fan_in in (("w1", w1, K), ("w2", w2, N)):
            f = torch.randn((e1 - e0,) + tuple(w.shape[1:]), generator=g, device=device) / math.sqrt(fan_in)
            q, s = quantize_weights(f, qc)
            w[e0:e1] = q
            if s is not None:
                if name not in scales:
                    scales[name] = torch.empty((E,) + tuple(s.shape[1:]), dtype=s.dtype, device=device)
                scales[name][e0:e1] = s
            del f, q
    return Weights(w1, w2, MoEQuantParams(qc, scales.get("w1"), scales.get("w2")))


@dataclass
class InputSet:
    x: torch.Tensor  # (M, K) bf16
    topk_weights: torch.Tensor  # (M, k) float32
    topk_ids: torch.Tensor  # (M, k) int32
    distinct: int  # experts hit


def make_inputs(shape: Shape, M: int, n_sets: int, device: torch.device, seed: int) -> list[InputSet]:
    """n_sets seeded token batches with fixed random routing (top-k of a softmax over random logits)."""
    sets = []
    g = torch.Generator(device=device)
    for i in range(n_sets):
        g.manual_seed(seed * 7919 + M * 31 + i)
        x = torch.randn(M, shape.K, generator=g, device=device).to(torch.bfloat16)
        logits = torch.randn(M, shape.E, generator=g, device=device)
        tw, ti = torch.topk(torch.softmax(logits, dim=-1), shape.topk, dim=-1)
        tw = (tw / tw.sum(dim=-1, keepdim=True)).float()
        sets.append(InputSet(x, tw, ti.to(torch.int32), int(torch.unique(ti).numel())))
    return sets


def weight_bytes_per_expert(shape: Shape, qc: QuantConfig) -> int:
    return 3 * shape.N * shape.K * (1 if qc.is_quantized else 2)


def floor_of(shape: Shape, qc: QuantConfig, M: int, distinct: int, ceil: dict) -> tuple[int, int, float, str]:
    """(bytes, flops, seconds, "memory" | "compute") of one forward."""
    nbytes = distinct * weight_bytes_per_expert(shape, qc) + 2 * M * shape.K * 2
    flops = 2 * M * shape.topk * 3 * shape.N * shape.K
    rate = ceil["fp8_flops"] if qc.is_quantized else ceil["bf16_flops"]
    t_mem = nbytes / ceil["copy_Bps"]
    t_cmp = flops / rate if rate > 0 else float("nan")
    if not rate > 0:
        return nbytes, flops, t_mem, "memory"
    return nbytes, flops, max(t_mem, t_cmp), "memory" if t_mem >= t_cmp else "compute"


def n_sets_for(shape: Shape, qc: QuantConfig, M: int, l2_bytes: int) -> int:
    """Input sets to rotate: enough that the sets together span ROTATE_BELOW_L2 L2 sizes."""
    if l2_bytes <= 0:
        return 1
    hit = min(shape.E, M * shape.topk)
    touched = hit * weight_bytes_per_expert(shape, qc) + 2 * M * shape.K * 2
    if touched >= ROTATE_BELOW_L2 * l2_bytes:
        return 1
    return int(min(MAX_SETS, max(2, math.ceil(ROTATE_BELOW_L2 * l2_bytes / touched))))


def spot_check(shape: Shape, qc: QuantConfig, weights: Weights, inp: InputSet, out: torch.Tensor) -> float:
    """Relative error of the first CHECK_TOKENS output rows against the float32 oracle run on those
    tokens and the experts they hit (NaN for per-tensor dynamic scales, which depend on the batch)."""
    from dataclasses import replace

    from moe_modular.reference import moe_torch

    if qc.is_quantized and qc.activation.value == "per-tensor":
        return float("nan")
    t = min(CHECK_TOKENS, inp.x.size(0))
    ids = inp.topk_ids[:t].long()
    used, local = torch.unique(ids, return_inverse=True)
    qp = weights.qp
    if qp.w1_scale is not None:
        qp = replace(qp, w1_scale=qp.w1_scale[used], w2_scale=qp.w2_scale[used])
    ref = moe_torch(inp.x[:t], weights.w1[used], weights.w2[used], inp.topk_weights[:t], local, quant=qp)
    return float((out[:t].double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


def capture_graph(fns: list[Callable[[], object]], device: torch.device) -> "torch.cuda.CUDAGraph":
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return graph


def write_csv(path: str, rows: list[dict], fields: Sequence[str]) -> None:
    """rows as CSV with the columns `fields`; None is written as an empty cell."""
    fields = list(fields)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in fields})


_INT_FIELDS = {"E", "K", "N", "topk", "M", "n_sets", "call"}


_STR_FIELDS = {"quant", "shape", "experts", "status", "bound", "yardstick_scaling"}


def read_csv(path: str) -> list[dict]:
    """Rows written by write_csv, with numbers as numbers and empty cells as None."""
    rows = []
    with open(path) as f:
        for raw in csv.DictReader(f):
            row = {}
            for k, v in raw.items():
                if k in _STR_FIELDS:
                    row[k] = v
                elif v in ("", None):
                    row[k] = None
                else:
                    row[k] = int(v) if k in _INT_FIELDS else float(v)
            rows.append(row)
    return rows


def resolve_shapes_and_quants(p: argparse.ArgumentParser, args, smoke_default: Sequence[str] = ()) -> dict:
    """The shape table for args.smoke (SMOKE_SHAPES or SHAPES); args.shapes defaults to smoke_default
    under --smoke (else DEFAULT_SHAPES, the tuned ones). A name in args.shapes or args.quant outside its
    table is a parser error that names the allowed ones."""
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    default = (list(smoke_default) or list(shapes)) if args.smoke else DEFAULT_SHAPES
    args.shapes = args.shapes or list(default)
    for s in args.shapes:
        if s not in shapes:
            p.error(f"--shapes ({s!r}) must be one of {list(shapes)}")
    for q in args.quant:
        if q not in QUANTS:
            p.error(f"--quant ({q!r}) must be one of {list(QUANTS)}")
    return shapes
