"""tools.profile_modular_kernel: Chrome traces per rank, M and topk, with the phases named; the
combinations CLI's flag errors; nothing overwritten; a missing directory created."""
from __future__ import annotations

import json
import random
import shlex

import pytest
import torch

from moe_modular.testing.cli import parse_request
from moe_modular.testing.runner import CaseResult
from tools.profile_modular_kernel import (
    CPU_RANGE_CATEGORY,
    GPU_RANGE_CATEGORY,
    KERNEL_CATEGORY,
    TRACE_METADATA_KEY,
    RankCase,
    format_kernels,
    kernel_times,
    load_trace,
    load_traces,
    main,
    phase_times,
)

# Ranges every forward has (the tool's `forward`, and the modular kernel's three phases).
KERNEL_PHASES = ("forward", "prepare", "experts", "finalize")

# Profiled runs: (flags, world size, Ms, topks). Each covers an edge:
PROFILE_CASES = [
    # one rank, no communication; M=1 (a single token) and M=5 (several tokens per expert)
    ("--pf-type MoEPrepareAndFinalizeNoEP --experts-type TorchExperts", 1, (1, 5), (2,)),
    # two ranks exchanging tokens (all_to_all inside prepare and finalize); topk=1 and topk=3
    ("--pf-type AllToAllPrepareAndFinalize --experts-type TorchExperts --world-size 2", 2, (3,), (1, 3)),
]


def _ranges(trace: dict, name: str) -> list[tuple[float, float]]:
    return [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in trace["traceEvents"]
            if e.get("ph") == "X" and e.get("cat") == CPU_RANGE_CATEGORY and e.get("name") == name]


def _inside(t: float, spans: list[tuple[float, float]]) -> bool:
    return any(a <= t <= b for a, b in spans)


@pytest.mark.parametrize("flags,world_size,Ms,topks", PROFILE_CASES, ids=["ws1-noep", "ws2-all_to_all"])
def test_profiler_writes_one_valid_trace_per_rank_m_topk(tmp_path, capsys, flags, world_size, Ms, topks):
    # A file with one of the run's names is never overwritten: the run moves all its files to
    # the first suffix free for every one of them.
    trace_dir = tmp_path / "traces"
    trace_dir.mkdir()
    taken = trace_dir / f"m{Ms[0]}_topk{topks[0]}_rank0.json"
    taken.write_text("not a trace")
    argv = shlex.split(flags) + ["-m", *map(str, Ms), "--topk", *map(str, topks), "-k", "64", "-n", "32",
                                 "--num-experts", "6", "--warmup", "1", "--torch-trace-dir-path", str(trace_dir)]

    assert main(argv) == 0
    out = capsys.readouterr().out
    assert taken.read_text() == "not a trace"

    pids = set()
    for M in Ms:
        for topk in topks:
            for rank in range(world_size):
                path = trace_dir / f"m{M}_topk{topk}_rank{rank}_1.json"
                assert path.is_file(), f"missing {path.name}; have {sorted(p.name for p in trace_dir.iterdir())}"
                trace = load_trace(str(path))  # valid JSON with a traceEvents list
                meta = trace[TRACE_METADATA_KEY]
                assert (meta["rank"], meta["world_size"], meta["M"], meta["topk"]) == (rank, world_size, M, topk)
                assert trace["distributedInfo"]["rank"] == rank
                events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
                ops = [e for e in events if e.get("cat") == "cpu_op"]
                assert ops, f"{path.name} has no operator events"
                pids.add(ops[0]["pid"])
                times = phase_times(trace)
                for phase in KERNEL_PHASES:
                    assert phase in times and times[phase].calls == 1, f"{path.name}: {phase} {times.get(phase)}"
                    assert times[phase].cpu_us > 0
                forward = _ranges(trace, "forward")
                for phase in ("prepare", "experts", "finalize"):
                    (start, end), = _ranges(trace, phase)
                    assert _inside(start, forward) and _inside(end, forward)
                # Recorded shapes: operators carry their input dims.
                assert any(e.get("args", {}).get("Input Dims") for e in ops)
                if world_size > 1:
                    # The dispatch and the combine are communication inside prepare and finalize.
                    comm = [e for e in ops if e["name"].startswith("c10d::")]
                    for phase in ("prepare", "finalize"):
                        spans = _ranges(trace, phase)
                        assert any(_inside(float(e["ts"]), spans) for e in comm), f"{path.name}: no collective in {phase}"
                    for phase, parent in (("dispatch", "prepare"), ("combine", "finalize")):
                        for start, end in _ranges(trace, phase):  # named by the EP PFs that emit them
                            assert _inside(start, _ranges(trace, parent))
    assert len(pids) == world_size, "each rank's trace comes from its own process"

    # The oracle lines and the per-phase table, one row per (M, topk, rank).
    assert out.count("PASS M=") == len(Ms) * len(topks) * world_size
    header = next(line for line in out.splitlines() if line.split()[:3] == ["M", "topk", "rank"])
    for phase in KERNEL_PHASES:
        assert phase in header.split()
    rows = [line.split() for line in out.splitlines() if len(line.split()) == len(header.split())
            and line.split()[0].isdigit()]
    assert sorted((int(r[0]), int(r[1]), int(r[2])) for r in rows) == sorted(
        (M, k, r) for M in Ms for k in topks for r in range(world_size))
    # the kernel lists come with GPU traces only
    assert ("GPU kernels of M=" in out) == torch.cuda.is_available()


