"""Expert-parallel PrepareAndFinalize classes end to end through FusedMoEModularKernel on gloo.

Every rank builds the same seeded global problem (all ranks' tokens, all experts), runs its own
tokens with its local experts, and compares with the float32 oracle on the global batch (the
combine wires: with a float64 oracle). Cases are data; each is commented with the edge it covers.
Cases of one world size share one launch to keep spawn cost down; a failing case is reported with
its description and every rank's error.

Shape legend: W world size, M_r tokens of rank r, Mall = sum M_r, K hidden, N intermediate,
E global experts, El local experts, k topk.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_modular.config import Activation, ExpertPlacement, MoEConfig, ParallelConfig
from moe_modular.experts.naive_batched_experts import NaiveBatchedExperts
from moe_modular.experts.torch_experts import TorchExperts
from moe_modular.interfaces import ActivationFormat
from moe_modular.modular_kernel import FusedMoEModularKernel
from moe_modular.parallel_context import ParallelContext
from moe_modular.prepare_finalize.all_to_all_prepare_and_finalize import AllToAllPrepareAndFinalize
from moe_modular.prepare_finalize.allgather_reducescatter_prepare_and_finalize import (
    AllGatherReduceScatterPrepareAndFinalize,
)
from moe_modular.prepare_finalize.combine_wire import COMBINE_WIRES
from moe_modular.prepare_finalize.low_latency_all2all_prepare_and_finalize import LowLatencyAll2AllPrepareAndFinalize
from moe_modular.prepare_finalize.naive_all2all_prepare_and_finalize import NaiveAll2AllPrepareAndFinalize
from moe_modular.prepare_finalize.slice_allgather_prepare_and_finalize import SliceAllGatherPrepareAndFinalize
from moe_modular.quant import MoEQuantParams, QuantConfig, quantize_weights
from moe_modular.reference import moe_torch
from moe_modular.routing import local_expert_ids, make_expert_map
from moe_modular.workspace import WorkspaceCache
from moe_modular.testing.common import tolerance
from moe_modular.testing.parallel_utils import parallel_launch

PF_TYPES = {
    "naive": NaiveAll2AllPrepareAndFinalize,
    "agrs": AllGatherReduceScatterPrepareAndFinalize,
    "a2a": AllToAllPrepareAndFinalize,
    "ll": LowLatencyAll2AllPrepareAndFinalize,
    "slice": SliceAllGatherPrepareAndFinalize,
}
EXPERTS_BY_FORMAT = {ActivationFormat.Standard: TorchExperts, ActivationFormat.BatchedExperts: NaiveBatchedExperts}
LAUNCH_TIMEOUT_S = 240.0


@dataclass(frozen=True)
class Case:
    """One forward. Ms: tokens per rank (len W; with `replicated`, the shared batch size M)."""

    pf: str
    Ms: tuple[int, ...]
    E: int = 8
    topk: int = 2
    K: int = 48
    N: int = 16
    dtype: torch.dtype = torch.bfloat16
    quant: QuantConfig = field(default_factory=QuantConfig)
    placement: ExpertPlacement = ExpertPlacement.LINEAR
    routing: str = "random"  # random | rank0 (every route to experts of rank 0) | expert0 (all to E-1 and 0..)
    on_input: bool = False  # apply_router_weight_on_input (topk 1)
    wire: Optional[str] = None  # a2a combine wire (None: the default)
    shared: bool = False  # run shared experts through prepare_no_receive
    replicated: bool = False  # slice: every rank holds the same batch

    @property
    def W(self) -> int:
        return 1 if self.replicated else len(self.Ms)

    def describe(self) -> str:
        q = self.quant.name
        return (f"{self.pf} Ms={self.Ms} E={self.E} k={self.topk} K={self.K} {str(self.dtype)[6:]}/{q} "
                f"{self.placement.value} routing={self.routing} on_input={self.on_input} wire={self.wire} "
                f"shared={self.shared}")


BLOCK = QuantConfig.fp8_block((16, 16))  # K=48: three groups per row, blocks smaller than the weights

CASES_W2 = [
    Case("naive", (5, 3)),  # plain, uneven M across ranks
    Case("agrs", (5, 3)),  # plain, padded all-gather / reduce-scatter
    Case("a2a", (5, 3)),  # plain, default wire
    Case("ll", (5, 3)),  # plain, batched slots
    Case("naive", (4, 0)),  # M=0 on rank 1
    Case("agrs", (0, 1)),  # M=0 and M=1
    Case("a2a", (1, 0)),  # M=1 and M=0
    Case("ll", (0, 1)),  # M=0 and M=1, static slots mostly empty
    Case("a2a", (0, 0)),  # no tokens anywhere
    Case("ll", (0, 0)),  # no tokens anywhere, still a full static exchange
    Case("naive", (6, 6), routing="rank0"),  # rank 1 and its experts receive nothing
    Case("agrs", (6, 6), routing="rank0"),  # rank 1 and its experts receive nothing
    Case("a2a", (6, 6), routing="rank0"),  # rank 1 and its experts receive nothing
    Case("ll", (6, 6), routing="rank0"),  # rank 1 and its experts receive nothing
    Case("a2a", (4, 4), topk=1),  # topk = 1
    Case("ll", (4, 4), topk=1, on_input=True),  # topk = 1 with the router weight on the input
    Case("naive", (3, 4), topk=8),  # topk = El * W = E: every expert on every token
    Case("a2a", (3, 4), topk=8),  # topk = E
    Case("ll", (3, 4), topk=8),  # topk = E: every slot block used
    Case("a2a", (5, 3), placement=ExpertPlacement.ROUND_ROBIN),  # round-robin placement
    Case("ll", (5, 3), placement=ExpertPlacement.ROUND_ROBIN),  # round-robin placement
    Case("naive", (5, 3), quant=QuantConfig.fp8_per_tensor()),  # dynamic per-tensor: quantized after gather
    Case("a2a", (5, 3), quant=QuantConfig.fp8_per_tensor()),  # dynamic per-tensor: global amax, before
    Case("ll", (5, 3), quant=QuantConfig.fp8_per_tensor()),  # dynamic per-tensor: global amax, before
    Case("a2a", (5, 3), quant=QuantConfig.fp8_per_token()),  # per-token scales travel with tokens
    Case("agrs", (5, 3), quant=QuantConfig.fp8_per_token()),  # per-token scales travel with tokens
    Case("ll", (5, 3), quant=QuantConfig.fp8_per_token()),  # per-token scales in the slots
    Case("a2a", (5, 3), quant=BLOCK),  # group scales travel with tokens
    Case("naive", (5, 3), quant=BLOCK),  # group scales travel with tokens
    Case("ll", (5, 3), quant=BLOCK),  # group scales in the slots
    Case("a2a", (5, 3), dtype=torch.float16),  # fp16 activations: default hi/lo wire
    Case("a2a", (5, 3), dtype=torch.float32),  # fp32 activations: default per-route wire
    Case("agrs", (5, 3), dtype=torch.float32),  # fp32 activations
    Case("a2a", (5, 3), wire="per_route"),  # per-route combine wire
    Case("a2a", (5, 3), wire="prereduced_hilo"),  # hi/lo combine wire
    Case("a2a", (5, 3), shared=True),  # shared experts overlap the dispatch
    Case("ll", (5, 3), shared=True),  # shared experts overlap the dispatch
    Case("naive", (5, 3), shared=True),  # shared experts overlap the broadcasts
    Case("slice", (1,), replicated=True),  # M < W: rank 1 holds only padding
    Case("slice", (7,), replicated=True),  # M not divisible by W
    Case("slice", (0,), replicated=True),  # M = 0: every slice is padding
    Case("slice", (6,), replicated=True, routing="rank0", quant=QuantConfig.fp8_per_token()),  # skew + fp8
]

CASES_W4 = [
    Case("naive", (3, 0, 1, 5)),  # uneven M incl. 0 and 1
    Case("agrs", (3, 0, 1, 5)),  # uneven M incl. 0 and 1
    Case("a2a", (3, 0, 1, 5)),  # uneven M incl. 0 and 1
    Case("ll", (3, 0, 1, 5)),  # uneven M incl. 0 and 1
    Case("a2a", (4, 4, 4, 4), routing="rank0"),  # three ranks receive nothing
    Case("ll", (4, 4, 4, 4), routing="rank0"),  # three ranks receive nothing
    Case("agrs", (4, 4, 4, 4), routing="rank0"),  # three ranks receive nothing
    Case("a2a", (2, 3, 2, 1), topk=8),  # topk = El * W = E
    Case("ll", (2, 3, 2, 1), topk=8),  # topk = E
    Case("a2a", (2, 3, 2, 1), topk=1),  # topk = 1
    Case("a2a", (4, 2, 3, 1), wire="per_route", placement=ExpertPlacement.ROUND_ROBIN),  # per-route, round robin
    Case("a2a", (4, 2, 3, 1), wire="prereduced_hilo", quant=BLOCK),  # hi/lo wire with fp8 block
    Case("ll", (4, 2, 3, 1), quant=QuantConfig.fp8_per_tensor(static=True)),  # static per-tensor scale
    Case("a2a", (4, 2, 3, 1), quant=QuantConfig.fp8_per_tensor()),  # dynamic per-tensor: global amax
    Case("slice", (3,), replicated=True),  # M < W
    Case("slice", (10,), replicated=True, topk=8),  # M not divisible by W, topk = E
]

CASES_W1 = [  # one rank: the path a single GPU runs under NCCL
    Case("naive", (5,)),  # gather family degenerates to a copy
    Case("agrs", (3,), quant=QuantConfig.fp8_per_token()),  # per-token scales, one rank
    Case("a2a", (5,), wire="per_route"),  # every route stays local
    Case("a2a", (0,)),  # M = 0 on the only rank
    Case("ll", (4,), quant=BLOCK),  # static slots, one rank
    Case("slice", (3,), replicated=True),  # the slice is the whole batch
]


# ---- problem construction ----------------------------------------------------------------------

@dataclass(frozen=True)
class Problem:
    x: torch.Tensor  # (Mall, K) dtype
    topk_weights: torch.Tensor  # (Mall, k) float32
    topk_ids: torch.Tensor  # (Mall, k) int32 global
    w1: torch.Tensor  # (E, 2N, K) dtype or fp8
    w2: torch.Tensor  # (E, K, N)
    quant: MoEQuantParams


def make_problem(case: Case, seed: int, world_size: int) -> Problem:
    g = torch.Generator().manual_seed(seed)
    Mall = case.Ms[0] if case.replicated else sum(case.Ms)
    x = torch.randn(Mall, case.K, generator=g).to(case.dtype)
    logits = torch.randn(Mall, case.E, generator=g)
    if case.routing == "rank0":
        # Only rank 0's experts can be picked (topk <= El in these cases).
        held0 = local_expert_ids(case.E, world_size, 0, case.placement)
        bias = torch.full((case.E,), -1e4)
        bias[held0] = 0.0
        logits = logits + bias
    probs = torch.softmax(logits, dim=-1)
    tw, ti = probs.topk(case.topk, dim=-1)
    tw = tw / tw.sum(dim=-1, keepdim=True)
    w1 = (torch.randn(case.E, 2 * case.N, case.K, generator=g) / math.sqrt(case.K)).to(case.dtype)
    w2 = (torch.randn(case.E, case.K, case.N, generator=g) / math.sqrt(case.N)).to(case.dtype)
    w1q, s1 = quantize_weights(w1, case.quant)
    w2q, s2 = quantize_weights(w2, case.quant)
    a1s = a2s = None
    if case.quant.static_activation_scale:
        a1s = (x.float().abs().amax().clamp(min=1e-12) / 448.0).reshape(1)
        a2s = torch.tensor([0.02])
    return Problem(x, tw.float(), ti.to(torch.int32), w1q, w2q, MoEQuantParams(case.quant, s1, s2, a1s, a2s))


def _shared_mlp(x: torch.Tensor) -> torch.Tensor:
    return (x.float() * 0.5 + 1.0).to(x.dtype)


def run_forward(case: Case, pgi, context: ParallelContext, seed: int):
    """This rank's output, the global problem and this rank's token rows (and the PF)."""
    W, rank = pgi.world_size, pgi.rank
    prob = make_problem(case, seed, W)
    if case.replicated:
        rows = slice(0, case.Ms[0])
    else:
        start = sum(case.Ms[:rank])
        rows = slice(start, start + case.Ms[rank])
    moe = MoEConfig(num_experts=case.E, topk=case.topk, hidden_dim=case.K, intermediate_dim=case.N,
                    dtype=case.dtype, quant=case.quant,
                    parallel=ParallelConfig(ep_size=W, ep_rank=rank, placement=case.placement),
                    max_num_tokens=max(max(case.Ms), 1))
    cls = PF_TYPES[case.pf]
    pf = cls.make(moe, context, combine_wire=case.wire) if case.wire else cls.make(moe, context)
    held = local_expert_ids(case.E, W, rank, case.placement)
    q = prob.quant
    quant = MoEQuantParams(q.config, None if q.w1_scale is None else q.w1_scale[held],
                           None if q.w2_scale is None else q.w2_scale[held], q.a1_scale, q.a2_scale)
    fe = EXPERTS_BY_FORMAT[cls.activation_format()].for_prepare_finalize(moe, quant, pf)
    kernel = FusedMoEModularKernel(pf, fe, shared_experts=_shared_mlp if case.shared else None,
                                   workspaces=WorkspaceCache(poison=float("nan")), check_inputs=True)
    x, tw, ti = prob.x[rows], prob.topk_weights[rows], prob.topk_ids[rows]
    out = torch.full_like(x, float("nan"))
    result = kernel(x, prob.w1[held], prob.w2[held], tw, ti, activation=Activation.SILU,
                    global_num_experts=case.E, expert_map=make_expert_map(case.E, W, rank, case.placement),
                    apply_router_weight_on_input=case.on_input, output=out)
    if case.shared:
        shared_out, out = result
        assert torch.equal(shared_out, _shared_mlp(x)), "shared experts output differs"
    return out, prob, rows, pf


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.numel() == 0:
        return 0.0
    if torch.isnan(out).any():
        return float("nan")
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


def check_cases(pgi, context: ParallelContext, cases: list[Case], seed0: int) -> list[str]:
    """Run every case on this rank against the float32 oracle; returns failure messages."""
    failures = []
    for i, case in enumerate(cases):
        out, prob, rows, _ = run_forward(case, pgi, context, seed0 + i)
        ref = moe_torch(prob.x, prob.w1, prob.w2, prob.topk_weights, prob.topk_ids, Activation.SILU, prob.quant,
                        apply_router_weight_on_input=case.on_input)[rows]
        err, tol = rel_error(out, ref), tolerance(case.dtype, case.quant)
        if case.replicated:
            # The same full output on every rank, bit for bit.
            gathered = [torch.empty_like(out) for _ in range(pgi.world_size)]
            dist.all_gather(gathered, out.contiguous(), group=pgi.group)
            if not all(torch.equal(gathered[0], o) for o in gathered):
                failures.append(f"{case.describe()}: outputs differ across ranks")
        if not (math.isfinite(err) and err <= tol):
            failures.append(f"{case.describe()}: rel error {err:.3g} > tol {tol:.3g}")
    return failures


def _worker(pgi, cases: list[Case], wire_Ms: Optional[tuple[int, ...]], seed0: int) -> None:
    """One launch per world size: construction errors, the case list, then the wires."""
    context = ParallelContext.from_group(pgi.group, pgi.device)
    try:
        failures = check_make_errors(pgi, context) if pgi.world_size == 2 else []
        failures += check_cases(pgi, context, cases, seed0)
        if wire_Ms is not None:
            failures += check_wires(pgi, context, wire_Ms, seed0 + len(cases))
    finally:
        context.destroy()
    if failures:
        raise AssertionError(f"rank {pgi.rank}: {len(failures)} checks failed:\n" + "\n".join(failures))


def _seed0(request) -> int:
    return zlib.crc32(request.node.name.encode()) % 10_000 * 100


# world size, its cases, and the per-rank token counts of its combine-wire check (None: none).
LAUNCHES = [
    (1, CASES_W1, None),
    (2, CASES_W2, (24, 16)),
    (4, CASES_W4, (12, 0, 9, 14)),  # a rank without tokens
]


@pytest.mark.parametrize("world_size,cases,wire_Ms", LAUNCHES, ids=["w1", "w2", "w4"])
def test_ep_prepare_finalize(world_size, cases, wire_Ms, request):
    """Cases vs the float32 oracle; at W >= 2 also the three combine wires vs a float64 oracle
    (prints rows sent per token and error per wire) and, at W = 2, make()'s errors."""
    parallel_launch(world_size, _worker, cases, wire_Ms, _seed0(request), timeout_s=LAUNCH_TIMEOUT_S)


