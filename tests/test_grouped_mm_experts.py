"""GroupedMMExperts: supports() and its reasons, and numerics inside the modular kernel against the
float32 oracle (torch._grouped_mm runs on the CPU in torch 2.13; the fp8 and CUDA-graph cases
need an sm90+ GPU)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from moe_modular.config import Activation, MoEConfig
from moe_modular.experts.grouped_mm_experts import GroupedMMExperts
from moe_modular.modular_kernel import FusedMoEModularKernel
from moe_modular.prepare_finalize.no_ep import MoEPrepareAndFinalizeNoEP
from moe_modular.quant import FP8_DTYPE, MoEQuantParams, QuantConfig, quantize_weights
from moe_modular.reference import moe_torch

# bf16 GEMM outputs, the bf16 activation and the bf16 router weights each round once (2^-9
# relative); a relative L2 error of 2 bf16 epsilons leaves room for their sum.
BF16_TOL = 2 * torch.finfo(torch.bfloat16).eps
# fp8 e4m3 rounds the intermediate to 3 mantissa bits (2^-4 relative); the oracle quantizes the
# same rows, so only rounding-boundary flips differ.
FP8_TOL = 2 * torch.finfo(FP8_DTYPE).eps

_SUPPORTED, _WHY_NOT = GroupedMMExperts.supports(MoEConfig(8, 2, 64, 32, dtype=torch.bfloat16))
_FP8_MOE = MoEConfig(8, 2, 128, 64, dtype=torch.bfloat16, quant=QuantConfig.fp8_per_token())
_FP8_SUPPORTED, _FP8_WHY_NOT = GroupedMMExperts.supports(_FP8_MOE)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "unwritten (NaN) output rows"
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


@dataclass(frozen=True)
class Case:
    T: int
    E: int
    K: int
    N: int
    topk: int
    activation: Activation = Activation.SILU
    held: Optional[int] = None  # local experts held (an expert map over E global ids), None = all
    drop_routes: bool = False  # some topk ids are -1 (routes held elsewhere, as EP PFs pass them)
    weight_on_input: bool = False
    chunk_size: Optional[int] = None


CASES = [
    Case(1, 4, 64, 32, 1),  # M=1, topk=1: one route, three empty groups
    Case(0, 4, 64, 32, 2),  # M=0: nothing to compute, an empty output
    Case(37, 7, 72, 48, 3),  # prime E, K not a power of two (144-byte rows)
    Case(6, 5, 32, 16, 5),  # topk == E: every expert sees every token
    Case(3, 16, 64, 32, 2),  # E >> routes: most groups empty, empty groups between full ones
    Case(20, 6, 64, 32, 2, Activation.GELU),  # GELU gate
    Case(20, 6, 64, 32, 2, Activation.SWIGLU_OAI),  # interleaved swiglu-oai with clamps
    Case(25, 8, 64, 32, 3, held=5),  # expert map: 3 of 8 global experts map to -1 (zero routes)
    Case(25, 8, 64, 32, 3, drop_routes=True),  # local ids with -1 routes, no expert map
    Case(19, 6, 64, 32, 1, weight_on_input=True),  # router weight applied on the input (topk 1)
    Case(23, 6, 64, 32, 2, chunk_size=5),  # chunked: 5 apply calls, the last one of 3 tokens
]


def _inputs(case: Case, dtype: torch.dtype, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    El = case.held if case.held is not None else case.E
    x = torch.randn(case.T, case.K, generator=g).to(dtype)
    w1 = (torch.randn(El, 2 * case.N, case.K, generator=g) / math.sqrt(case.K)).to(dtype)
    w2 = (torch.randn(El, case.K, case.N, generator=g) / math.sqrt(case.N)).to(dtype)
    probs = torch.softmax(torch.randn(case.T, case.E, generator=g), -1)
    tw, ti = probs.topk(case.topk, dim=-1)
    ti = ti.to(torch.int32)
    if case.drop_routes:
        ti = torch.where(torch.rand(ti.shape, generator=g) < 0.3, -1, ti)
    expert_map = None
    if case.held is not None:
        expert_map = torch.full((case.E,), -1, dtype=torch.int32)
        held_ids = torch.randperm(case.E, generator=g)[: case.held]
        expert_map[held_ids] = torch.arange(case.held, dtype=torch.int32)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(x), to(w1), to(w2), to(tw), to(ti), to(expert_map)


def _run(case: Case, moe: MoEConfig, qp: MoEQuantParams, x, w1, w2, tw, ti, expert_map):
    pf = MoEPrepareAndFinalizeNoEP.make(moe)
    fe = GroupedMMExperts.for_prepare_finalize(moe, qp, pf)
    kw = {} if case.chunk_size is None else {"chunk_size": case.chunk_size}
    mk = FusedMoEModularKernel(pf, fe, **kw)
    out = torch.full_like(x, float("nan"))
    mk(x, w1, w2, tw, ti, activation=case.activation, global_num_experts=case.E, expert_map=expert_map,
       apply_router_weight_on_input=case.weight_on_input, output=out)
    return out


@pytest.mark.skipif(not _SUPPORTED, reason=f"GroupedMMExperts unsupported here: {_WHY_NOT}")
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_bf16_matches_oracle(case: Case):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    moe = MoEConfig(case.E, case.topk, case.K, case.N, dtype=torch.bfloat16, activation=case.activation)
    seed = int(torch.randint(0, 2**31, ()))
    x, w1, w2, tw, ti, emap = _inputs(case, torch.bfloat16, device, seed)
    out = _run(case, moe, MoEQuantParams(), x, w1, w2, tw, ti, emap)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    if case.T == 0:
        return
    ref = moe_torch(x, w1, w2, tw, ti, case.activation, expert_map=emap,
                    apply_router_weight_on_input=case.weight_on_input)
    assert _rel(out, ref) < BF16_TOL, f"seed {seed}"


@pytest.mark.skipif(not _FP8_SUPPORTED, reason=f"fp8 GroupedMMExperts unsupported here: {_FP8_WHY_NOT}")
@pytest.mark.parametrize("case", [
    Case(33, 8, 128, 64, 2),  # fp8 per-token: several tokens per expert
    Case(1, 8, 128, 64, 2),  # fp8 M=1
    Case(25, 8, 128, 64, 3, held=5),  # fp8 with an expert map (not-held routes in the tail group)
], ids=repr)
def test_fp8_per_token_matches_oracle(case: Case):
    moe = MoEConfig(case.E, case.topk, case.K, case.N, dtype=torch.bfloat16, quant=QuantConfig.fp8_per_token())
    seed = int(torch.randint(0, 2**31, ()))
    x, w1, w2, tw, ti, emap = _inputs(case, torch.bfloat16, "cuda", seed)
    w1q, s1 = quantize_weights(w1, moe.quant)
    w2q, s2 = quantize_weights(w2, moe.quant)
    qp = MoEQuantParams(moe.quant, s1, s2)
    out = _run(case, moe, qp, x, w1q, w2q, tw, ti, emap)
    ref = moe_torch(x, w1q, w2q, tw, ti, case.activation, quant=qp, expert_map=emap)
    assert _rel(out, ref) < FP8_TOL, f"seed {seed}"


@pytest.mark.skipif(not (_SUPPORTED and torch.cuda.is_available()),
                    reason=f"needs a CUDA GPU GroupedMMExperts supports ({_WHY_NOT or 'no CUDA device'})")
def test_cuda_graph_replay_matches_eager():
    case = Case(40, 8, 128, 64, 2)
    moe = MoEConfig(case.E, case.topk, case.K, case.N, dtype=torch.bfloat16)
    x, w1, w2, tw, ti, _ = _inputs(case, torch.bfloat16, "cuda", int(torch.randint(0, 2**31, ())))
    pf = MoEPrepareAndFinalizeNoEP.make(moe)
    mk = FusedMoEModularKernel(pf, GroupedMMExperts.for_prepare_finalize(moe, MoEQuantParams(), pf))
    out = torch.full_like(x, float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mk(x, w1, w2, tw, ti, output=out)  # warm-up: workspaces exist before the capture
    torch.cuda.current_stream().wait_stream(stream)
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mk(x, w1, w2, tw, ti, output=out)
    # New routing and inputs in the captured buffers: the replay must follow them.
    x.copy_(torch.randn_like(x))
    ti.copy_(torch.randint(0, case.E, ti.shape, device="cuda", dtype=ti.dtype))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(out, moe_torch(x, w1, w2, tw, ti)) < BF16_TOL
    assert not torch.equal(out, eager)


# ---- supports() ---------------------------------------------------------------------------

REFUSALS = [
    # (config, text the reason must hold)
    (MoEConfig(8, 2, 64, 32, dtype=torch.float16), "dtype float16 is not supported"),  # not bf16
    (MoEConfig(8, 2, 64, 32, dtype=torch.float32), "allowed: ['bfloat16']"),  # fp32
    (MoEConfig(8, 2, 128, 128, quant=QuantConfig.fp8_block((128, 128))),
     "quant scheme fp8-block128x128 has no torch grouped GEMM"),  # block scales
    (MoEConfig(8, 2, 64, 32, quant=QuantConfig.fp8_per_tensor()), "allowed: unquantized, fp8-token"),  # per-tensor
    (MoEConfig(8, 2, 100, 32), "hidden_dim (100) must be a multiple of 8"),  # 200-byte bf16 rows
    (MoEConfig(8, 2, 64, 36), "intermediate_dim (36) must be a multiple of 8"),  # 72-byte intermediate rows
    (MoEConfig(8, 2, 128, 24, quant=QuantConfig.fp8_per_token()),
     "intermediate_dim (24) must be a multiple of 16"),  # 24-byte fp8 rows
]


@pytest.mark.parametrize("moe,text", REFUSALS, ids=lambda v: v if isinstance(v, str) else v.describe())
def test_refusals_name_the_reason(moe, text):
    ok, reason = GroupedMMExperts.supports(moe)
    assert not ok and text in reason, reason
    with pytest.raises(ValueError, match="GroupedMMExperts cannot serve"):
        qp = MoEQuantParams(moe.quant, torch.ones(1), torch.ones(1)) if moe.quant.is_quantized else MoEQuantParams()
        GroupedMMExperts(moe, qp)


def test_refuses_torch_without_the_op(monkeypatch):
    monkeypatch.delattr(torch, "_grouped_mm")
    ok, reason = GroupedMMExperts.supports(MoEConfig(8, 2, 64, 32))
    assert not ok and "has no torch._grouped_mm" in reason


def test_refuses_gpus_without_cutlass_grouped_gemm(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    ok, reason = GroupedMMExperts.supports(MoEConfig(8, 2, 64, 32))
    assert not ok and "compute capability 9.x / 10.x only; the GPU has 8.0" in reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal of the fp8 op")
def test_fp8_refused_without_cuda():
    ok, reason = GroupedMMExperts.supports(_FP8_MOE)
    if ok:  # a torch with a CPU _scaled_grouped_mm would be allowed; then the refusal text is moot
        pytest.skip("this torch has a CPU kernel for aten::_scaled_grouped_mm")
    assert "no CPU kernel for aten::_scaled_grouped_mm" in reason


def test_capabilities():
    moe = MoEConfig(8, 2, 64, 32)
    if not _SUPPORTED:
        pytest.skip(_WHY_NOT)
    fe = GroupedMMExperts(moe, MoEQuantParams())
    assert fe.supports_expert_map() and fe.supports_chunking()
    assert type(fe.finalize_weight_and_reduce_impl()).__name__ == "TopKWeightAndReduceNoOp"
    ws13, ws2, out, dtype = fe.workspace_shapes(5, 64, 64, 2, 8, 8, None)
    assert ws13 == (10, 64) and ws2 == (10, 64) and out == (5, 64) and dtype == torch.bfloat16
