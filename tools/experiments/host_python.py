"""Host time of the Python around the kernels of a TritonExperts forward, on a CPU, with the kernels stubbed out.

    python -m tools.experiments.host_python -m 1 64                     # tiny-e16 (E16 K128 N64 top-4), bf16
    python -m tools.experiments.host_python -m 1 64 --reps 1000 --rounds 7

FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP, TritonExperts) runs with Triton's interpreter, whose kernel run is
replaced by a no-op: every launch still binds its arguments and goes through moe_modular's launcher, but no kernel
body runs, so the time is the modular kernel's own host work (planning lookups, workspace views, argument values,
launch calls). The output is not computed (no oracle check). Per M: the best over --rounds of the mean time of --reps
forwards back to back. To compare two trees, run this in each checkout, alternately, on a quiet machine: the
difference is what a change costs every eager forward (a GPU host runs the same Python, faster).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from tools.bench_common import SMOKE_SHAPES


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--m", dest="ms", type=int, nargs="+", default=[1, 64], help="token counts")
    p.add_argument("--shape", default="tiny-e16", choices=sorted(SMOKE_SHAPES), help="a shape the CPU runs")
    p.add_argument("--reps", type=int, default=1000, help="forwards per round")
    p.add_argument("--rounds", type=int, default=7, help="rounds; the best counts")
    args = p.parse_args(argv)
    for name in ("reps", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} ({getattr(args, name)}) must be >= 1")
    if any(m < 1 for m in args.ms):
        p.error(f"-m ({args.ms}) must be >= 1")
    return args


def stub_kernels() -> None:
    """Triton's interpreter for the kernels, their bodies not run (call before anything imports a kernel)."""
    from moe_modular.testing.triton_interpreter import use_interpreter

    use_interpreter()
    from triton.runtime import interpreter

    interpreter.InterpretedFunction.run = lambda self, *args, **kwargs: None


def forward_seconds(M: int, shape, reps: int, rounds: int) -> float:
    from moe_modular.config import MoEConfig
    from moe_modular.experts.triton_experts import TritonExperts
    from moe_modular.modular_kernel import FusedMoEModularKernel
    from moe_modular.prepare_finalize.no_ep import MoEPrepareAndFinalizeNoEP
    from moe_modular.quant import MoEQuantParams, QuantConfig

    moe = MoEConfig(num_experts=shape.E, topk=shape.topk, hidden_dim=shape.K, intermediate_dim=shape.N,
                    dtype=torch.bfloat16, quant=QuantConfig(), max_num_tokens=M)
    mk = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP.make(moe), TritonExperts(moe, MoEQuantParams()))
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, shape.K, generator=g).to(torch.bfloat16)
    w1 = torch.randn(shape.E, 2 * shape.N, shape.K, generator=g).to(torch.bfloat16)
    w2 = torch.randn(shape.E, shape.K, shape.N, generator=g).to(torch.bfloat16)
    topk_weights = torch.rand(M, shape.topk, generator=g)
    topk_ids = torch.stack([torch.randperm(shape.E, generator=g)[:shape.topk] for _ in range(M)]).to(torch.int32)
    for _ in range(min(reps, 50)):  # plans, views and kept kernels made
        mk(x, w1, w2, topk_weights, topk_ids)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            mk(x, w1, w2, topk_weights, topk_ids)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def main(argv=None) -> int:
    args = parse_args(argv)
    if torch.cuda.is_available():
        print("host_python: this measures the CPU interpreter path with stubbed kernels; on a GPU use "
              "tools.experiments.host_overhead", file=sys.stderr)
    stub_kernels()
    shape = SMOKE_SHAPES[args.shape]
    print(f"| shape | M | host us per forward (best of {args.rounds} x {args.reps}) |\n|---|---|---|")
    for M in args.ms:
        print(f"| {args.shape} | {M} | {forward_seconds(M, shape, args.reps, args.rounds) * 1e6:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
