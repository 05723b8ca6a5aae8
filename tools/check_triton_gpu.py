"""Check the Triton experts on a GPU: correctness at real shapes, CUDA-graph capture, ceilings,
a small tile sweep over the BENCHMARKS.md shapes, and tuned tile tables for this device.

    python -m tools.check_triton_gpu --out OUT_DIR [--budget-s 420]
    python -m tools.check_triton_gpu --smoke          # tiny shapes on the CPU interpreter (code paths only)

Writes OUT_DIR/configs/*.yaml (one table per shape, bf16 unquantized, this device) and
OUT_DIR/triton_sweep.csv; prints a table last: per shape and M the best tiles' time under a CUDA
graph, the eager time, the floor (BENCHMARKS.md) and the fraction of floor.
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from dataclasses import replace

import torch

# vLLM's fraction of floor on one H200 (BENCHMARKS.md), for the last table.
VLLM_FRACTION = {
    "mixtral": [0.83, 1.00, 0.99, 0.90, 0.61, 0.76, 0.81],
    "qwen3": [0.15, 0.77, 0.91, 0.85, 0.74, 0.50, 0.60],
    "deepseek": [0.86, 1.03, 1.08, 1.04, 0.95, 0.63, 0.72],
}
BENCH_MS = [1, 8, 64, 256, 1024, 4096, 16384]
SHAPES = {  # name: (E, K, N, topk)
    "mixtral": (8, 4096, 14336, 2),
    "qwen3": (128, 2048, 768, 8),
    "deepseek": (256, 7168, 2048, 8),
}


def log(msg: str) -> None:
    print(msg, flush=True)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()


def make_problem(T, E, K, N, topk, dtype, qc, device, seed=0, static_scales=None):
    from moe_modular.quant import MoEQuantParams, quantize_weights

    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(T, K, generator=g).to(device=device, dtype=dtype)
    w1 = (torch.randn(E, 2 * N, K, generator=g) / K ** 0.5).to(device)
    w2 = (torch.randn(E, K, N, generator=g) / N ** 0.5).to(device)
    w1q, s1 = quantize_weights(w1, qc)
    w2q, s2 = quantize_weights(w2, qc)
    if not qc.is_quantized:
        w1q, w2q = w1q.to(dtype), w2q.to(dtype)
    a1s = a2s = None
    if qc.static_activation_scale:
        a1s = (x.float().abs().amax() / 448).reshape(1).to(device)
        a2s = torch.tensor([0.02], device=device)
    qp = MoEQuantParams(qc, s1, s2, a1s, a2s)
    logits = torch.randn(T, E, generator=g).to(device)
    tw, ti = torch.topk(logits.softmax(-1), topk)
    return x, w1q, w2q, tw.float(), ti.to(torch.int32), qp


def tolerance(dtype, qc) -> float:
    if qc.is_quantized:
        return torch.finfo(torch.float8_e4m3fn).eps / 4
    return {torch.float32: 1e-4}.get(dtype, 2 * torch.finfo(dtype).eps)


def check_correctness(device, smoke: bool) -> list[str]:
    from moe_modular.config import Activation, MoEConfig
    from moe_modular.experts.batched_triton_experts import BatchedTritonExperts
    from moe_modular.experts.triton_experts import TritonExperts
    from moe_modular.modular_kernel import FusedMoEModularKernel
    from moe_modular.prepare_finalize.batched import BatchedPrepareAndFinalize
    from moe_modular.prepare_finalize.no_ep import MoEPrepareAndFinalizeNoEP
    from moe_modular.quant import QuantConfig
    from moe_modular.reference import moe_torch

    E, K, N = (7, 200, 96) if smoke else (13, 1000, 352)  # prime E; K, N not multiples of the tiles
    schemes = [(torch.bfloat16, QuantConfig()), (torch.float16, QuantConfig()), (torch.float32, QuantConfig()),
               (torch.bfloat16, QuantConfig.fp8_per_tensor()), (torch.bfloat16, QuantConfig.fp8_per_tensor(True)),
               (torch.bfloat16, QuantConfig.fp8_per_token()), (torch.bfloat16, QuantConfig.fp8_block((128, 128)))]
    T_small, T_big = (1, 5) if smoke else (1, 300)
    silu = (Activation.SILU, 3, False, False)
    # (format, dtype, scheme, T, (activation, topk, expert_map, apply_router_weight_on_input))
    cases = [("standard", d, q, T, silu) for d, q in schemes for T in (T_small, T_big)]
    cases += [("standard", torch.bfloat16, QuantConfig(), T, (Activation.SWIGLU_OAI, 2, True, False))
              for T in (T_small, T_big)]
    cases += [("standard", torch.bfloat16, QuantConfig.fp8_block((128, 128)), T_big,
               (Activation.SWIGLU_OAI, 2, True, False))]
    cases += [("standard", torch.bfloat16, QuantConfig(), T, (Activation.GELU, 1, False, True))
              for T in (T_small, T_big)]
    cases += [("batched", d, q, T_big if not smoke else T_small, silu) for d, q in schemes]
    failures = []
    for fmt, dtype, qc, T, (act, topk, emap, on_input) in cases:
        moe = MoEConfig(num_experts=E, topk=topk, hidden_dim=K, intermediate_dim=N, dtype=dtype,
                        quant=qc, activation=act, max_num_tokens=T)
        x, w1, w2, tw, ti, qp = make_problem(T, E, K, N, topk, dtype, qc, device, seed=T)
        expert_map = None
        if emap:
            held = torch.arange(0, E, 2)
            expert_map = torch.full((E,), -1, dtype=torch.int32, device=device)
            expert_map[held] = torch.arange(held.numel(), dtype=torch.int32, device=device)
            w1, w2 = w1[held.to(device)], w2[held.to(device)]
            if qp.w1_scale is not None:
                qp = replace(qp, w1_scale=qp.w1_scale[held.to(device)],
                             w2_scale=qp.w2_scale[held.to(device)])
        if fmt == "standard":
            mk = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), TritonExperts(moe, qp))
        else:
            mk = FusedMoEModularKernel(BatchedPrepareAndFinalize.make(moe), BatchedTritonExperts(moe, qp))
        out = mk(x, w1, w2, tw, ti, activation=act, expert_map=expert_map,
                 global_num_experts=E, apply_router_weight_on_input=on_input)
        ref = moe_torch(x, w1, w2, tw, ti, act, qp, expert_map=expert_map,
                        apply_router_weight_on_input=on_input)
        err, tol = rel_err(out, ref), tolerance(dtype, qc)
        ok = err <= tol and bool(torch.isfinite(out).all())
        tag = (f"{fmt:8s} {str(dtype)[6:]:8s} {qc.name:18s} T={T:<4d} k={topk} {act.value:9s} "
               f"map={int(emap)} on_input={int(on_input)} err={err:.2e} tol={tol:.1e}")
        log(("ok   " if ok else "FAIL ") + tag)
        if not ok:
            failures.append(tag)
    return failures


def check_cuda_graph(device) -> list[str]:
    """Capture TritonExperts in a CUDA graph (fails on any host sync) and compare a replay on new
    inputs with an eager run."""
    from moe_modular.config import MoEConfig
    from moe_modular.experts.triton_experts import TritonExperts
    from moe_modular.modular_kernel import FusedMoEModularKernel
    from moe_modular.prepare_finalize.no_ep import MoEPrepareAndFinalizeNoEP
    from moe_modular.quant import QuantConfig

    failures = []
    for qc in (QuantConfig(), QuantConfig.fp8_block((128, 128)), QuantConfig.fp8_per_tensor()):
        E, K, N, topk, T = 16, 1024, 512, 4, 48
        moe = MoEConfig(num_experts=E, topk=topk, hidden_dim=K, intermediate_dim=N, quant=qc, max_num_tokens=T)
        x, w1, w2, tw, ti, qp = make_problem(T, E, K, N, topk, torch.bfloat16, qc, device, seed=1)
        mk = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), TritonExperts(moe, qp))
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                mk(x, w1, w2, tw, ti)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                static_out = mk(x, w1, w2, tw, ti)
        except Exception as exc:  # a host sync or allocation problem shows here
            failures.append(f"cuda graph capture {qc.name}: {exc}")
            log(f"FAIL cuda graph capture {qc.name}: {exc}")
            continue
        x2, _, _, tw2, ti2, _ = make_problem(T, E, K, N, topk, torch.bfloat16, qc, device, seed=2)
        x.copy_(x2), tw.copy_(tw2), ti.copy_(ti2)
        graph.replay()
        eager = mk(x, w1, w2, tw, ti)
        torch.cuda.synchronize()
        same = torch.equal(static_out, eager)
        log(f"{'ok  ' if same else 'FAIL'} cuda graph {qc.name}: replay on new inputs == eager: {same}")
        if not same:
            failures.append(f"cuda graph replay {qc.name} differs from eager")
    return failures


def measure_ceilings(device) -> tuple[float, float, float]:
    """(copy bytes/s counting read+write, bf16 matmul flop/s, fp8 matmul flop/s or 0)."""
    n = 2 * 1024 ** 3
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    t_copy = bench_eager(lambda: b.copy_(a), min_reps=5)
    a = b = None  # drop the references (closures above use these names)
    m = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t_mm = bench_eager(lambda: m @ m, min_reps=5)
    fp8_rate = 0.0
    try:
        m8 = m.to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        t8 = bench_eager(lambda: torch._scaled_mm(m8, m8.t(), one, one, out_dtype=torch.bfloat16), min_reps=5)
        fp8_rate = 2 * 8192 ** 3 / t8
    except Exception as exc:
        log(f"fp8 matmul rate not measured: {exc}")
    return 2 * n / t_copy, 2 * 8192 ** 3 / t_mm, fp8_rate


def bench_eager(fn, min_reps=3, target_s=0.05) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = max(time.perf_counter() - t0, 1e-6)
    reps = int(min(200, max(min_reps, target_s / est)))
    times = []
    for _ in range(3):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3 / reps)
    return statistics.median(times)


def bench_graph(fn, target_s=0.05) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    t = bench_eager(graph.replay, target_s=target_s)
    del graph
    return t


def candidates(per_expert: float, smoke: bool):
    from moe_modular.kernels.gemm_config import GemmTile

    if smoke:
        return [GemmTile(16, 64, 64, 1, 4, 1), GemmTile(32, 128, 128, 1, 4, 1)]
    if per_expert <= 2:
        return [GemmTile(16, 64, 256, 1, 4, 3), GemmTile(16, 64, 128, 1, 4, 4), GemmTile(16, 32, 256, 1, 4, 3),
                GemmTile(16, 128, 128, 1, 4, 3), GemmTile(16, 64, 512, 1, 4, 2), GemmTile(16, 128, 256, 1, 4, 2)]
    if per_expert <= 96:
        return [GemmTile(16, 128, 128, 1, 4, 3), GemmTile(32, 64, 128, 1, 4, 4), GemmTile(32, 128, 128, 1, 4, 3),
                GemmTile(64, 128, 64, 8, 4, 4), GemmTile(64, 128, 128, 8, 4, 3), GemmTile(64, 64, 128, 8, 4, 4),
                GemmTile(64, 256, 64, 8, 8, 3)]
    return [GemmTile(128, 256, 64, 8, 8, 3), GemmTile(128, 256, 64, 8, 8, 4), GemmTile(128, 128, 64, 8, 4, 4),
            GemmTile(256, 128, 64, 8, 8, 3), GemmTile(128, 128, 128, 8, 8, 3), GemmTile(64, 256, 64, 8, 4, 4),
            GemmTile(128, 256, 64, 16, 8, 3)]


def profile_eager(device) -> None:
    """Host cost of one eager forward (Qwen3 shape, M=1): time, then the top Python functions."""
    import cProfile
    import io
    import pstats

    from moe_modular.config import MoEConfig
    from moe_modular.experts.triton_experts import TritonExperts
    from moe_modular.modular_kernel import FusedMoEModularKernel
    from moe_modular.prepare_finalize.no_ep import MoEPrepareAndFinalizeNoEP
    from moe_modular.quant import MoEQuantParams

    E, K, N, topk = SHAPES["qwen3"]
    moe = MoEConfig(num_experts=E, topk=topk, hidden_dim=K, intermediate_dim=N, max_num_tokens=1)
    w1 = torch.randn(E, 2 * N, K, device=device, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, K, N, device=device, dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, K, device=device, dtype=torch.bfloat16)
    tw, ti = torch.topk(torch.randn(1, E, device=device).softmax(-1), topk)
    mk = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), TritonExperts(moe, MoEQuantParams()))
    fwd = lambda: mk(x, w1, w2, tw, ti.to(torch.int32))  # noqa: E731
    eager, graph = bench_eager(fwd), bench_graph(fwd)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        fwd()
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
    log(f"eager Qwen3 M=1: {eager * 1e6:.1f} us/forward, CUDA graph {graph * 1e6:.1f} us; profile of 50 forwards:")
    log("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[:4000])


def sweep(device, ceilings, budget_end: float, smoke: bool, out_dir: str):
    from moe_modular.config import MoEConfig
    from moe_modular.experts.triton_experts import TritonExperts
    from moe_modular.modular_kernel import FusedMoEModularKernel
    from moe_modular.prepare_finalize.no_ep import MoEPrepareAndFinalizeNoEP
    from moe_modular.quant import MoEQuantParams, QuantConfig
    from moe_modular.tile_config import TileConfig, TileConfigTable, default_tile_config, device_name
    from moe_modular.workspace import WorkspaceCache

    bw, mm_rate, _ = ceilings
    dev_name = device_name(device)
    shapes = {"tiny": (8, 256, 128, 2)} if smoke else SHAPES
    Ms = [1, 8] if smoke else BENCH_MS
    rows, tables = [], {}
    ws = WorkspaceCache()
    packaged = TileConfigTable.load()
    for name, (E, K, N, topk) in shapes.items():
        w1 = torch.randn(E, 2 * N, K, device=device, dtype=torch.bfloat16) * 0.02
        w2 = torch.randn(E, K, N, device=device, dtype=torch.bfloat16) * 0.02
        buckets = {}
        for mi, M in enumerate(Ms):
            if time.time() > budget_end:
                log(f"budget reached; skipping {name} M={M}")
                continue
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            tw, ti = torch.topk(torch.randn(M, E, device=device).softmax(-1), topk)
            ti = ti.to(torch.int32)
            moe = MoEConfig(num_experts=E, topk=topk, hidden_dim=K, intermediate_dim=N, max_num_tokens=M)
            hit = ti.unique().numel()
            nbytes = hit * 3 * N * K * 2 + 2 * M * K * 2
            flops = 2 * M * topk * 3 * N * K
            floor = max(nbytes / bw, flops / mm_rate)
            default = default_tile_config(M, E, N, K, topk, torch.bfloat16, QuantConfig(), dev_name)
            shipped = packaged.lookup(TileConfigTable.key_for(E, N, K, torch.bfloat16, QuantConfig(), dev_name), M)
            cands = [default.gemm1] + ([shipped.gemm1] if shipped is not None else [])
            cands += [c for c in candidates(M * topk / E, smoke) if c not in cands]
            results = []
            for tile in cands:
                if time.time() > budget_end:
                    break
                cfg = TileConfig(tile, tile)
                fe = TritonExperts(moe, MoEQuantParams(), tile_config=cfg)
                mk = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), fe, workspaces=ws)
                try:
                    t = (bench_graph if not smoke else bench_cpu)(lambda: mk(x, w1, w2, tw, ti))
                except Exception as exc:
                    log(f"  {name} M={M} {tile}: failed ({str(exc).splitlines()[0][:120]})")
                    continue
                results.append((t, tile))
                log(f"  {name} M={M:<6d} BM={tile.BLOCK_M:<3d} BN={tile.BLOCK_N:<3d} BK={tile.BLOCK_K:<3d} "
                    f"G={tile.GROUP_M} w={tile.num_warps} s={tile.num_stages}: {t * 1e6:9.1f} us "
                    f"frac={floor / t:.2f}")
            if not results:
                continue
            best_t, best = min(results, key=lambda r: r[0])
            default_t = next((t for t, c in results if c == default.gemm1), float("nan"))
            buckets[M] = TileConfig(best, best)
            fe = TritonExperts(moe, MoEQuantParams(), tile_config=buckets[M])
            mk = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), fe, workspaces=ws)
            eager_t = (bench_eager if not smoke else bench_cpu)(lambda: mk(x, w1, w2, tw, ti))
            vllm = VLLM_FRACTION.get(name, [float("nan")] * 7)[mi]
            rows.append(dict(shape=name, M=M, best=f"{best.BLOCK_M}x{best.BLOCK_N}x{best.BLOCK_K} g{best.GROUP_M} "
                             f"w{best.num_warps} s{best.num_stages}", graph_us=best_t * 1e6, eager_us=eager_t * 1e6,
                             default_us=default_t * 1e6, floor_us=floor * 1e6, fraction=floor / best_t,
                             default_fraction=floor / default_t, vllm_fraction=vllm))
        if buckets:
            key = TileConfigTable.key_for(E, N, K, torch.bfloat16, QuantConfig(), dev_name)
            tables[key] = buckets
        w1 = w2 = None  # drop the references (closures above use these names)
        ws.clear()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    os.makedirs(os.path.join(out_dir, "configs"), exist_ok=True)
    for key, buckets in tables.items():
        text = TileConfigTable.to_yaml(key, buckets, comment=(
            f"TritonExperts tiles measured by tools/check_triton_gpu.py (CUDA graph, NoEP PF), "
            f"torch {torch.__version__}"))
        with open(os.path.join(out_dir, "configs", TileConfigTable.file_name(key)), "w") as f:
            f.write(text)
    if rows:
        with open(os.path.join(out_dir, "triton_sweep.csv"), "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)
    return rows


def bench_cpu(fn, target_s=0.0) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def fp8_timing(device, ceilings, budget_end: float):
    """Default-tile times of the fp8 schemes on the DeepSeek shape (floor with 1-byte weights)."""
    from moe_modular.config import MoEConfig
    from moe_modular.experts.triton_experts import TritonExperts
    from moe_modular.modular_kernel import FusedMoEModularKernel
    from moe_modular.prepare_finalize.no_ep import MoEPrepareAndFinalizeNoEP
    from moe_modular.quant import MoEQuantParams, QuantConfig
    from moe_modular.workspace import WorkspaceCache

    bw, _, fp8_rate = ceilings
    E, K, N, topk = SHAPES["deepseek"]
    rows = []
    ws = WorkspaceCache()
    for qc in (QuantConfig.fp8_block((128, 128)), QuantConfig.fp8_per_token()):
        # Random fp8 weights and scales straight away (quantizing 22 GB of weights in float32 would
        # not fit); the timing does not depend on the values.
        w1q = (torch.randn(E, 2 * N, K, device=device, dtype=torch.bfloat16) * 0.02).to(torch.float8_e4m3fn)
        w2q = (torch.randn(E, K, N, device=device, dtype=torch.bfloat16) * 0.02).to(torch.float8_e4m3fn)
        if qc.is_block:
            s1 = torch.rand(E, -(-2 * N // 128), -(-K // 128), device=device) * 1e-3
            s2 = torch.rand(E, -(-K // 128), -(-N // 128), device=device) * 1e-3
        else:
            s1 = torch.rand(E, 2 * N, 1, device=device) * 1e-3
            s2 = torch.rand(E, K, 1, device=device) * 1e-3
        qp = MoEQuantParams(qc, s1, s2)
        for M in (1, 64, 1024, 16384):
            if time.time() > budget_end:
                break
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            tw, ti = torch.topk(torch.randn(M, E, device=device).softmax(-1), topk)
            ti = ti.to(torch.int32)
            moe = MoEConfig(num_experts=E, topk=topk, hidden_dim=K, intermediate_dim=N, quant=qc, max_num_tokens=M)
            mk = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), TritonExperts(moe, qp), workspaces=ws)
            try:
                t = bench_graph(lambda: mk(x, w1q, w2q, tw, ti))
            except Exception as exc:
                log(f"  fp8 {qc.name} M={M}: failed ({str(exc).splitlines()[0][:160]})")
                continue
            hit = ti.unique().numel()
            floor = max((hit * 3 * N * K + 2 * M * K * 2) / bw, 2 * M * topk * 3 * N * K / max(fp8_rate, 1.0))
            rows.append((qc.name, M, t * 1e6, floor * 1e6, floor / t))
            log(f"  deepseek {qc.name} M={M}: {t * 1e6:.1f} us floor {floor * 1e6:.1f} us frac={floor / t:.2f}")
        w1q = w2q = None  # drop the references (closures above use these names)
        ws.clear()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--budget-s", type=float, default=420.0, help="stop sweeping after this many seconds")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    p.add_argument("--skip-correctness", action="store_true")
    args = p.parse_args(argv)
    start = time.time()
    if args.smoke:
        from moe_modular.testing.triton_interpreter import use_interpreter

        use_interpreter()
        device = torch.device("cpu")
    else:
        device = torch.device("cuda")
    import triton

    log(f"torch {torch.__version__} triton {triton.__version__} device "
        f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")
    try:
        import yaml  # noqa: F401
        log("pyyaml: present")
    except ImportError:
        log("pyyaml: MISSING (tile tables cannot be read)")
    failures = [] if args.skip_correctness else check_correctness(device, args.smoke)
    if device.type == "cuda":
        failures += check_cuda_graph(device)
        ceilings = measure_ceilings(device)
        try:
            profile_eager(device)
        except Exception as exc:  # informational only
            log(f"eager profile failed: {exc}")
    else:
        ceilings = (4.24e12, 701e12, 1400e12)
    log(f"ceilings: copy {ceilings[0] / 1e12:.2f} TB/s, bf16 matmul {ceilings[1] / 1e12:.0f} TFLOP/s, "
        f"fp8 matmul {ceilings[2] / 1e12:.0f} TFLOP/s  [{time.time() - start:.0f}s]")
    budget_end = start + args.budget_s
    rows = sweep(device, ceilings, budget_end - (45 if device.type == "cuda" else 0), args.smoke, args.out)
    fp8_rows = fp8_timing(device, ceilings, budget_end) if device.type == "cuda" else []
    log(f"\n== correctness: {len(failures)} failure(s) ==")
    for f in failures:
        log("  " + f)
    log("\n== bf16 TritonExperts in FusedMoEModularKernel(NoEP), CUDA graph; fraction = floor / time ==")
    log(f"{'shape':9s} {'M':>6s} {'best tiles':22s} {'graph us':>9s} {'eager us':>9s} {'floor us':>9s} "
        f"{'frac':>5s} {'dflt':>5s} {'vLLM':>5s}")
    fracs = []
    for r in rows:
        fracs.append(r["fraction"])
        log(f"{r['shape']:9s} {r['M']:6d} {r['best']:22s} {r['graph_us']:9.1f} {r['eager_us']:9.1f} "
            f"{r['floor_us']:9.1f} {r['fraction']:5.2f} {r['default_fraction']:5.2f} {r['vllm_fraction']:5.2f}")
    if fracs:
        gm = statistics.geometric_mean(fracs)
        log(f"geometric mean fraction over {len(fracs)} cells: {gm:.2f} (vLLM reference 0.75)")
    for name, M, t, fl, fr in fp8_rows:
        log(f"fp8 deepseek {name:18s} M={M:6d} {t:9.1f} us floor {fl:9.1f} us frac {fr:.2f}")
    log(f"total {time.time() - start:.0f}s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
