"""Check the DeepEP and symmetric-memory EP backends on this machine's GPUs.

    python -m tools.check_ep_gpu [--world-size N] [--out DIR]

One GPU (always): what the environment offers (torch, NVSHMEM, deep_ep), the symmetric-memory
refusal of a single rank (supports(), make(), the manager), a real NVSHMEM allocation through the
shared buffer cache (reserve, aligned growth, release), and whatever DeepEP runs on one rank (its
low-latency mode on 1 rank, against the float32 oracle; the high-throughput refusal of 1 rank).
--world-size N (N GPUs): the SymmMem, DeepEP HT and DeepEP LL PrepareAndFinalize classes on N ranks
through the combinations-matrix runner, every case against the oracle.

Prints one line per check ("PASS", "FAIL", "REFUSED" or "SKIP" with the reason); with --out also
writes DIR/check_ep_gpu.txt. Exit status 1 when any check FAILs.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from typing import Callable

# NVLink multicast stays off (shared hosts); an explicit setting in the environment wins.
for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402


def log(msg: str, sink: list, echo: bool = True) -> None:
    sink.append(msg)
    if echo:
        print(msg, flush=True)


def _check(name: str, fn: Callable[[], str], sink: list, echo: bool = True) -> bool:
    """Run one check; fn returns the detail of a PASS / REFUSED / SKIP line or raises. Failures are
    always printed; other lines when `echo`."""
    t0 = time.perf_counter()
    try:
        detail = fn()
    except Exception:  # noqa: BLE001 - every failure is reported with its traceback
        log(f"FAIL    {name}: {traceback.format_exc().rstrip()}", sink)
        return False
    status, _, text = detail.partition(":")
    log(f"{status:<7} {name}: {text.strip()} ({time.perf_counter() - t0:.2f} s)", sink, echo)
    return True


def environment(sink: list) -> None:
    from all2all.deepep import load_deep_ep, ll_dispatch_has_use_fp8
    from all2all.symm_mem import runtime_unavailable_reason

    log(f"torch {torch.__version__}, CUDA {torch.version.cuda}, devices {torch.cuda.device_count()}"
        + (f" ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else ""), sink)
    log(f"symmetric memory: {runtime_unavailable_reason() or 'NVSHMEM available'}", sink)
    mod = load_deep_ep()
    if mod is None:
        log("deep_ep: not installed (docs/deepep.md says how to build it)", sink)
    else:
        log(f"deep_ep: {getattr(mod, '__file__', '?')}, low_latency_dispatch takes use_fp8: "
            f"{ll_dispatch_has_use_fp8(mod)}", sink)


# ---- one GPU ------------------------------------------------------------------------------------
def _single_gpu_worker(pgi, sink_path: str) -> None:
    from all2all.deepep import load_deep_ep
    from all2all.symm_mem import SymmMemBufferCache, SymmMemManager, TorchSymmMemBackend, runtime_unavailable_reason
    from moe_modular.config import MoEConfig
    from moe_modular.experts.naive_batched_experts import NaiveBatchedExperts
    from moe_modular.parallel_context import ParallelContext
    from moe_modular.prepare_finalize.deepep_ht_prepare_and_finalize import DeepEPHTPrepareAndFinalize
    from moe_modular.prepare_finalize.deepep_ll_prepare_and_finalize import DeepEPLLPrepareAndFinalize
    from moe_modular.prepare_finalize.symm_mem_prepare_and_finalize import SymmMemPrepareAndFinalize
    from moe_modular.quant import QuantConfig
    from moe_modular.testing.common import Config
    from moe_modular.testing.runner import run_case

    sink: list = []
    ctx = ParallelContext.from_group(pgi.group, pgi.device)
    moe1 = MoEConfig(num_experts=8, topk=2, hidden_dim=2048, intermediate_dim=512)
    ok = True

    def symm_refusal() -> str:
        supported, reason = SymmMemPrepareAndFinalize.supports(moe1)
        assert not supported and "single rank" in reason, reason
        for build in (lambda: SymmMemPrepareAndFinalize.make(moe1, ctx), lambda: ctx.all2all("symm_mem"),
                      lambda: SymmMemManager(pgi.group, pgi.device)):
            try:
                build()
            except ValueError as exc:
                assert "single rank" in str(exc), str(exc)
            else:
                raise AssertionError("a single rank was accepted")
        return f"REFUSED: {reason}"

    ok &= _check("symm_mem on 1 rank", symm_refusal, sink)

    def nvshmem_cache() -> str:
        reason = runtime_unavailable_reason()
        if reason is not None:
            return f"SKIP: {reason}"
        cache = SymmMemBufferCache(TorchSymmMemBackend(pgi.group.group_name, pgi.device), pgi.group.group_name,
                                   pgi.device)
        try:
            caps = [cache.reserve("rows", (4096,), torch.uint8, 10), cache.reserve("rows", (4096,), torch.uint8, 500)]
        except RuntimeError as exc:
            # torch 2.11 refuses a symmetric rendezvous on a one-rank group ("global_ranks.size() > 1"):
            # the buffer cache can only be exercised on 2+ GPUs (--world-size N).
            if pgi.world_size == 1 and "global_ranks.size() > 1" in str(exc):
                return f"REFUSED: torch's symmetric-memory rendezvous needs 2+ ranks ({str(exc).splitlines()[0]})"
            raise
        buf = cache.get("rows", (4096,), torch.uint8)
        buf.fill_(3)
        torch.cuda.synchronize()
        assert caps == [384, 768] and cache.num_allocations == 2 and int(buf[-1, -1]) == 3, caps
        cache.clear()
        torch.cuda.synchronize()
        return f"PASS: NVSHMEM symmetric buffers reserved {caps[0]} then grew to {caps[1]} rows, released"

    ok &= _check("symm_mem buffer cache on NVSHMEM (1 rank)", nvshmem_cache, sink)

    def ht_one_rank() -> str:
        supported, reason = DeepEPHTPrepareAndFinalize.supports(moe1)
        assert not supported, "DeepEP HT must refuse one rank"
        return f"REFUSED: {reason}"

    ok &= _check("DeepEP high-throughput on 1 rank", ht_one_rank, sink)

    for name, quant in (("fp8 1x128 dispatch", QuantConfig.fp8_block((128, 128))), ("bf16 dispatch", QuantConfig())):
        def ll_one_rank(quant=quant) -> str:
            cfg = Config(Ms=(1, 7, 64), K=2048, N=512, E=8, topks=(2,), dtype=torch.bfloat16, quant=quant,
                         prepare_finalize_type=DeepEPLLPrepareAndFinalize, fused_experts_type=NaiveBatchedExperts,
                         world_size=1)
            supported, reason = DeepEPLLPrepareAndFinalize.supports(cfg.moe_config(2))
            if not supported:
                return f"SKIP: {reason}"
            results = [run_case(cfg, M, 2, rank=0, context=ctx, seed=M) for M in cfg.Ms]
            bad = [r for r in results if not r.passed]
            assert not bad, "; ".join(f"M={r.M}: error {r.error:.3g} > {r.tolerance:.3g}" for r in bad)
            return "PASS: " + ", ".join(f"M={r.M} error {r.error:.2e} (tol {r.tolerance:.2e})" for r in results)

        ok &= _check(f"DeepEP low-latency on 1 rank, {name}", ll_one_rank, sink)

    def ll_receive_hook() -> str:
        # shared experts run while the dispatch is in flight: prepare_no_receive issues DeepEP's sends and the
        # receiver runs its receive hook (counted); routed output against the oracle, shared output exact
        from moe_modular.modular_kernel import FusedMoEModularKernel
        from moe_modular.reference import moe_torch
        from moe_modular.testing.common import tolerance
        from moe_modular.testing.runner import make_inputs, relative_error

        quant = QuantConfig.fp8_block((128, 128))
        cfg = Config(Ms=(7,), K=2048, N=512, E=8, topks=(2,), dtype=torch.bfloat16, quant=quant,
                     prepare_finalize_type=DeepEPLLPrepareAndFinalize, fused_experts_type=NaiveBatchedExperts,
                     world_size=1)
        moe = cfg.moe_config(2)
        supported, reason = DeepEPLLPrepareAndFinalize.supports(moe)
        if not supported:
            return f"SKIP: {reason}"
        inp = make_inputs(cfg, 7, 2, 5, pgi.device)
        pf = DeepEPLLPrepareAndFinalize.make(moe, ctx)
        hooks = []
        start = pf.prepare_no_receive
        pf.prepare_no_receive = lambda *a, **kw: hooks.append(1) or start(*a, **kw)
        kernel = FusedMoEModularKernel(pf, NaiveBatchedExperts.for_prepare_finalize(moe, inp.quant, pf),
                                       shared_experts=lambda h: h * 2, check_inputs=True)
        shared, out = kernel(inp.x, inp.w1, inp.w2, inp.topk_weights, inp.topk_ids, global_num_experts=cfg.E)
        ref = moe_torch(inp.x, inp.w1, inp.w2, inp.topk_weights, inp.topk_ids, cfg.activation, inp.quant)
        err, tol = relative_error(out, ref), tolerance(cfg.dtype, quant)
        assert hooks == [1], "the forward did not take prepare_no_receive"
        assert torch.equal(shared, inp.x * 2) and err <= tol, f"error {err:.3g} > {tol:.3g}"
        return f"PASS: routed error {err:.2e} (tol {tol:.2e}), shared output exact, receive hook taken"

    ok &= _check("DeepEP low-latency on 1 rank, receive hook with shared experts", ll_receive_hook, sink)
    if load_deep_ep() is None:
        log("note: the DeepEP checks answered without deep_ep; build it with tools/build_deep_ep.sh", sink)
    ctx.destroy()
    with open(sink_path, "a") as f:
        f.write("\n".join(sink) + "\n")
    assert ok, "a single-GPU check failed"


# ---- several GPUs -------------------------------------------------------------------------------
def _multi_gpu_worker(pgi, sink_path: str) -> None:
    from moe_modular.config import ExpertPlacement
    from moe_modular.experts.naive_batched_experts import NaiveBatchedExperts
    from moe_modular.experts.torch_experts import TorchExperts
    from moe_modular.parallel_context import ParallelContext
    from moe_modular.prepare_finalize.deepep_ht_prepare_and_finalize import DeepEPHTPrepareAndFinalize
    from moe_modular.prepare_finalize.deepep_ll_prepare_and_finalize import DeepEPLLPrepareAndFinalize
    from moe_modular.prepare_finalize.symm_mem_prepare_and_finalize import SymmMemPrepareAndFinalize
    from moe_modular.quant import QuantConfig
    from moe_modular.testing.common import Config
    from moe_modular.testing.runner import run_case

    sink: list = []
    ctx = ParallelContext.from_group(pgi.group, pgi.device)
    W = pgi.world_size
    schemes = [(torch.bfloat16, QuantConfig()), (torch.bfloat16, QuantConfig.fp8_block((128, 128))),
               (torch.bfloat16, QuantConfig.fp8_per_tensor()), (torch.bfloat16, QuantConfig.fp8_per_token())]
    pairs = [(SymmMemPrepareAndFinalize, TorchExperts), (DeepEPHTPrepareAndFinalize, TorchExperts),
             (DeepEPLLPrepareAndFinalize, NaiveBatchedExperts)]
    ok = True
    for pf, fe in pairs:
        for placement in (ExpertPlacement.LINEAR, ExpertPlacement.ROUND_ROBIN):
            for dtype, quant in schemes:
                cfg = Config(Ms=(1, 33, 128), K=2048, N=512, E=8 * W, topks=(1, 4), dtype=dtype, quant=quant,
                             prepare_finalize_type=pf, fused_experts_type=fe, world_size=W, placement=placement)
                name = f"{pf.__name__} x {fe.__name__} {quant.name} {placement.value} ws={W}"

                def cell(cfg=cfg) -> str:
                    valid, reason = cfg.is_valid()
                    if not valid:
                        return f"SKIP: {reason}"
                    results = [run_case(cfg, M, topk, rank=pgi.rank, context=ctx, seed=100 * M + topk)
                               for M in cfg.Ms for topk in cfg.topks]
                    worst = max(results, key=lambda r: r.error / r.tolerance)
                    assert all(r.passed for r in results), \
                        f"M={worst.M} topk={worst.topk}: error {worst.error:.3g} > {worst.tolerance:.3g}"
                    return f"PASS: worst error {worst.error:.2e} (tol {worst.tolerance:.2e}), {len(results)} cases"

                ok &= _check(name, cell, sink, echo=pgi.rank == 0)
    ctx.destroy()
    if pgi.rank == 0:
        with open(sink_path, "a") as f:
            f.write("\n".join(sink) + "\n")
    assert ok, f"rank {pgi.rank}: a multi-GPU check failed"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=1, help="also run the EP PFs on this many GPUs (> 1)")
    ap.add_argument("--out", default=None, help="directory for check_ep_gpu.txt")
    ap.add_argument("--timeout-s", type=float, default=420.0)
    args = ap.parse_args(argv)
    from moe_modular.testing.parallel_utils import ParallelLaunchError, parallel_launch

    sink: list = []
    if not torch.cuda.is_available():
        log("FAIL    no CUDA device: this check runs on a GPU machine", sink)
        return 1
    environment(sink)
    out_dir = args.out or os.getcwd()
    os.makedirs(out_dir, exist_ok=True)
    sink_path = os.path.join(out_dir, "check_ep_gpu.txt")
    with open(sink_path, "w") as f:
        f.write("\n".join(sink) + "\n")
    failed = False
    try:
        parallel_launch(1, _single_gpu_worker, sink_path, timeout_s=args.timeout_s, backend="nccl")
    except ParallelLaunchError as exc:
        failed = True
        print(f"single-GPU checks: {exc}", flush=True)
    if args.world_size > 1:
        if torch.cuda.device_count() < args.world_size:
            log(f"SKIP    {args.world_size}-GPU checks: only {torch.cuda.device_count()} GPUs here", sink)
        else:
            try:
                parallel_launch(args.world_size, _multi_gpu_worker, sink_path, timeout_s=args.timeout_s,
                                backend="nccl")
            except ParallelLaunchError as exc:
                failed = True
                print(f"{args.world_size}-GPU checks: {exc}", flush=True)
    if args.out is None:
        os.remove(sink_path)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
