"""Benchmark one MoE layer forward (routing given) against the hardware floor of BENCHMARKS.md.

    python -m tools.benchmark_moe --out OUT                                # bf16, 3 shapes, 7 M each
    python -m tools.benchmark_moe --quant bf16 fp8-token fp8-block --out OUT
    python -m tools.benchmark_moe --shapes qwen3 -m 1 256 --experts grouped_mm
    python -m tools.benchmark_moe --smoke --out OUT                         # tiny shapes on the CPU
    python -m tools.benchmark_moe --quant fp8-block bf16 --out OUT --resume # go on with a cut run in OUT

For each quant scheme, shape and M: FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP, experts) for each
experts class (TritonExperts, GroupedMMExperts), timed eager and as a CUDA graph replay; the floor
    bytes  = distinct experts hit x 3*N*K x bytes per weight + M*K*2 (bf16 in) + M*K*2 (bf16 out)
    flops  = 2 * M * topk * 3 * N * K
    floor  = max(bytes / copy bandwidth, flops / matmul rate)   (fp8: the fp8 matmul rate)
with both ceilings measured at the start of the same run (a 2 GiB device-to-device copy counting read
and write; an 8192^3 bf16 matmul; an 8192^3 fp8 torch._scaled_mm). Results are "fraction of floor"
= floor / measured (1.0 = at the limit).

Timing (do_bench style): warm-up, a time estimate, then repetitions each preceded by an L2 flush and
bracketed by CUDA events; the median. Where one forward's data fits in L2 (tiny batches), each
repetition rotates over several input sets (own tokens and routing), and the CUDA graph holds one
forward per set (time divided by the sets). Phases: the modular kernel's record_function ranges
(prepare / experts / finalize) each run alone through the public PF / experts interfaces and timed
(as its own CUDA graph on a GPU).

Writes OUT/benchmark_moe.csv (one row per cell), OUT/ceilings.json and OUT/benchmark_moe.png
(fraction of floor vs M per shape; needs matplotlib). Prints the table last. --resume keeps the cells OUT's CSV
already holds (those that did not fail) and measures the rest, so a run cut by a time limit goes on in a later
process, on another machine of the same kind: the ceilings are measured again, each row keeps the floor of its
own process ("call" column), and ceilings.json lists every call's ceilings and device.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import statistics
import sys
import time
import warnings
from typing import Optional

import torch

from moe_modular.quant import QuantConfig
from tools.bench_common import (
    BENCH_MS,
    DEFAULT_SHAPES,
    QUANTS,
    SHAPES,
    SMOKE_MS,
    SMOKE_SHAPES,
    InputSet,
    Shape,
    Timer,
    Weights,
    capture_graph,
    floor_of,
    log,
    make_inputs,
    make_weights,
    measure_ceilings,
    n_sets_for,
    read_csv,
    resolve_shapes_and_quants,
    spot_check,
    write_csv,
)


# name -> "module:Class"; imported on use so one missing class does not stop the others.
EXPERTS: dict[str, str] = {
    "triton": "moe_modular.experts.triton_experts:TritonExperts",
    "grouped_mm": "moe_modular.experts.grouped_mm_experts:GroupedMMExperts",
    "triton-separate-act": "moe_modular.experts.triton_experts:TritonExperts",
}
# Constructor keywords of an EXPERTS entry beyond (moe, quant params); Triton entries also get --tile-dir.
EXPERT_KWARGS: dict[str, dict] = {"triton-separate-act": {"fuse_activation": False}}
DEFAULT_EXPERTS = ["triton", "grouped_mm"]

# vLLM's Triton fused_moe, fraction of floor on one H200, bf16, eager (BENCHMARKS.md).
VLLM_FRACTION: dict[str, list[float]] = {
    "mixtral": [0.83, 1.00, 0.99, 0.90, 0.61, 0.76, 0.81],
    "qwen3": [0.15, 0.77, 0.91, 0.85, 0.74, 0.50, 0.60],
    "deepseek-v3": [0.86, 1.03, 1.08, 1.04, 0.95, 0.63, 0.72],
}

# The ceilings of the run those fractions come from (BENCHMARKS.md): copy bytes/s, bf16 flop/s. With
# them a fraction turns back into vLLM's time for the same bytes and flops, comparable across runs.
VLLM_RUN_CEILINGS = {"copy_Bps": 4.24e12, "bf16_flops": 701e12}


CSV_FIELDS = ["quant", "shape", "E", "K", "N", "topk", "M", "experts", "status", "n_sets", "distinct_experts",
              "floor_bytes", "floor_flops", "floor_us", "bound", "eager_us", "graph_us", "frac_eager", "frac_graph",
              "prepare_us", "experts_us", "finalize_us", "check_rel_err", "vllm_frac", "yardstick_us",
              "yardstick_scaling", "call"]


# ---- timing --------------------------------------------------------------------------------


# ---- problem -------------------------------------------------------------------------------


# ---- one cell ------------------------------------------------------------------------------

def load_experts(name: str):
    module, cls = EXPERTS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def experts_runnable(cls, device: torch.device) -> tuple[bool, str]:
    """Whether cls can run on this device at all (the Triton classes need CUDA or the interpreter)."""
    if device.type == "cuda" or "triton" not in cls.__module__:
        return True, ""
    try:
        from moe_modular.experts.triton_common import check_device

        check_device(torch.empty(0))
    except RuntimeError as exc:
        return False, str(exc)
    return True, ""


def phase_times_us(pf, fe, weights: Weights, inp: InputSet, timer: Timer) -> dict[str, float]:
    """Time of each phase of one forward, run alone through the public interfaces: prepare
    (quantize), the experts' apply, finalize (weight, reduce, copy out). On a GPU each phase is
    replayed from its own CUDA graph (device time without launch gaps); eager on the CPU."""
    from moe_modular.config import Activation

    shape_M, K = inp.x.shape
    E, N2 = weights.w1.size(0), weights.w1.size(1)
    topk = inp.topk_ids.size(1)
    qp = fe.quant
    prepared = pf.prepare(inp.x, inp.topk_weights, inp.topk_ids, E, None, False, qp)
    ws13_shape, ws2_shape, out_shape, ws_dtype = fe.workspace_shapes(shape_M, N2, K, topk, E, E,
                                                                     prepared.expert_tokens_meta)
    dev = inp.x.device
    ws13 = torch.empty(ws13_shape, dtype=ws_dtype, device=dev)
    ws2 = torch.empty(ws2_shape, dtype=ws_dtype, device=dev)
    fused = torch.empty(out_shape, dtype=inp.x.dtype, device=dev)
    out = torch.empty_like(inp.x)
    reduce_impl = fe.finalize_weight_and_reduce_impl()
    phases = {
        "prepare": lambda: pf.prepare(inp.x, inp.topk_weights, inp.topk_ids, E, None, False, qp),
        "experts": lambda: fe.apply(fused, prepared.a1q, weights.w1, weights.w2, inp.topk_weights, inp.topk_ids,
                                    Activation.SILU, E, None, prepared.a1q_scale, qp.a2_scale, ws13, ws2,
                                    prepared.expert_tokens_meta, False),
        "finalize": lambda: pf.finalize(out, fused, inp.topk_weights, inp.topk_ids, False, reduce_impl,
                                        prepared.handle),
    }
    times = {}
    for name, fn in phases.items():
        if timer.cuda:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                graph = capture_graph([fn], timer.device)
            if any("graph is empty" in str(w.message).lower() for w in caught):
                times[name] = 0.0  # the phase launches no device work (e.g. prepare without quantization)
            else:
                times[name] = timer.median_s(graph.replay) * 1e6
            del graph
        else:
            times[name] = timer.median_s(fn) * 1e6
    return times


def run_cell(name: str, shape_key: str, shape: Shape, quant_key: str, qc: QuantConfig, M: int, weights: Weights,
             sets: list[InputSet], ceil: dict, timer: Timer, args, tile_table) -> dict:
    from moe_modular.config import MoEConfig
    from moe_modular.modular_kernel import FusedMoEModularKernel
    from moe_modular.prepare_finalize.no_ep import MoEPrepareAndFinalizeNoEP

    floor = [floor_of(shape, qc, M, s.distinct, ceil) for s in sets]
    row = {"quant": quant_key, "shape": shape_key, "E": shape.E, "K": shape.K, "N": shape.N, "topk": shape.topk,
           "M": M, "experts": name, "n_sets": len(sets),
           "distinct_experts": statistics.mean(s.distinct for s in sets),
           "floor_bytes": statistics.mean(f[0] for f in floor), "floor_flops": floor[0][1],
           "floor_us": statistics.mean(f[2] for f in floor) * 1e6, "bound": floor[0][3]}
    mi = BENCH_MS.index(M) if M in BENCH_MS else -1
    if quant_key == "bf16" and shape_key in VLLM_FRACTION and mi >= 0:
        row["vllm_frac"] = VLLM_FRACTION[shape_key][mi]
    try:
        cls = load_experts(name)
    except (ImportError, AttributeError) as exc:
        row["status"] = f"unavailable: {exc}"
        return row
    moe = MoEConfig(num_experts=shape.E, topk=shape.topk, hidden_dim=shape.K, intermediate_dim=shape.N,
                    dtype=torch.bfloat16, quant=qc, max_num_tokens=max(M, 1))
    ok, reason = cls.supports(moe)
    if ok:
        ok, reason = experts_runnable(cls, timer.device)
    if not ok:
        row["status"] = f"unsupported: {reason}"
        return row
    status = []
    try:
        pf = MoEPrepareAndFinalizeNoEP.make(moe)
        kwargs = dict(EXPERT_KWARGS.get(name, {}))
        if tile_table is not None and name.startswith("triton"):
            kwargs["tile_table"] = tile_table
        fe = cls(moe, weights.qp, max_num_tokens=pf.max_num_tokens_per_rank(), num_dispatchers=pf.num_dispatchers(),
                 **kwargs)
        mk = FusedMoEModularKernel(pf, fe)
        outs = [torch.empty_like(s.x) for s in sets]
        fns = [(lambda s=s, o=o: mk(s.x, weights.w1, weights.w2, s.topk_weights, s.topk_ids, output=o))
               for s, o in zip(sets, outs)]
        fns[0]()
        timer.sync()
        err = row["check_rel_err"] = spot_check(shape, qc, weights, sets[0], outs[0])
        if err > args.check_tol or not math.isfinite(outs[0].float().sum().item()):  # NaN err: not checked
            status.append(f"CHECK FAILED (rel err {err:.3g})")
        turn = [0]

        def eager():
            fns[turn[0] % len(fns)]()
            turn[0] += 1

        row["eager_us"] = timer.median_s(eager) * 1e6
        row["frac_eager"] = row["floor_us"] / row["eager_us"]
    except Exception as exc:  # noqa: BLE001 - one failing cell is recorded, the run goes on
        row["status"] = f"error: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
        return row
    if timer.cuda and args.graph:
        try:
            graph = capture_graph(fns, timer.device)
            row["graph_us"] = timer.median_s(graph.replay, per_call=len(fns)) * 1e6
            row["frac_graph"] = row["floor_us"] / row["graph_us"]
            del graph
        except Exception as exc:  # noqa: BLE001 - recorded in the row's status
            status.append(f"graph failed: {str(exc).splitlines()[0][:160]}")
    if args.phases:
        try:
            ph = phase_times_us(pf, fe, weights, sets[0], timer)
            row.update({f"{k}_us": v for k, v in ph.items()})
        except Exception as exc:  # noqa: BLE001 - recorded in the row's status
            status.append(f"phases not measured: {str(exc).splitlines()[0][:120]}")
    row["status"] = "; ".join(status) or "ok"
    return row


# ---- output --------------------------------------------------------------------------------

def _fmt(v, spec=".2f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def geomean(values: list[float]) -> float:
    vals = [v for v in values if v is not None and v > 0 and not math.isnan(v)]
    return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else float("nan")


def vllm_us(row: dict) -> Optional[float]:
    """vLLM's time for this cell's bytes and flops, from its BENCHMARKS.md fraction and the
    ceilings of that run (None without a reference figure)."""
    frac = row.get("vllm_frac")
    if frac in (None, ""):
        return None
    floor = max(float(row["floor_bytes"]) / VLLM_RUN_CEILINGS["copy_Bps"],
                float(row["floor_flops"]) / VLLM_RUN_CEILINGS["bf16_flops"])
    return floor / float(frac) * 1e6


def best_us(row: dict) -> Optional[float]:
    times = [row.get(k) for k in ("eager_us", "graph_us") if row.get(k) not in (None, "")]
    return min(float(t) for t in times) if times else None


def table_text(rows: list[dict], ceil: dict, Ms: list[int]) -> str:
    """Markdown tables of fraction of floor (and times), one per quant scheme."""
    lines = [f"ceilings: copy {ceil['copy_Bps'] / 1e12:.2f} TB/s, bf16 matmul {ceil['bf16_flops'] / 1e12:.0f} TFLOP/s, "
             f"fp8 matmul {ceil['fp8_flops'] / 1e12:.0f} TFLOP/s"]
    for i, c in enumerate(ceil.get("calls", [])[1:], start=1):  # resumed runs: each later process's own ceilings
        lines.append(f"call {i} ({c['device']}, {c['date']}): copy {c['copy_Bps'] / 1e12:.2f} TB/s, bf16 matmul "
                     f"{c['bf16_flops'] / 1e12:.0f} TFLOP/s, fp8 matmul {c['fp8_flops'] / 1e12:.0f} TFLOP/s")
    for quant in dict.fromkeys(r["quant"] for r in rows):
        q_rows = [r for r in rows if r["quant"] == quant]
        lines += ["", f"### {quant}: fraction of floor (floor / measured; eager | CUDA graph)", "",
                  "| shape | experts | " + " | ".join(f"M={m}" for m in Ms) + " |",
                  "|---|---|" + "---|" * len(Ms)]
        for shape in dict.fromkeys(r["shape"] for r in q_rows):
            s_rows = [r for r in q_rows if r["shape"] == shape]
            for name in dict.fromkeys(r["experts"] for r in s_rows):
                cells = []
                for m in Ms:
                    r = next((r for r in s_rows if r["experts"] == name and r["M"] == m), None)
                    if r is None:
                        cells.append("")
                    elif r.get("eager_us") is None:
                        cells.append("n/a")
                    else:
                        cells.append(f"{_fmt(r.get('frac_eager'))} \\| {_fmt(r.get('frac_graph'))}")
                lines.append(f"| {shape} | {name} | " + " | ".join(cells) + " |")
            vllm = [next((r.get("vllm_frac") for r in s_rows if r["M"] == m), None) for m in Ms]
            if any(v is not None for v in vllm):
                lines.append(f"| {shape} | vLLM (BENCHMARKS.md) | " + " | ".join(_fmt(v) for v in vllm) + " |")
        lines += ["", f"### {quant}: time in us (eager | graph) and floor", "",
                  "| shape | M | floor us | bound | " + " | ".join(dict.fromkeys(r["experts"] for r in q_rows))
                  + " |", "|---|---|---|---|" + "---|" * len(dict.fromkeys(r["experts"] for r in q_rows))]
        names = list(dict.fromkeys(r["experts"] for r in q_rows))
        for shape in dict.fromkeys(r["shape"] for r in q_rows):
            for m in Ms:
                rs = [r for r in q_rows if r["shape"] == shape and r["M"] == m]
                if not rs:
                    continue
                cells = []
                for name in names:
                    r = next((r for r in rs if r["experts"] == name), None)
                    cells.append("n/a" if r is None or r.get("eager_us") is None else
                                 f"{_fmt(r.get('eager_us'), '.1f')} \\| {_fmt(r.get('graph_us'), '.1f')}")
                lines.append(f"| {shape} | {m} | {_fmt(rs[0]['floor_us'], '.1f')} | {rs[0]['bound']} | "
                             + " | ".join(cells) + " |")
        if any(r.get("vllm_frac") not in (None, "") for r in q_rows):
            lines += ["", f"### {quant}: vLLM's time / ours (best of eager and graph; > 1: faster than vLLM)", "",
                      "vLLM's time is its BENCHMARKS.md fraction turned back into microseconds with that run's "
                      f"ceilings ({VLLM_RUN_CEILINGS['copy_Bps'] / 1e12:.2f} TB/s, "
                      f"{VLLM_RUN_CEILINGS['bf16_flops'] / 1e12:.0f} TFLOP/s) and this run's bytes and flops.", "",
                      "| shape | experts | " + " | ".join(f"M={m}" for m in Ms) + " |", "|---|---|" + "---|" * len(Ms)]
            for shape in dict.fromkeys(r["shape"] for r in q_rows):
                for name in names:
                    cells = []
                    for m in Ms:
                        r = next((r for r in q_rows if r["shape"] == shape and r["experts"] == name and r["M"] == m),
                                 None)
                        v, b = (vllm_us(r), best_us(r)) if r is not None else (None, None)
                        cells.append(_fmt(v / b) if v and b else "")
                    lines.append(f"| {shape} | {name} | " + " | ".join(cells) + " |")
        lines += yardstick_lines(quant, q_rows, names, ceil)
        lines += bf16_ratio_lines(quant, rows, names, Ms)
        lines += [""]
        for name in names:
            nr = [r for r in q_rows if r["experts"] == name]
            ge, gg = geomean([r.get("frac_eager") for r in nr]), geomean([r.get("frac_graph") for r in nr])
            gb = geomean([r["floor_us"] / best_us(r) for r in nr if best_us(r)])
            n_cells = sum(1 for r in nr if r.get("eager_us") is not None)
            beat = [r for r in nr if r.get("vllm_frac") is not None and best_us(r)]
            frac_ok = sum(1 for r in beat if r["floor_us"] / best_us(r) >= r["vllm_frac"])
            time_ok = sum(1 for r in beat if vllm_us(r) >= best_us(r))
            extra = (f"; cells at or above vLLM: {frac_ok}/{len(beat)} by fraction of floor, {time_ok}/{len(beat)} "
                     f"by time" if beat else "")
            lines.append(f"- {quant} {name}: geometric mean of the fraction of floor over {n_cells} cells: eager "
                         f"{_fmt(ge)}, graph {_fmt(gg)}, best of both {_fmt(gb)}{extra}")
        problems: dict[tuple[str, str], list[str]] = {}
        for r in q_rows:
            if r.get("status") not in ("ok", None, ""):
                problems.setdefault((r["experts"], r["status"]), []).append(f"{r['shape']} M={r['M']}")
        for (name, status), cells in problems.items():
            where = "every cell" if len(cells) == len([r for r in q_rows if r["experts"] == name]) else ", ".join(cells)
            lines.append(f"- {quant} {name} ({where}): {status}")
    return "\n".join(lines)


def yardstick_lines(quant: str, q_rows: list[dict], names: list[str], ceil: dict) -> list[str]:
    """The fp8 yardstick table: per cell with a yardstick, the useful TFLOP/s of each experts class and of the
    dense fp8 GEMMs with the same work (tools/fp8_yardstick.py), and yardstick time / ours (1.0: as fast)."""
    cells = [r for r in q_rows if r.get("yardstick_us") not in (None, "")]
    if not cells:
        return []
    scalings = sorted({str(r.get("yardstick_scaling")) for r in cells})
    fp8_rate = float(ceil.get("fp8_flops") or 0)
    lines = ["", f"### {quant}: against the yardstick (dense fp8 GEMMs with the cell's useful flops, same run)", "",
             f"Yardstick scaling: {'; '.join(scalings)}. TFLOP/s count useful work (2 * M * k * 3 * N * K); "
             f"'of fp8 rate' divides by the {fp8_rate / 1e12:.0f} TFLOP/s dense fp8 matmul of this run.", "",
             "| shape | M | yardstick us | yardstick TFLOP/s | " + " | ".join(
                 f"{n} TFLOP/s (of fp8 rate) | yardstick / {n}" for n in names) + " |",
             "|---|---|---|---|" + "---|---|" * len(names)]
    for key in dict.fromkeys((r["shape"], r["M"]) for r in cells):
        rs = [r for r in cells if (r["shape"], r["M"]) == key]
        y = float(rs[0]["yardstick_us"])
        flops = float(rs[0]["floor_flops"])
        out = []
        for n in names:
            r = next((r for r in rs if r["experts"] == n), None)
            b = best_us(r) if r is not None else None
            rate = flops / (b * 1e-6) if b else None
            out.append(f"{_fmt(rate / 1e12 if rate else None, '.0f')} ({_fmt(rate / fp8_rate if rate and fp8_rate else None)})"
                       f" | {_fmt(y / b if b else None)}")
        lines.append(f"| {key[0]} | {key[1]} | {y:.1f} | {flops / (y * 1e-6) / 1e12:.0f} | " + " | ".join(out) + " |")
    return lines


def bf16_ratio_lines(quant: str, rows: list[dict], names: list[str], Ms: list[int]) -> list[str]:
    """For an fp8 scheme with bf16 cells in the same run: bf16 time / this scheme's time per cell (best of eager
    and graph; > 1: the fp8 cell is faster)."""
    if quant == "bf16" or not any(r["quant"] == "bf16" for r in rows):
        return []
    lines = ["", f"### {quant}: bf16 time / {quant} time, same run (> 1: fp8 faster)", "",
             "| shape | experts | " + " | ".join(f"M={m}" for m in Ms) + " |", "|---|---|" + "---|" * len(Ms)]
    for shape in dict.fromkeys(r["shape"] for r in rows if r["quant"] == quant):
        for name in names:
            cells = []
            for m in Ms:
                pick = {q: next((r for r in rows if (r["quant"], r["shape"], r["experts"], r["M"]) == (q, shape, name, m)),
                                None) for q in ("bf16", quant)}
                times = {q: best_us(r) if r is not None else None for q, r in pick.items()}
                cells.append(_fmt(times["bf16"] / times[quant]) if times["bf16"] and times[quant] else "")
            lines.append(f"| {shape} | {name} | " + " | ".join(cells) + " |")
    return lines


def report(out_dir: str, rows: list[dict], ceil: dict, Ms: list[int]) -> str:
    """Write OUT/benchmark_moe.md and the plots; return the table text."""
    note = plot(os.path.join(out_dir, "benchmark_moe.png"), rows, Ms)
    if note:
        log(note)
    text = table_text(rows, ceil, Ms)
    with open(os.path.join(out_dir, "benchmark_moe.md"), "w") as f:
        f.write(f"command: {ceil['command']}\n\ntorch {ceil['torch']}, triton {ceil['triton']}, {ceil['device']}, "
                f"{ceil['date']}\n\n{text}\n")
    return text


def plot(path: str, rows: list[dict], Ms: list[int]) -> Optional[str]:
    """Fraction of floor vs M, one panel per shape, one figure per quant scheme. Returns a note
    when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed; no plot written"
    for quant in dict.fromkeys(r["quant"] for r in rows):
        q_rows = [r for r in rows if r["quant"] == quant]
        shapes = list(dict.fromkeys(r["shape"] for r in q_rows))
        fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
        for ax, shape in zip(axes[0], shapes):
            s_rows = [r for r in q_rows if r["shape"] == shape]
            for name in dict.fromkeys(r["experts"] for r in s_rows):
                for mode, style in (("eager", "-o"), ("graph", "--s")):
                    pts = [(r["M"], r.get(f"frac_{mode}")) for r in s_rows if r["experts"] == name]
                    pts = [(m, v) for m, v in pts if v is not None and not math.isnan(v)]
                    if pts:
                        ax.plot(*zip(*pts), style, label=f"{name} {mode}")
            vllm = [(r["M"], r["vllm_frac"]) for r in s_rows if r.get("vllm_frac") is not None]
            if vllm:
                vllm = sorted(dict(vllm).items())
                ax.plot(*zip(*vllm), ":k^", label="vLLM (BENCHMARKS.md)")
            ax.set_xscale("log", base=2)
            ax.set_xticks(Ms)
            ax.set_xticklabels([str(m) for m in Ms], fontsize=7)
            ax.axhline(1.0, color="grey", lw=0.5)
            ax.set_ylim(0, 1.3)
            ax.set_title(f"{shape} ({quant})")
            ax.set_xlabel("M (tokens)")
            ax.set_ylabel("fraction of floor")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(plot_path(path, quant), dpi=110)
        plt.close(fig)
    return None