def test_profiler_creates_a_missing_directory(tmp_path):
    trace_dir = tmp_path / "a" / "b"
    argv = ["--pf-type", "MoEPrepareAndFinalizeNoEP", "--experts-type", "TorchExperts", "-m", "2", "--topk", "1",
            "-k", "32", "-n", "16", "--num-experts", "4", "--warmup", "0", "--torch-trace-dir-path", str(trace_dir)]
    assert main(argv) == 0
    assert sorted(p.name for p in trace_dir.iterdir()) == ["m2_topk1_rank0.json"]
    with open(trace_dir / "m2_topk1_rank0.json") as f:
        assert json.load(f)["traceEvents"]


# Bad command lines: (argv, the error's text). Errors shared with the combinations CLI are
# compared with what its parse_request raises for the same flags.
SHARED_FLAG_ERRORS = [
    "--pf-type Nope --experts-type TorchExperts",  # unknown name: lists the registered ones
    "--pf-type MoEPrepareAndFinalizeNoEP",  # one of the pair
    "--pf-type MoEPrepareAndFinalizeNoEP --experts-type TorchExperts -m -1",  # negative M
    "--pf-type MoEPrepareAndFinalizeNoEP --experts-type TorchExperts --topk 0",  # topk below 1
    "--pf-type MoEPrepareAndFinalizeNoEP --experts-type TorchExperts --dtype int8",  # unknown dtype
    "--pf-type MoEPrepareAndFinalizeNoEP --experts-type TorchExperts --world-size 0",  # no ranks
    "--pf-type MoEPrepareAndFinalizeNoEP --experts-type TorchExperts --block-shape 128 128",  # block without fp8
]