# ---- combine wires against a float64 oracle ------------------------------------------------------

def moe_float64(prob: Problem) -> torch.Tensor:
    """The unquantized SiLU MoE in float64 (Mall, K)."""
    x, w1, w2 = prob.x.double(), prob.w1.double(), prob.w2.double()
    N = w2.size(2)
    out = torch.zeros_like(x)
    for t in range(x.size(0)):
        for j in range(prob.topk_ids.size(1)):
            e = int(prob.topk_ids[t, j])
            h = w1[e] @ x[t]
            y = w2[e] @ (F.silu(h[:N]) * h[N:])
            out[t] += float(prob.topk_weights[t, j]) * y
    return out


def check_wires(pgi, context: ParallelContext, Ms: tuple[int, ...], seed: int) -> list[str]:
    """Same float32 problem through the three wires; checks accuracy order and row counts.
    Returns failure messages (empty when all hold)."""
    W = pgi.world_size
    errors, rows_per_token = {}, {}
    for wire in COMBINE_WIRES:
        case = Case("a2a", Ms, E=8, topk=4, K=64, N=32, dtype=torch.float32, wire=wire)
        out, prob, rows, pf = run_forward(case, pgi, context, seed)
        ref64 = moe_float64(prob)[rows]
        err = torch.tensor([float((out.double() - ref64).norm() ** 2), float(ref64.norm() ** 2),
                            float(pf.last_combine_rows), float(out.size(0))], dtype=torch.float64)
        dist.all_reduce(err, group=pgi.group)
        errors[wire] = math.sqrt(err[0] / err[1])
        rows_per_token[wire] = float(err[2] / err[3])
    if pgi.rank == 0:
        for wire in COMBINE_WIRES:
            print(f"[W={W} topk=4] wire {wire:16s}: {rows_per_token[wire]:.2f} rows sent per token, "
                  f"rel error vs float64 {errors[wire]:.3g}", flush=True)
    checks = [
        (rows_per_token["per_route"] == 4.0, "per_route sends one row per route (T * topk)"),
        (rows_per_token["prereduced"] <= min(4, W), "prereduced sends at most one row per (token, rank)"),
        (rows_per_token["prereduced_hilo"] == 2 * rows_per_token["prereduced"], "hilo sends two rows per prereduced row"),
        (errors["prereduced_hilo"] * 10 <= errors["prereduced"], "hilo error at least 10x below prereduced"),
        (errors["per_route"] * 10 <= errors["prereduced"], "per_route error at least 10x below prereduced"),
        (errors["prereduced_hilo"] < 1e-4, "hilo error below 1e-4"),
    ]
    return [f"wires W={W}: {what}: rows/token {rows_per_token}, errors {errors}" for ok, what in checks if not ok]