def plot_path(path: str, quant: str) -> str:
    """benchmark_moe.png for bf16, benchmark_moe_<quant>.png for the others."""
    return path if quant == "bf16" else path.replace(".png", f"_{quant}.png")


# ---- main ----------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", help=f"subset of {list(SHAPES)} (default {DEFAULT_SHAPES}; smoke: {list(SMOKE_SHAPES)})")
    p.add_argument("-m", "--m", dest="ms", type=int, nargs="+", help=f"token counts (default {BENCH_MS})")
    p.add_argument("--quant", nargs="+", default=["bf16"], help=f"schemes, of {list(QUANTS)}")
    p.add_argument("--experts", nargs="+", default=DEFAULT_EXPERTS,
                   help=f"of {list(EXPERTS)} (triton-separate-act: TritonExperts with the activation in its own "
                        f"kernel, not the first GEMM's epilogue; default {DEFAULT_EXPERTS})")
    p.add_argument("--out", help="directory for the CSV, JSON and PNG (default benchmark_out)")
    p.add_argument("--render", metavar="DIR", help="only redo the tables and plots of the run in DIR")
    p.add_argument("--rep-ms", type=float, default=100.0, help="time budget of one measurement")
    p.add_argument("--no-graph", dest="graph", action="store_false", help="skip the CUDA graph timing")
    p.add_argument("--no-phases", dest="phases", action="store_false", help="skip the per-phase timing")
    p.add_argument("--no-yardstick", dest="yardstick", action="store_false",
                   help="skip the fp8 cells' yardstick (dense fp8 GEMMs with the cell's flops; tools/fp8_yardstick.py)")
    p.add_argument("--tile-dir", help="read TritonExperts tile tables from this directory (default: packaged)")
    p.add_argument("--check-tol", type=float, default=0.05, help="largest relative error of the spot check")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny shapes and ceilings on the CPU (a code-path check)")
    p.add_argument("--resume", action="store_true",
                   help="keep the cells OUT's CSV holds (not failed) and measure only the others")
    args = p.parse_args(argv)
    args.out_given = args.out is not None
    args.out = args.out or "benchmark_out"
    if args.resume and not os.path.exists(os.path.join(args.out, "benchmark_moe.csv")):
        p.error(f"--resume needs a run to go on with: {os.path.join(args.out, 'benchmark_moe.csv')} does not exist")
    shapes = resolve_shapes_and_quants(p, args)
    for e in args.experts:
        if e not in EXPERTS:
            p.error(f"--experts ({e!r}) must be one of {list(EXPERTS)}")
    args.ms = args.ms or (SMOKE_MS if args.smoke else BENCH_MS)
    if args.smoke:
        args.rep_ms = min(args.rep_ms, 5.0)
    return args, shapes


