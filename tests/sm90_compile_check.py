"""Compile a kernel for sm_90a on any machine (no GPU) and print what it became, as one JSON line.

    TRITON_INTERPRET=0 python -m tests.sm90_compile_check ws FUSED GATHER BLOCK_M BLOCK_N BLOCK_K GROUP_M WARPS STAGES
    TRITON_INTERPRET=0 python -m tests.sm90_compile_check pdl PER_ROUTE PERSISTENT
    TRITON_INTERPRET=0 python -m tests.sm90_compile_check wsfp8 FUSED GATHER SCALES [WIDE]

ws: moe_gemm_ws's Gluon kernel: {"wgmma": bool, "cp_async_arrive": bool, "shared": bytes, "local_bytes": int
or null}. pdl: moe_gemm's Triton kernel as a second GEMM launched with LaunchOptions.pdl (per-route or standard blocks,
persistent or not): {"wait": n, "launch_dependents": n, "launch_pdl": bool}, the counts of griddepcontrol.wait
and griddepcontrol.launch_dependents in its PTX.

Used by tests/test_triton_kernels.py in a process of its own (a process that has run kernels in
Triton's interpreter cannot compile them for a GPU). local_bytes is the cubin's local memory (register spills)
per the cuobjdump triton ships, null where it ships none. wsfp8: moe_gemm_ws_fp8's kernel: {"wgmma": count,
"cp_async_arrive": bool, "shared": bytes, "stack_bytes": int or null, "barrier_threads": the thread counts of its
named barriers, "max_regs": the registers its partitions raise themselves to}.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

from moe_modular.kernels import moe_gemm as G
from moe_modular.kernels import moe_gemm_ws as W
from moe_modular.kernels import moe_gemm_ws_fp8 as F
from moe_modular.config import Activation
from moe_modular.kernels.gemm_config import AScale, BScale, GemmEpilogue, GemmScales, GemmTile, SortedRows

TARGET = GPUTarget("cuda", 90, 32)

# Arguments the launch would see 16-byte aligned (the JIT's divisibility specialization).
ALIGNED = ("a_ptr", "c_ptr", "sorted_ids_ptr", "block_expert_ptr", "stride_am", "stride_cm", "K", "N")


class LaunchRecorder:
    """Stands in for a Gluon kernel while its host wrapper runs: `kernel[grid](*args, **kw)` keeps the grid, the
    launch's {parameter: value}, the names given twice or unknown, and the launch options."""

    OPTIONS = ("num_warps", "num_stages", "launch_pdl")

    def __init__(self, real) -> None:
        self.names = list(real.arg_names)
        self.launches: list[dict] = []

    def __getitem__(self, grid):
        def run(*args, **kw):
            bound = dict(zip(self.names, args))
            unknown = sorted(set(kw) - set(self.names) - set(self.OPTIONS))
            if len(args) > len(self.names):
                unknown.append(f"{len(args) - len(self.names)} positional")
            self.launches.append(dict(
                grid=grid, bound={**bound, **{k: v for k, v in kw.items() if k in self.names}},
                twice=sorted(set(bound) & set(kw)), unknown=unknown,
                options={k: v for k, v in kw.items() if k in self.OPTIONS}))
        return run


