"""Host time of one eager forward: where the microseconds between the caller and the GPU go.

    python -m tools.experiments.host_overhead --shapes qwen3 mixtral -m 1 8 64 1024
    python -m tools.experiments.host_overhead --shapes qwen3 -m 1 --cprofile 20      # plus the top functions
    python -m tools.experiments.host_overhead --launch triton direct                 # both launch paths, side by side
    python -m tools.experiments.host_overhead --smoke --out OUT                      # tiny shape, the CPU interpreter

Per cell, FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP, TritonExperts) with the shipped tiles, the inputs
of tools/benchmark_moe:
- host us: median wall time of one forward call (kernels are queued, not waited for, so this is the host's
  own work: the modular kernel's Python, torch ops and launches); the calls run back to back as in serving,
  the device drained (untimed) every SYNC_EVERY calls so the launch queue never fills;
- launches, launch us: Triton kernel launches per forward and the host time spent inside them (Triton's
  JITFunction.run: argument binding, specialization key, cache lookup, descriptor packing, driver launch);
  measured in a second pass with the launch entry point wrapped by a timer;
- other us: host us minus launch us;
- gpu us: the same forward replayed from a CUDA graph after an L2 flush (the device's time alone);
- eager us: tools/benchmark_moe's eager timing (CUDA events around the call after an L2 flush), where
  the host time shows through when it exceeds the device time.
--launch picks the launch path of moe_modular/kernels/launcher.py ("direct": compiled kernels launched
directly after their first launch; "triton": every launch through Triton's kernel[grid](...)); with
several, each cell is measured under each in turn, in one process.
"bare launch" (printed first) is the host time of launching a one-argument Triton kernel: the launcher's
own floor on this host. On the CPU (--smoke) kernels run in the interpreter inside the launch call, so
the times say nothing; the counts do. Writes OUT/host_overhead.csv; prints the table last.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch

from moe_modular.kernels.launcher import LAUNCH_MODES, launch_mode
from tools.bench_common import (
    QUANTS,
    capture_graph,
    make_inputs,
    make_weights,
    resolve_shapes_and_quants,
    spot_check,
    write_csv,
)
from tools.tune_moe import Trial, incumbent, trial_context

CSV_FIELDS = ("shape", "quant", "M", "launch", "host_us", "launches", "launch_us", "other_us", "gpu_us", "eager_us",
              "check_rel_err", "bare_launch_us")


class LaunchMeter:
    """Counts kernel launches and the host seconds spent in them while active: a context manager that wraps
    moe_modular's launch() where the kernel modules call it and the `run` entry point of Triton's JIT and
    interpreter kernel classes (for launches that do not go through launch()); a launch is counted once
    however deep it nests. Restored on exit."""

    def __init__(self) -> None:
        self.launches = 0
        self.seconds = 0.0
        self._depth = 0
        self._saved: list[tuple[object, str, object]] = []

    @staticmethod
    def _targets() -> list[tuple[object, str]]:
        from moe_modular.kernels import launcher
        from triton.runtime.jit import JITFunction

        targets: list[tuple[object, str]] = [(JITFunction, "run")]
        try:
            from triton.runtime.interpreter import InterpretedFunction

            targets.append((InterpretedFunction, "run"))
        except ImportError:  # pragma: no cover - every triton with an interpreter has it
            pass
        for name, mod in list(sys.modules.items()):
            if name.startswith("moe_modular.") and getattr(mod, "launch", None) is launcher.launch:
                targets.append((mod, "launch"))
        return targets

    def __enter__(self) -> "LaunchMeter":
        for owner, attr in self._targets():
            original = getattr(owner, attr) if not isinstance(owner, type) else owner.__dict__[attr]
            self._saved.append((owner, attr, original))
            setattr(owner, attr, self._timed(original))
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, original in reversed(self._saved):
            setattr(owner, attr, original)
        self._saved.clear()

    def _timed(self, original):
        meter = self

        def timed(*args, **kwargs):
            meter._depth += 1
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                meter._depth -= 1
                if meter._depth == 0:
                    meter.seconds += time.perf_counter() - t0
                    meter.launches += 1

        return timed


# Calls between two (untimed) device drains: few enough that their launches never fill the launch queue.
SYNC_EVERY = 16


def host_seconds(fn, reps: int, sync) -> list[float]:
    """Wall seconds of each of `reps` calls of fn, back to back, the device drained every SYNC_EVERY calls."""
    times = []
    sync()
    for i in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if i % SYNC_EVERY == SYNC_EVERY - 1:
            sync()
    sync()
    return times


def launch_share(fn, reps: int, sync) -> tuple[float, float]:
    """(launches per call, median launch seconds per call) of fn over `reps` calls."""
    counts, seconds = [], []
    with LaunchMeter() as meter:
        host_seconds(fn, 1, sync)  # the wrapper's first call
        for i in range(reps):
            n0, s0 = meter.launches, meter.seconds
            fn()
            counts.append(meter.launches - n0)
            seconds.append(meter.seconds - s0)
            if i % SYNC_EVERY == SYNC_EVERY - 1:
                sync()
    sync()
    if len(set(counts)) != 1:
        raise RuntimeError(f"launches per forward changed between calls: {sorted(set(counts))}")
    return counts[0], statistics.median(seconds)


def measure(forward, reps: int, timer) -> dict:
    """host_us, launches, launch_us, other_us and eager_us of `forward` (module docstring)."""
    forward()  # a first launch of each kernel in this launch mode
    timer.sync()
    host = statistics.median(host_seconds(forward, reps, timer.sync))
    launches, launch_s = launch_share(forward, reps, timer.sync)
    eager = timer.median_s(forward)
    return {"host_us": host * 1e6, "launches": launches, "launch_us": launch_s * 1e6,
            "other_us": (host - launch_s) * 1e6, "eager_us": eager * 1e6}


def bare_launch_seconds(device: torch.device, reps: int, sync) -> float:
    """Median host seconds of launching a one-argument Triton kernel on `device`."""
    import triton
    import triton.language as tl

    @triton.jit
    def _bump(x_ptr):
        tl.store(x_ptr, tl.load(x_ptr) + 1)

    x = torch.zeros(1, dtype=torch.int32, device=device)
    launch = _bump[(1,)]
    launch(x)
    sync()
    times = host_seconds(lambda: launch(x), reps, sync)
    if int(x.item()) != reps + 1:
        raise RuntimeError(f"bare launch ran {int(x.item())} times, expected {reps + 1}")
    return statistics.median(times)


def profile_text(fn, calls: int, top: int) -> str:
    """cProfile of `calls` calls of fn: the `top` functions by own time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", help="shapes of tools/benchmark_moe (default: all; smoke: tiny)")
    p.add_argument("-m", "--m", dest="ms", type=int, nargs="+", help="token counts (default 1 8 64 1024)")
    p.add_argument("--quant", nargs="+", default=["bf16"], help=f"of {list(QUANTS)}")
    p.add_argument("--reps", type=int, default=200, help="forward calls per measurement")
    p.add_argument("--launch", nargs="+", default=list(LAUNCH_MODES[:2]), choices=LAUNCH_MODES[:2],
                   help="launch paths to measure, each cell under each in turn (default both)")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="also print the N functions with the most own time per cell (cProfile)")
    p.add_argument("--rep-ms", type=float, default=20.0, help="time budget of the gpu / eager timings")
    p.add_argument("--out", default="host_overhead_out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny shape, the CPU interpreter (a code-path check)")
    args = p.parse_args(argv)
    shapes = resolve_shapes_and_quants(p, args, smoke_default=["tiny"])
    args.ms = args.ms or ([1, 8] if args.smoke else [1, 8, 64, 1024])
    if args.reps < 1:
        p.error(f"--reps ({args.reps}) must be >= 1")
    if args.smoke:
        args.reps, args.rep_ms = min(args.reps, 3), 1.0
    return args, shapes