def cell_key(row: dict) -> tuple:
    return row["shape"], row["quant"], int(row["M"]), row["experts"]


def _failed(row: dict) -> bool:
    status = str(row.get("status", ""))
    return status.startswith("error") or "FAILED" in status


def resumed(args, ceil: dict) -> tuple[list[dict], dict]:
    """(rows kept, ceilings to write): with --resume, the earlier run's rows that did not fail and its ceilings
    with this call's appended to "calls"; else no rows and this call's ceilings as the only call."""
    call = {k: ceil[k] for k in ("device", "date", "copy_Bps", "bf16_flops", "fp8_flops", "torch", "triton",
                                 "command")}
    if not args.resume:
        return [], {**ceil, "calls": [call]}
    rows = [r for r in read_csv(os.path.join(args.out, "benchmark_moe.csv")) if not _failed(r)]
    with open(os.path.join(args.out, "ceilings.json")) as f:
        first = json.load(f)
    calls = first.get("calls") or [{k: first[k] for k in call}]
    log(f"resuming {args.out}: {len(rows)} cells kept from {len(calls)} earlier call(s)")
    return rows, {**first, "calls": calls + [call]}


def render(src: str, out_dir: str) -> int:
    """Tables and plots again from a finished run's CSV and ceilings.json (no measuring)."""
    rows = read_csv(os.path.join(src, "benchmark_moe.csv"))
    with open(os.path.join(src, "ceilings.json")) as f:
        ceil = json.load(f)
    os.makedirs(out_dir, exist_ok=True)
    print(report(out_dir, rows, ceil, sorted({r["M"] for r in rows})))
    return 0