# ---- construction errors (no process group needed for the wire registry) -------------------------

def test_invalid_combine_wire_lists_the_three():
    from moe_modular.prepare_finalize.combine_wire import combine_wire, default_combine_wire

    # The default never makes the combine coarser than the activation dtype.
    assert default_combine_wire(torch.bfloat16).name == "prereduced"
    assert default_combine_wire(torch.float16).name == "prereduced_hilo"
    assert default_combine_wire(torch.float32).name == "per_route"

    with pytest.raises(ValueError) as exc:
        combine_wire("fast")
    for name in ("per_route", "prereduced", "prereduced_hilo"):
        assert name in str(exc.value)


def check_make_errors(pgi, context: ParallelContext) -> list[str]:
    """make() refuses a bad wire name, a mismatched layout and a missing context (raises on failure)."""
    moe = MoEConfig(num_experts=4, topk=2, hidden_dim=8, intermediate_dim=4,
                    parallel=ParallelConfig(ep_size=pgi.world_size, ep_rank=pgi.rank))
    with pytest.raises(ValueError, match=r"combine wire \('fast'\) must be one of \['per_route', 'prereduced', 'prereduced_hilo'\]"):
        AllToAllPrepareAndFinalize.make(moe, context, combine_wire="fast")
    wrong = MoEConfig(num_experts=4, topk=2, hidden_dim=8, intermediate_dim=4)
    with pytest.raises(ValueError, match=r"moe.parallel \(ep_size=1, ep_rank=0\) must match the context \(ep_size=2"):
        AllToAllPrepareAndFinalize.make(wrong, context)
    with pytest.raises(TypeError, match="needs a ParallelContext"):
        LowLatencyAll2AllPrepareAndFinalize.make(moe, None)
    # A manager of another rank than moe.parallel names is refused by every EP PF's constructor.
    other = MoEConfig(num_experts=4, topk=2, hidden_dim=8, intermediate_dim=4,
                      parallel=ParallelConfig(ep_size=pgi.world_size, ep_rank=(pgi.rank + 1) % pgi.world_size))
    for cls in (NaiveAll2AllPrepareAndFinalize, AllGatherReduceScatterPrepareAndFinalize, AllToAllPrepareAndFinalize,
                LowLatencyAll2AllPrepareAndFinalize):
        with pytest.raises(ValueError, match=rf"manager \(rank {pgi.rank} of {pgi.world_size}\) must match moe.parallel "
                                             rf"\(ep_rank {other.ep_rank} of ep_size {pgi.world_size}\)"):
            cls(other, context.all2all(cls.BACKEND))
        assert cls.requires_distributed()
    return []
