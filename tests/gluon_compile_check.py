"""Compile moe_gemm_ws's Gluon kernel for sm_90a on any machine (no GPU) and print what it became, as one
JSON line: {"wgmma": bool, "cp_async_arrive": bool, "shared": bytes, "local_bytes": int or null}.

    TRITON_INTERPRET=0 python -m tests.gluon_compile_check FUSED GATHER BLOCK_M BLOCK_N BLOCK_K GROUP_M WARPS STAGES

Used by tests/test_triton_kernels.py in a process of its own (a process that has run kernels in
Triton's interpreter cannot compile Gluon). local_bytes is the cubin's local memory (register spills) per
the cuobjdump triton ships, null where it ships none.
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
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

from moe_modular.kernels import moe_gemm_ws as W
from moe_modular.kernels.moe_gemm import GemmTile

# Arguments the launch would see 16-byte aligned (the JIT's divisibility specialization).
ALIGNED = ("a_ptr", "c_ptr", "sorted_ids_ptr", "block_expert_ptr", "stride_am", "stride_cm", "K", "N")


def compile_ws(fused: bool, gather: bool, tile: GemmTile):
    """The kernel compiled for sm_90a as the Qwen3-sized first (fused) or second GEMM would launch it."""
    S, K, El, No = 1024, 2048, 8, 1536
    a = torch.empty(S, K, dtype=torch.bfloat16)
    c = torch.empty(S, No // 2 if fused else No, dtype=torch.bfloat16)
    a_desc, b_desc = W.ws_descriptors(a, torch.empty(El, No, K, dtype=torch.bfloat16), tile, not gather)
    ids = torch.empty(4, dtype=torch.int32)
    args = dict(a_desc=b_desc if gather else a_desc, a_ptr=a, stride_am=K, b_desc=b_desc, c_ptr=c,
                topk_weights_ptr=torch.empty(4, 2), sorted_ids_ptr=ids, block_expert_ptr=ids, num_post_padded_ptr=ids,
                num_routes=100, N=c.shape[1], K=K, topk=2, b_rows_per_expert=No, stride_cm=c.stride(0), stride_wt=2,
                stride_wk=1)
    consts = dict(FUSE_ACT=fused, ACTIVATION=0, MUL_WEIGHT=not fused, C_SORTED=fused, A_GATHER=gather,
                  A_ROW_DIV=2 if fused else 1, BLOCK_M=tile.BLOCK_M, BLOCK_N=tile.BLOCK_N, BLOCK_K=tile.BLOCK_K,
                  GROUP_M=tile.GROUP_M, STAGES=W.ws_stages(tile, fused, 2), NUM_WARPS=tile.num_warps,
                  A_LAYOUT=W.a_smem_layout(tile, torch.bfloat16),
                  C_LAYOUT=W.gl.NVMMASharedLayout.get_default_for([tile.BLOCK_M, tile.BLOCK_N], W.gl.bfloat16))
    names = list(W._moe_gemm_ws_kernel.arg_names)
    src = GluonASTSource(W._moe_gemm_ws_kernel, {**{k: mangle_type(v) for k, v in args.items()},
                                                 **{k: "constexpr" for k in consts}}, constexprs=consts,
                         attrs={(names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": tile.num_warps})


def local_bytes(cubin: bytes):
    """Local memory of the kernel in `cubin` per triton's cuobjdump, or None where triton ships none."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    return int(re.search(r"LOCAL:(\d+)", usage).group(1))


def main(argv: list[str]) -> int:
    fused, gather, *fields = (int(v) for v in argv)
    kernel = compile_ws(bool(fused), bool(gather), GemmTile(*fields))
    ptx = kernel.asm["ptx"]
    print(json.dumps({"wgmma": "wgmma.mma_async" in ptx, "cp_async_arrive": "cp.async.mbarrier.arrive" in ptx,
                      "shared": kernel.metadata.shared, "local_bytes": local_bytes(kernel.asm["cubin"])}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