def main(argv=None) -> int:
    args, shapes = parse_args(argv)
    if args.render:
        return render(args.render, args.out if args.out_given else args.render)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu":
        # Triton experts on the CPU run through the interpreter (chosen before a kernel module is imported).
        from moe_modular.testing.triton_interpreter import use_interpreter

        use_interpreter()
    os.makedirs(args.out, exist_ok=True)
    timer = Timer(device, args.rep_ms, min_reps=3 if args.smoke else 10)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log(f"torch {torch.__version__}, triton {triton_version}, device {dev_name}")
    ceil = measure_ceilings(timer, args.smoke)
    ceil.update({"torch": torch.__version__, "triton": triton_version, "device": dev_name,
                 "l2_bytes": timer.l2_bytes, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                 "command": "python -m tools.benchmark_moe " + " ".join(sys.argv[1:] if argv is None else argv)})
    log(f"ceilings: copy {ceil['copy_Bps'] / 1e12:.3f} TB/s, bf16 {ceil['bf16_flops'] / 1e12:.1f} TFLOP/s, "
        f"fp8 {ceil['fp8_flops'] / 1e12:.1f} TFLOP/s {ceil['fp8_note']}")
    rows, ceil = resumed(args, ceil)
    with open(os.path.join(args.out, "ceilings.json"), "w") as f:
        json.dump(ceil, f, indent=1)
    done = {cell_key(r) for r in rows}
    call = len(ceil["calls"]) - 1
    tile_table = None
    if args.tile_dir:
        from moe_modular.tile_config import TileConfigTable

        tile_table = TileConfigTable.load(args.tile_dir)
    csv_path = os.path.join(args.out, "benchmark_moe.csv")
    for shape_key in args.shapes:
        shape = shapes[shape_key]
        for quant_key in args.quant:
            qc = QUANTS[quant_key]
            if all((shape_key, quant_key, M, name) in done for M in args.ms for name in args.experts):
                log(f"{shape_key} {quant_key}: every cell kept from the run in {args.out}")
                continue
            t0 = time.perf_counter()
            weights = make_weights(shape, qc, device, args.seed)
            timer.sync()
            log(f"{shape_key} {quant_key}: weights {weights.w1.numel() * weights.w1.element_size() * 1.5 / 1e9:.2f} GB "
                f"in {time.perf_counter() - t0:.1f}s")
            for M in args.ms:
                if all((shape_key, quant_key, M, name) in done for name in args.experts):
                    continue
                sets = make_inputs(shape, M, n_sets_for(shape, qc, M, timer.l2_bytes), device, args.seed)
                yard = {}
                if qc.is_quantized and args.yardstick:
                    from tools.fp8_yardstick import yardstick_us

                    us, how = yardstick_us(M, shape.topk, shape.K, shape.N, qc.is_block, timer)
                    yard = {"yardstick_us": us, "yardstick_scaling": how}
                    log(f"  {shape_key:12s} {quant_key:10s} M={M:<6d} yardstick {_fmt(us, '.1f')} us ({how})")
                for name in args.experts:
                    if (shape_key, quant_key, M, name) in done:
                        continue
                    t0 = time.perf_counter()
                    row = run_cell(name, shape_key, shape, quant_key, qc, M, weights, sets, ceil, timer, args,
                                   tile_table)
                    row.update(yard, call=call)
                    rows.append(row)
                    log(f"  {shape_key:12s} {quant_key:10s} M={M:<6d} {name:11s} eager {_fmt(row.get('eager_us'), '.1f')} us "
                        f"graph {_fmt(row.get('graph_us'), '.1f')} us floor {_fmt(row.get('floor_us'), '.1f')} us "
                        f"frac {_fmt(row.get('frac_eager'))}|{_fmt(row.get('frac_graph'))} "
                        f"err {_fmt(row.get('check_rel_err'), '.1e')} [{row.get('status')}] "
                        f"({time.perf_counter() - t0:.1f}s)")
                    write_csv(csv_path, rows, CSV_FIELDS)  # keep what is done if a later cell dies
                del sets
            del weights
            if device.type == "cuda":
                torch.cuda.empty_cache()
    write_csv(csv_path, rows, CSV_FIELDS)
    print(report(args.out, rows, ceil, sorted({r["M"] for r in rows} | set(args.ms))))
    return 1 if any(_failed(r) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