def table(rows: list[dict]) -> str:
    head = "| shape | quant | M | launch | host us | launches | launch us | other us | gpu us | eager us |"
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['quant']} | {r['M']} | {r['launch']} | {r['host_us']:.1f} | {r['launches']} | "
                     f"{r['launch_us']:.1f} | {r['other_us']:.1f} | {r['gpu_us']:.1f} | {r['eager_us']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args, shapes = parse_args(argv)
    if args.smoke and not torch.cuda.is_available():
        from moe_modular.testing.triton_interpreter import use_interpreter

        use_interpreter()
    device, timer, shipped, dev_key = trial_context(args)
    bare_us = bare_launch_seconds(device, args.reps, timer.sync) * 1e6
    print(f"bare launch (one-argument Triton kernel): {bare_us:.1f} us", flush=True)
    rows, failed = [], False
    for quant_key in args.quant:
        qc = QUANTS[quant_key]
        for shape_key in args.shapes:
            shape = shapes[shape_key]
            weights = make_weights(shape, qc, device, args.seed)
            for M in args.ms:
                s = make_inputs(shape, M, 1, device, args.seed)[0]
                mk = Trial(shape, qc, M, weights, [s], timer).kernel(incumbent(shipped, shape, qc, M, dev_key))
                out = torch.full_like(s.x, float("nan"))

                def forward():
                    mk(s.x, weights.w1, weights.w2, s.topk_weights, s.topk_ids, output=out)

                forward()
                timer.sync()
                err = spot_check(shape, qc, weights, s, out)
                if not err <= 0.05:
                    print(f"{shape_key} {quant_key} M={M}: spot check failed, relative error {err:.2e}", flush=True)
                    failed = True
                if timer.cuda:
                    graph = capture_graph([forward], device)
                    gpu = timer.median_s(graph.replay)
                    del graph
                else:
                    gpu = float("nan")
                for mode in args.launch:
                    with launch_mode(mode):
                        row = measure(forward, args.reps, timer)
                    row.update({"shape": shape_key, "quant": quant_key, "M": M, "launch": mode, "gpu_us": gpu * 1e6,
                                "check_rel_err": err, "bare_launch_us": bare_us})
                    rows.append(row)
                    print(f"{shape_key} {quant_key} M={M} {mode}: host {row['host_us']:.1f} us, {row['launches']} "
                          f"launches {row['launch_us']:.1f} us, gpu {row['gpu_us']:.1f} us", file=sys.stderr, flush=True)
                    if args.cprofile:
                        print(f"--- cProfile, {shape_key} {quant_key} M={M} {mode}, {args.reps} forwards",
                              file=sys.stderr)
                        with launch_mode(mode):
                            print(profile_text(forward, args.reps, args.cprofile), file=sys.stderr, flush=True)
            weights = None  # drop the references (closures above use these names)
    os.makedirs(args.out, exist_ok=True)
    write_csv(os.path.join(args.out, "host_overhead.csv"), rows, CSV_FIELDS)
    print(table(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