@pytest.mark.parametrize("flags", SHARED_FLAG_ERRORS)
def test_bad_flags_get_the_combinations_cli_errors(tmp_path, capsys, flags):
    with pytest.raises(ValueError) as expected:
        parse_request(shlex.split(flags))
    assert main(shlex.split(flags) + ["--torch-trace-dir-path", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert f"error: {expected.value}" in err
    assert not (tmp_path / "t").exists(), "nothing is written for a bad command line"


OWN_FLAG_ERRORS = [
    ("--warmup -1", "--warmup (-1) must be >= 0"),  # negative warm-up
    ("--top-kernels -2", "--top-kernels (-2) must be >= 0"),  # a negative count of kernels to list
    ("", "--pf-type and --experts-type are required"),  # no pair: the profiler runs one
    ("--world-size 1 2", "--world-size ([1, 2]) takes one size for the profiler"),  # one launch, one size
]


@pytest.mark.parametrize("flags,message", OWN_FLAG_ERRORS)
def test_profiler_flag_errors(tmp_path, capsys, flags, message):
    pair = "" if "required" in message else "--pf-type MoEPrepareAndFinalizeNoEP --experts-type TorchExperts "
    assert main(shlex.split(pair + flags) + ["--torch-trace-dir-path", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_trace_dir_that_is_a_file_is_refused(tmp_path, capsys):
    path = tmp_path / "file"
    path.write_text("x")
    argv = ["--pf-type", "MoEPrepareAndFinalizeNoEP", "--experts-type", "TorchExperts", "--torch-trace-dir-path", str(path)]
    assert main(argv) == 2
    assert f"--torch-trace-dir-path ({str(path)!r}) exists and is not a directory" in capsys.readouterr().err


def test_unsupported_pair_exits_2_with_the_reason(tmp_path, capsys):
    argv = ["--pf-type", "MoEPrepareAndFinalizeNoEP", "--experts-type", "NaiveBatchedExperts", "--dtype", "bfloat16",
            "--torch-trace-dir-path", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "unsupported: MoEPrepareAndFinalizeNoEP x NaiveBatchedExperts" in err and "format mismatch" in err


def test_missing_trace_dir_flag_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--pf-type", "MoEPrepareAndFinalizeNoEP", "--experts-type", "TorchExperts"])
    assert exc.value.code == 2
    assert "--torch-trace-dir-path" in capsys.readouterr().err


def _event(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7}


def test_kernel_times_sum_the_kernels_inside_the_forward(tmp_path):
    # A trace as torch.profiler writes it on a GPU: kernels before the forward's GPU span (a warm-up's, a barrier's)
    # are left out; inside it each name's launches are summed, most time first.
    rng = random.Random()
    gemm = [rng.uniform(50.0, 90.0) for _ in range(2)]
    align, sum_ = rng.uniform(1.0, 5.0), rng.uniform(5.0, 9.0)
    long_name = "void cutlass::Kernel<" + "x" * 100 + ">"
    events = [_event(CPU_RANGE_CATEGORY, "forward", 0.0, 400.0), _event(GPU_RANGE_CATEGORY, "forward", 100.0, 300.0),
              _event(KERNEL_CATEGORY, "_moe_gemm_kernel", 10.0, 500.0),  # before the forward
              _event(KERNEL_CATEGORY, "_align_kernel", 100.0, align),
              _event(KERNEL_CATEGORY, "_moe_gemm_kernel", 110.0, gemm[0]),
              _event(KERNEL_CATEGORY, long_name, 200.0, 1.0),
              _event(KERNEL_CATEGORY, "_moe_gemm_kernel", 210.0, gemm[1]),
              _event(KERNEL_CATEGORY, "_moe_sum_kernel", 300.0, sum_),
              _event("cuda_runtime", "cudaLaunchKernel", 120.0, 3.0)]
    trace = {"traceEvents": events}
    got = kernel_times(trace)
    assert [(k.name, k.calls) for k in got] == [("_moe_gemm_kernel", 2), ("_moe_sum_kernel", 1),
                                                ("_align_kernel", 1), (long_name, 1)]
    assert got[0].gpu_us == pytest.approx(sum(gemm)) and got[2].gpu_us == pytest.approx(align)
    # without a GPU forward span, every kernel of the trace counts
    no_span = {"traceEvents": [e for e in events if e["cat"] != GPU_RANGE_CATEGORY]}
    assert kernel_times(no_span)[0].gpu_us == pytest.approx(500.0 + sum(gemm))

    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    case = RankCase(CaseResult(64, 8, 0, 0.0, 1e-2, torch.empty(0)), str(path))
    text = format_kernels(load_traces([case]), top=3, name_width=40).splitlines()
    total = sum(gemm) + align + sum_ + 1.0
    assert text[0] == f"GPU kernels of M=64 topk=8 rank=0: 4 kernels, {total / 1000:.3f} ms in all; the 3 longest:"
    rows = [line.split() for line in text[2:]]
    assert [r[3] for r in rows] == ["_moe_gemm_kernel", "_moe_sum_kernel", "_align_kernel"]
    assert float(rows[0][1].rstrip("%")) == pytest.approx(100 * sum(gemm) / total, abs=0.06)
    assert len(format_kernels(load_traces([case]), top=10, name_width=40).splitlines()[-1].split("  ")[-1]) == 40
    assert format_kernels(load_traces([case]), top=0) == ""
    cpu_only = tmp_path / "cpu.json"
    cpu_only.write_text(json.dumps({"traceEvents": events[:1]}))
    assert format_kernels(load_traces([RankCase(case.result, str(cpu_only))]), top=5) == ""