def _compile_wrapped(module, name: str, wrapper):
    """Run the host wrapper `wrapper()` of module.name with the kernel recorded, then compile the kernel for sm_90a
    with exactly the arguments the wrapper passed (the pointer / stride arguments of ALIGNED 16-byte aligned, as
    the launch's specialization would see them)."""
    real = getattr(module, name)
    recorder = LaunchRecorder(real)
    setattr(module, name, recorder)
    try:
        wrapper()
    finally:
        setattr(module, name, real)
    launch = recorder.launches[-1]
    bound, options = launch["bound"], launch["options"]
    constexpr = {p.name for p in real.params if p.is_constexpr}
    consts = {k: v for k, v in bound.items() if k in constexpr}
    signature = {k: "constexpr" if k in constexpr else mangle_type(v) for k, v in bound.items()}
    names = list(real.arg_names)
    src = GluonASTSource(real, signature, constexprs=consts,
                         attrs={(names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED if n in names})
    return triton.compile(src, target=TARGET, options={"num_warps": options["num_warps"]})


def compile_ws(fused: bool, gather: bool, tile: GemmTile):
    """The kernel compiled for sm_90a as moe_gemm_ws launches it for a Qwen3-sized first (fused, sorted output) or
    second GEMM (times the top-k weight)."""
    S, K, El, No = 1024, 2048, 8, 1536
    a = torch.empty(S, K, dtype=torch.bfloat16)
    c = torch.empty(S, No // 2 if fused else No, dtype=torch.bfloat16)
    ids = torch.empty(4, dtype=torch.int32)
    rows = SortedRows(ids, ids, ids, 100, 2 if fused else 1, a_sorted=not gather, c_sorted=fused)
    epilogue = GemmEpilogue(Activation.SILU) if fused else GemmEpilogue(topk_weights_Tk=torch.empty(4, 2))
    return _compile_wrapped(W, "_moe_gemm_ws_kernel", lambda: W.moe_gemm_ws(
        a, torch.empty(El, No, K, dtype=torch.bfloat16), c, tile, rows, epilogue, tiles=64, sms=132))


def compile_ws_fp8(fused: bool, gather: bool, scales: int, wide: bool = False):
    """The fp8 kernel compiled for sm_90a as moe_gemm_ws_fp8 launches it for a DeepSeek-V3-sized first (fused, fp8
    output with group scales) or second GEMM (bf16 output times the top-k weight; wide: 256-column tiles);
    scales: Fp8Scales value."""
    S, K, El, No = 1024, 7168, 8, 4096
    fp8 = torch.float8_e4m3fn
    a = torch.empty(S, K, dtype=fp8)
    c = torch.empty(S, No // 2, dtype=fp8) if fused else torch.empty(S, No, dtype=torch.bfloat16)
    kind = F.Fp8Scales(scales)
    if kind is F.Fp8Scales.BLOCK:
        gemm_scales = GemmScales(torch.empty(S, K // 128), AScale.GROUP, torch.empty(El, No // 128, K // 128),
                                 BScale.BLOCK, (128, 128))
    else:
        gemm_scales = GemmScales(torch.empty(S, 1), AScale.ROW, torch.empty(El, No, 1), BScale.CHANNEL)
    ids = torch.empty(4, dtype=torch.int32)
    rows = SortedRows(ids, ids, ids, 100, 8 if fused else 1, a_sorted=not gather)
    epilogue = (GemmEpilogue(Activation.SILU, c_scale=torch.empty(S, No // 2 // 128), c_group=128) if fused
                else GemmEpilogue(topk_weights_Tk=torch.empty(4, 8)))
    return _compile_wrapped(F, "_moe_gemm_ws_fp8_kernel", lambda: F.moe_gemm_ws_fp8(
        a, torch.empty(El, No, K, dtype=fp8), c, kind, gemm_scales, rows, epilogue, tiles=64, sms=132, group_m=8,
        wide=wide))


def compile_pdl_gemm2(per_route: bool, persistent: int):
    """moe_gemm's kernel for sm_90a as a Qwen3-sized bf16 second GEMM with LaunchOptions.pdl would launch it."""
    b = torch.empty(8, 2048, 768, dtype=torch.bfloat16)
    tensors = dict(a_ptr=torch.empty(64, 768, dtype=torch.bfloat16), b_ptr=b,
                   c_ptr=torch.empty(64, 2048, dtype=torch.bfloat16), topk_weights_ptr=torch.empty(8, 8))
    consts = dict(A_ROW_DIV=1, BATCHED=False, A_SCALE=G.AScale.NONE.value, B_SCALE=G.BScale.NONE.value, GROUP_N=1,
                  GROUP_K=1, MUL_WEIGHT=True, EVEN_K=True, DOT_PRECISION="tf32", FUSE_ACT=False, ACTIVATION=0,
                  B_TMA=False, A_SORTED=False, C_SORTED=False, A_TMA=False, PER_ROUTE=per_route, HAS_MAP=False,
                  OUT_GROUP=0, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, PERSISTENT=persistent, GDC=True,
                  PDL=True)
    kernel = G._moe_gemm_kernel
    signature = {}
    for name, param in zip(kernel.arg_names, kernel.params):
        if param.is_constexpr:
            signature[name] = "constexpr"
        elif name in tensors:
            signature[name] = mangle_type(tensors[name])
        else:  # the other pointers: int32 routing and float32 scales, none read here; integers
            signature[name] = ("*fp32" if "scale" in name else "*i32") if name.endswith("_ptr") else "i32"
    return triton.compile(ASTSource(kernel, signature, constexprs=consts), target=TARGET,
                          options={"num_warps": 4, "num_stages": 3, "launch_pdl": True})


def resource(cubin: bytes, what: str):
    """One figure of the kernel in `cubin` per triton's cuobjdump resource usage (LOCAL: local memory, STACK: the
    stack frame, where spilled registers go), or None where triton ships no cuobjdump."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    return int(re.search(rf"{what}:(\d+)", usage).group(1))


def local_bytes(cubin: bytes):
    """Local memory of the kernel in `cubin` (register spills), or None where triton ships no cuobjdump."""
    return resource(cubin, "LOCAL")


def main(argv: list[str]) -> int:
    what, *numbers = argv
    if what == "wsfp8":
        fused, gather, scales, *wide = (int(v) for v in numbers)
        kernel = compile_ws_fp8(bool(fused), bool(gather), scales, bool(wide and wide[0]))
        ptx = kernel.asm["ptx"]
        print(json.dumps({"wgmma": ptx.count("wgmma.mma_async"), "cp_async_arrive": "cp.async.mbarrier.arrive" in ptx,
                          "shared": kernel.metadata.shared, "stack_bytes": resource(kernel.asm["cubin"], "STACK"),
                          "barrier_threads": sorted({int(n) for n in re.findall(r"bar\.sync\s+\d+,\s*(\d+);", ptx)}),
                          "max_regs": sorted({int(n) for n in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)",
                                                                         ptx)})}))
        return 0
    if what == "pdl":
        per_route, persistent = (int(v) for v in numbers)
        kernel = compile_pdl_gemm2(bool(per_route), persistent)
        ptx = kernel.asm["ptx"]
        print(json.dumps({"wait": ptx.count("griddepcontrol.wait"),
                          "launch_dependents": ptx.count("griddepcontrol.launch_dependents"),
                          "launch_pdl": bool(kernel.metadata.launch_pdl)}))
        return 0
    fused, gather, *fields = (int(v) for v in numbers)
    kernel = compile_ws(bool(fused), bool(gather), GemmTile(*fields))
    ptx = kernel.asm["ptx"]
    print(json.dumps({"wgmma": "wgmma.mma_async" in ptx, "cp_async_arrive": "cp.async.mbarrier.arrive" in ptx,
                      "shared": kernel.metadata.shared, "local_bytes": local_bytes(kernel.asm["cubin"])}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
